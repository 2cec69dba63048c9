"""The KServe V2 REST adapter: the routes and hypercorn server, `json_codec` (REST bodies to
ModelInfer messages), the bounded bodies and the zero-copy request view."""
