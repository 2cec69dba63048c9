"""The node suite (supervisor, Envoy, placement, DNS discovery) runs its workers with one process
each (`server.frontends` 0), unlike the worker-level suites: what a worker answers with frontends
is covered by those, and the node's own paths (routes, placement, restarts) do not depend on it.
Not trivial to add: these tests find and signal workers by pid and command line, and K=2 would
triple the processes they start on two cores.
"""
