"""What tracing costs a served request: the serving benchmark's MLP over gRPC, with tracing off
(the default) and on at two samplers, in one run.

Variants, each `hloserve serve` on the example repository, measured like `serving` (perf_analyzer
on core 1, the server pinned to core 0, its /proc CPU time over the requests it answered):

* `off`: no `OTEL_*` variable; the SDK is never imported (what every request pays is a few None
  checks, timed below);
* `on, ratio 0`: `OTEL_TRACES_EXPORTER=otlp`, `traceidratio` at 0: each request's spans are made
  by the SDK but none is sampled or exported;
* `on, ratio 1`: the same at 1: every request's 7 spans (ModelInfer and its decode, admission, queue, execute,
  encode and reply) are exported over OTLP/gRPC to a trace
  service this process runs on loopback (on the clients' core), which counts them.

The variants take turns, `ROUNDS` times, so that drift in the machine's load falls on all of them;
each figure is compared with the `off` of its own round. The cost of the off path itself, too
small for perf_analyzer to see, is timed in-process: the statements tracing adds to a plain
request (`_off_path`) against the same call without them.
"""

from __future__ import annotations

import threading
import time
import timeit
from concurrent import futures
from dataclasses import asdict, dataclass
from typing import Any

from benches.serving import _free_port, install, measure, start_server

SCENARIOS = (("mlp c=1", 1), ("mlp c=16", 16))
"""(name, perf_analyzer concurrency): the tiny MLP, where per-request costs show most."""
ROUNDS = 2


@dataclass(frozen=True)
class Row:
    round: int
    variant: str
    scenario: str
    throughput: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms_per_request: float
    requests: int
    spans_received: int


@dataclass(frozen=True)
class OffPath:
    ns_per_request: float
    """What the off path's statements add to a request, in-process (`off_path_ns`)."""


class _Receiver:
    """An OTLP/gRPC trace service on 127.0.0.1 that counts the spans it is sent."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans = 0
        self._lock = threading.Lock()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # the generated servicer names it
                n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                with receiver._lock:
                    receiver.spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def count(self) -> int:
        with self._lock:
            return self.spans

    def stop(self) -> None:
        self._server.stop(0)


def _variants(endpoint: str) -> dict[str, dict[str, str]]:
    on = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "traceidratio",
        # export every span: the default queue (2048) drops most of them at these rates
        "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    return {
        "off": {},
        "on, ratio 0": {**on, "OTEL_TRACES_SAMPLER_ARG": "0"},
        "on, ratio 1": {**on, "OTEL_TRACES_SAMPLER_ARG": "1"},
    }


def run(window_ms: int = 3000) -> list[Row | OffPath]:
    install()
    receiver = _Receiver()
    rows: list[Row | OffPath] = [OffPath(off_path_ns())]
    try:
        for round_ in range(1, ROUNDS + 1):
            for variant, settings in _variants(f"http://127.0.0.1:{receiver.port}").items():
                port = _free_port()
                server = start_server(port, settings=settings)
                try:
                    for name, concurrency in SCENARIOS:
                        before = receiver.count()
                        url = f"127.0.0.1:{port}"
                        r = _measure(url, server.pid, name, concurrency, window_ms)
                        time.sleep(0.5)  # the last spans' export (every 200 ms)
                        spans = receiver.count() - before
                        rows.append(
                            Row(round_, variant, name, r.throughput, r.p50_ms, r.p99_ms,
                                r.server_cpu_ms_per_request, r.requests, spans)
                        )  # fmt: skip
                finally:
                    server.terminate()
                    server.wait(30)
    finally:
        receiver.stop()
    return rows


def _measure(url: str, pid: int, name: str, concurrency: int, window_ms: int) -> Any:
    """`measure` of the MLP, once more with a window twice as long if perf_analyzer finds no
    stable figure (on a loaded machine it sometimes does not in three windows)."""
    try:
        return measure(url, pid, name, "mlp", concurrency, ["-b", "1"], window_ms)
    except RuntimeError as e:
        print(f"{name}: {str(e).splitlines()[0]}; once more with a {2 * window_ms} ms window", flush=True)
        return measure(url, pid, name, "mlp", concurrency, ["-b", "1"], 2 * window_ms)


def _off_path(service: Any, spans: Any, requests: list[Any]) -> None:
    """The statements that tracing adds to a plain gRPC request when it is off, as the request
    meets them: the handler (`InferenceService._model_infer`), `_infer`, `_execute`, and the
    dispatcher's execution of its batch (`Dispatcher._run`)."""
    received = 0 if service._tracing is None else 1  # _model_infer
    if service._tracing is not None:
        spans = received
    if spans is not None:  # _infer: decode
        pass
    if spans is not None:  # admission
        pass
    if spans is not None:  # _execute
        pass
    for request in requests:  # Dispatcher._run
        if request.trace is not None:
            pass
    if spans is not None:  # encode
        pass
    if spans is not None:  # _model_infer: reply
        pass


def _without(service: Any, spans: Any, requests: list[Any]) -> None:
    """`_off_path`'s call, without its statements."""


def off_path_ns() -> float:
    """Nanoseconds that `_off_path` adds to a request (the best of 5 runs of a million calls),
    with the service and the queued request of a real worker's types."""
    import concurrent.futures

    import numpy as np

    from hloserve.actors.messages import Infer

    class Service:
        __slots__ = ("_tracing",)

        def __init__(self) -> None:
            self._tracing = None

    request = Infer("mlp", [np.zeros((1, 16), np.float32)], 1, [0], concurrent.futures.Future(), 0.0)
    args = (Service(), None, [request])
    n = 1_000_000
    with_path = min(timeit.repeat(lambda: _off_path(*args), number=n, repeat=5))
    without = min(timeit.repeat(lambda: _without(*args), number=n, repeat=5))
    return (with_path - without) / n * 1e9


def table(results: list[Row | OffPath]) -> str:
    header = ("round", "variant", "scenario", "infer/s", "p50 ms", "p99 ms", "CPU ms/req", "CPU x off",
              "infer/s x off", "spans/req")  # fmt: skip
    lines = ["{:>5} {:<12} {:<9} {:>8} {:>7} {:>7} {:>10} {:>9} {:>13} {:>9}".format(*header)]
    rows = [r for r in results if isinstance(r, Row)]
    (off_path,) = [r for r in results if isinstance(r, OffPath)]
    off = {(r.round, r.scenario): r for r in rows if r.variant == "off"}
    for r in rows:
        base = off[r.round, r.scenario]
        cpu_ratio = r.server_cpu_ms_per_request / base.server_cpu_ms_per_request
        lines.append(
            f"{r.round:5d} {r.variant:<12} {r.scenario:<9} {r.throughput:8.1f} {r.p50_ms:7.3f} "
            f"{r.p99_ms:7.3f} {r.server_cpu_ms_per_request:10.4f} {cpu_ratio:9.3f} "
            f"{r.throughput / base.throughput:13.3f} {r.spans_received / max(r.requests, 1):9.2f}"
        )
    ns = off_path.ns_per_request
    least = min(r.server_cpu_ms_per_request for r in off.values()) * 1e6
    share = ns / least
    lines += ["", f"the off path, in-process: {ns:.0f} ns per request, {share:.3%} of the least server"
              " CPU per request with tracing off"]  # fmt: skip
    return "\n".join(lines)


def as_json(results: list[Row | OffPath]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
