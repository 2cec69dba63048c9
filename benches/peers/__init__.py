"""Peer servers run beside hloserve in benchmarks, each installed in its own venv under .tools/peers."""
