"""The protocols: the planes every adapter serves through (`data_plane`: inference and
readiness; `model_plane`: metadata, configuration, statistics; `repository_plane`: the
repository and shared-memory regions), the adapters over them (the gRPC inference service and
its server, health, the control service, `rest/`), and the codecs named by what they translate
(`tensor_codec`: ModelInfer messages to arrays; `wire_codec`: gRPC bytes to messages, whose
tensors `viewed_request` leaves in the bytes received), the shared-memory registry and the
error-to-status mapping."""
