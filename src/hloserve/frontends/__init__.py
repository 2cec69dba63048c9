"""The frontend processes (`server.frontends: K`): the engine's pool of them, the
process itself, and the link between them (its protocol and its two ends)."""
