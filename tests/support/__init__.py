"""Code the tests share: starting a worker (`servers`) and talking to one (`clients`).

Imported as `support.servers` and `support.clients`: pytest puts `tests/` on `sys.path` (it is
the rootdir of the top-level modules, which are not in a package).
"""
