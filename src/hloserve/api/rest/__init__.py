"""The KServe V2 REST front end: the routes and hypercorn server, the JSON/binary codec,
the strict HTTP/1.1 parser and the zero-copy request view."""
