"""The path the docs gave for the client's shared-memory pool before the move into packages,
kept for the scripts that import it: the code is `hloserve.engine.buffer_pool`'s, and
`hloserve.client` exports it beside the client (docs/api.md)."""

from hloserve.engine.buffer_pool import BufferPool as BufferPool

__all__ = ["BufferPool"]
