"""Where a tiny request's server CPU goes: the MLP at concurrency 1 and 16 through four servers, peeled.

Each variant is `hloserve serve` on the example repository with one layer taken away, measured
like `serving` (perf_analyzer on core 1, the server pinned to core 0, its /proc CPU time over the
requests it answered), all in one run:

* `full`: the server as shipped;
* `no execution`: the compiled model answers zeros without calling XLA (front end, codec, actors);
* `no actors`: the handler decodes, runs the compiled model itself and encodes (front end, codec,
  XLA), as a server without queues or a dispatcher would;
* `canned reply`: ModelInfer answers one fixed reply without reading the request (grpclib, h2,
  trio-asyncio and the protobuf parse: the floor of the fixed stack).

The differences give each layer's share. Run a variant by hand with
`python -m benches.breakdown VARIANT serve [hloserve serve flags]`.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any

from benches.serving import _free_port, install, measure, start_server

VARIANTS = ("full", "no execution", "no actors", "canned reply")


CONCURRENCY = (1, 16)


@dataclass(frozen=True)
class Row:
    variant: str
    concurrency: int
    throughput: float
    p50_ms: float
    server_cpu_ms_per_request: float


def run(window_ms: int = 3000) -> list[Row]:
    install()
    rows = []
    for variant in VARIANTS:
        port = _free_port()
        server = start_server(port, module=None if variant == "full" else ("benches.breakdown", variant))
        try:
            for c in CONCURRENCY:
                r = measure(f"127.0.0.1:{port}", server.pid, variant, "mlp", c, ["-b", "1"], window_ms)
                rows.append(Row(variant, c, r.throughput, r.p50_ms, r.server_cpu_ms_per_request))
        finally:
            server.terminate()
            server.wait(30)
    return rows


def table(rows: list[Row]) -> str:
    lines = [f"{'variant':<14} {'conc.':>5} {'infer/s':>9} {'p50 ms':>8} {'server CPU ms/req':>18}"]
    for r in rows:
        lines.append(
            f"{r.variant:<14} {r.concurrency:5d} {r.throughput:9.1f} {r.p50_ms:8.3f} "
            f"{r.server_cpu_ms_per_request:18.3f}"
        )
    lines += [
        "",
        f"{'layer: server CPU ms/req (difference of two variants)':<56} "
        + " ".join(f"{'c=' + str(c):>7}" for c in CONCURRENCY),
    ]
    cpu = {(r.variant, r.concurrency): r.server_cpu_ms_per_request for r in rows}
    layers = (
        ("grpclib, h2, trio-asyncio, parse (canned reply)", lambda c: cpu["canned reply", c]),
        ("codec and XLA (no actors - canned reply)", lambda c: cpu["no actors", c] - cpu["canned reply", c]),
        (
            "actors: queue, dispatcher, weights (full - no actors)",
            lambda c: cpu["full", c] - cpu["no actors", c],
        ),
        ("XLA's execution (full - no execution)", lambda c: cpu["full", c] - cpu["no execution", c]),
    )
    for name, value in layers:
        lines.append(f"{name:<56} " + " ".join(f"{value(c):7.3f}" for c in CONCURRENCY))
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


# -- the variants, run as `python -m benches.breakdown VARIANT serve ...` ----------------------


def _without_execution() -> None:
    import numpy as np

    from hloserve.models.compiled import CompiledModel, ExecutionResult

    def execute(self: CompiledModel, batch_size: int, inputs: Any, weights: Any) -> ExecutionResult:
        results = self.bundle.module_for(batch_size).signature.outputs
        return ExecutionResult([np.zeros(t.shape, t.dtype.numpy) for t in results], 0.0, 0.0)

    CompiledModel.execute = execute  # type: ignore[method-assign]


def _without_actors() -> None:
    from hloserve.api.data_plane import LocalDataPlane, ready_entry
    from hloserve.api.tensor_codec import decode_request, encode_response
    from hloserve.engine.batching import assemble
    from hloserve.models import _xla
    from hloserve.models.bundle import read_weights

    weights: dict[str, list[Any]] = {}

    async def infer(self: LocalDataPlane, request: Any, deadline: Any, spans: Any = None) -> Any:
        entry = ready_entry(self._models, request.model_name, request.model_version)
        assert entry.bundle is not None and entry.compiled is not None
        manifest = entry.bundle.manifest
        decoded = decode_request(
            request, entry.name, manifest.inputs, manifest.outputs, entry.max_rows, self._shm
        )
        if entry.name not in weights:
            weights[entry.name] = [_xla.put(w) for w in read_weights(entry.bundle)]
        size = min(b for b in entry.compiled.batch_sizes if b >= decoded.rows)
        inputs = assemble(manifest.executable_inputs, [decoded.inputs], size)
        result = entry.compiled.execute(size, inputs, weights[entry.name])
        stats = self._statistics[entry.name]  # kept as the actors keep them: perf_analyzer reads them
        stats.queue.add(0.0)
        stats.record_execution(size, decoded.rows, result.input_s, result.infer_s, 0.0)
        outputs = [o[: decoded.rows] for o in result.outputs]
        return encode_response(
            request, entry.name, manifest.outputs, decoded, [outputs[i] for i in decoded.outputs]
        )

    LocalDataPlane.infer = infer  # type: ignore[method-assign]


def _canned_reply() -> None:
    import numpy as np

    from hloserve._proto.hot import hot_infer_pb2 as hot
    from hloserve.api.data_plane import LocalDataPlane

    reply = hot.ModelInferResponse(model_name="mlp", model_version="1")
    output = reply.outputs.add(name="OUTPUT0", datatype="FP32")
    output.shape.extend([1, 4])
    reply.raw_output_contents.append(np.zeros(4, np.float32).tobytes())

    async def infer(self: LocalDataPlane, request: Any, deadline: Any, spans: Any = None) -> Any:
        stats = self._statistics["mlp"]  # kept as the actors keep them: perf_analyzer reads them
        stats.queue.add(0.0)
        stats.record_execution(1, 1, 0.0, 0.0, 0.0)
        return reply

    LocalDataPlane.infer = infer  # type: ignore[method-assign]


if __name__ == "__main__":
    variant, argv = sys.argv[1], sys.argv[2:]
    {"no execution": _without_execution, "no actors": _without_actors, "canned reply": _canned_reply}[
        variant
    ]()
    from hloserve.cli import main

    sys.exit(main(argv))
