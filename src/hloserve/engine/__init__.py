"""The engine: the model table, admission, the scheduling policy, batching, hooks, meta
models, the weight budget, statistics, metrics, traces, the repository watcher and the buffer
pool. The actors (`hloserve.actors`) belong to this layer."""
