"""The protocols: the data plane every adapter serves through (`data_plane`), the gRPC
inference service and its server, the control service, health, the wire codec, the
shared-memory registry, the error-to-status mapping; `rest/` holds the KServe V2 REST
front end."""
