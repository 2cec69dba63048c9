"""Python 3.14 removed `asyncio.AbstractChildWatcher`, which trio-asyncio 0.16.0 (the newest)
subclasses at import, so without this it cannot be imported there at all.

The package imports this module before any of its modules imports trio-asyncio. Where the class
is missing it puts back an empty one: trio-asyncio only subclasses it for a child watcher that
Python 3.14's asyncio never asks for (its event loop policies no longer take watchers), and
hloserve starts no subprocess through asyncio. Where the class exists this does nothing. The fix
upstream is one line in `trio_asyncio/_loop.py`: subclass
`getattr(asyncio, "AbstractChildWatcher", object)`.
"""

from __future__ import annotations

import asyncio

__all__ = ["restored_child_watcher"]

restored_child_watcher = not hasattr(asyncio, "AbstractChildWatcher")
"""Whether this Python lacked the class and this module put an empty one in its place."""

if restored_child_watcher:

    class AbstractChildWatcher:
        """Stands in for the class Python 3.14 removed: trio-asyncio only subclasses it."""

    setattr(asyncio, "AbstractChildWatcher", AbstractChildWatcher)  # noqa: B010  (typed as asyncio's own class)
