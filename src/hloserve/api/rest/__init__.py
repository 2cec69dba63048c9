"""The KServe V2 REST adapter: the routes and hypercorn server, `json_codec` (REST bodies to
ModelInfer messages) and the bounded bodies."""
