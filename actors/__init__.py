"""The trio actors of one hloserve worker: model queues, the dispatcher and the weight cache."""

INLINE_WORK_S = 0.5e-3
"""Blocking work (an execution, a weight load) expected to take at most this long runs on the
event loop's own thread. A worker-thread hop costs about 0.1 ms of CPU, and while the loop keeps
a core busy the worker can wait milliseconds to be scheduled there: longer work is worth it,
shorter work is not."""
