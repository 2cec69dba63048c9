"""The node's controller: discovery of what each worker serves, placement of models on workers,
the routes Envoy follows, and the RPCs that span workers. Off the byte path: Envoy forwards every
request's bytes; nothing here touches a tensor."""
