"""The weight cache: a catalogue ten times the budget under Zipf traffic, and cold loads.

Ten models of 8 MB of weights each (cheap maths: the weights are what moves), a budget of one
model's weights, and four clients picking models by a Zipf law (s = 1.1). The same load runs
against the same catalogue with no budget (everything resident), and with the budget without
overlapping loads (`weights.overlap_loads` off); the table gives throughput, errors, loads and
evictions, and each budgeted row's throughput over the all-resident one. The last row runs the
same budget over the catalogue exported with `precision="bf16"`: each model's weights are 4 MB,
so the budget holds two of them, a fifth of the catalogue instead of a tenth, and fewer requests
need a load (`loads/infer`).

Cold against warm: models of 10, 100 and 500 MB of weights, each requested right after another
model evicted it (cold) and again (warm), beside a raw device_put of the same host arrays from
pageable memory and from pinned host memory (where the server's floors live); the last columns
are the cold request's extra time over each raw put.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benches.serving import _free_port, start_server


def platform() -> str:
    """The platform to export for: this machine's (cuda on a GPU machine, else cpu)."""
    from hloserve.models import _xla

    return "cuda" if _xla.device().platform == "gpu" else "cpu"


MODELS = 10
WEIGHT_FLOATS = 2 << 20  # 8 MB of float32 per model
SECONDS = 8.0


@dataclass(frozen=True)
class Row:
    budget: str
    throughput: float
    errors: int
    loads: int
    evictions: int


def _weighty(params: Any, x: Any) -> Any:
    return x @ params["w"] + params["big"][:4]


def _export_weighty(directory: Path, big: np.ndarray, precision: str = "fp32") -> None:
    """A model whose weights are what moves: it carries `big` and barely reads it (the maths is
    cheap). INPUT0 [n, 16] f32, compiled for batch size 1."""
    from hloserve.export.jax import InputSpec, export_bundle

    export_bundle(
        _weighty,
        {"big": big, "w": np.eye(16, 4, dtype=np.float32)},
        [InputSpec("INPUT0", (16,))],
        directory,
        batch_sizes=(1,),
        platform=platform(),
        verify=False,  # a benchmark's synthetic model
        precision=precision,  # type: ignore[arg-type]
    )


def _catalogue(directory: Path, precision: str = "fp32") -> None:
    for i in range(MODELS):
        _export_weighty(directory / f"m{i}", np.full(WEIGHT_FLOATS, i, np.float32), precision)


def _load(url: str, seconds: float) -> tuple[int, int]:
    import tritonclient.grpc as grpcclient

    weights = 1.0 / np.arange(1, MODELS + 1) ** 1.1
    weights /= weights.sum()
    counts = {"ok": 0, "errors": 0}
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        c = grpcclient.InferenceServerClient(url)
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
        while time.monotonic() < stop:
            model = f"m{rng.choice(MODELS, p=weights)}"
            try:
                c.infer(model, [tensor])
                key = "ok"
            except Exception:
                key = "errors"
            with lock:
                counts[key] += 1
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts["ok"], counts["errors"]


def run(window_ms: int = 3000) -> list[Row | ColdRow]:
    return [*run_zipf(), *run_cold()]


def run_zipf() -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repositories = {"fp32": Path(tmp) / "catalogue", "bf16": Path(tmp) / "catalogue_bf16"}
        for precision, repository in repositories.items():
            _catalogue(repository, precision)
        budget_bytes = WEIGHT_FLOATS * 4 + 1024  # one fp32 model, two bf16 ones
        for label, budget, overlap, precision in (
            ("none (all resident)", None, True, "fp32"),
            ("1/10 of the catalogue", budget_bytes, True, "fp32"),
            ("1/10, loads not overlapped", budget_bytes, False, "fp32"),
            ("same bytes, bf16 (1/5)", budget_bytes, True, "bf16"),
        ):
            settings = {
                "HLOSERVE_SERVER_MODEL_REPOSITORY": str(repositories[precision]),
                "HLOSERVE_WEIGHTS_OVERLAP_LOADS": str(overlap).lower(),
            }
            if budget is not None:
                settings["HLOSERVE_WEIGHTS_BUDGET_BYTES"] = str(budget)
            port = _free_port()
            server = start_server(port, settings=settings)
            try:
                ok, errors = _load(f"127.0.0.1:{port}", SECONDS)
                loads, evictions = _residency_counts(port)
            finally:
                server.terminate()
                server.wait(60)
            rows.append(Row(label, ok / SECONDS, errors, loads, evictions))
    return rows


def _residency_counts(port: int) -> tuple[int, int]:
    import asyncio

    from grpclib.client import Channel

    from hloserve._proto import hloserve_control as hc

    async def main() -> tuple[int, int]:
        channel = Channel("127.0.0.1", port)
        try:
            status = await hc.ControlServiceStub(channel).model_control_status(hc.ModelControlStatusRequest())
        finally:
            channel.close()
        return sum(m.loads for m in status.models), sum(m.evictions for m in status.models)

    return asyncio.run(main())


def table(all_rows: list[Row | ColdRow]) -> str:
    rows = [r for r in all_rows if isinstance(r, Row)]
    lines = [
        "{:<26} {:>9} {:>7} {:>6} {:>10} {:>12} {:>13}".format(
            "budget", "infer/s", "errors", "loads", "evictions", "loads/infer", "/all resident"
        )
    ]
    for r in rows:
        ratio = r.throughput / rows[0].throughput if rows[0].throughput else float("nan")
        per_infer = r.loads / (r.throughput * SECONDS) if r.throughput else float("nan")
        lines.append(
            f"{r.budget:<26} {r.throughput:9.1f} {r.errors:7d} {r.loads:6d} {r.evictions:10d} "
            f"{per_infer:12.2f} {ratio:13.2f}"
        )
    cold = [r for r in all_rows if isinstance(r, ColdRow)]
    return "\n".join(lines) + ("\n\n" + cold_table(cold) if cold else "")


def as_json(rows: list[Row | ColdRow]) -> list[dict[str, Any]]:
    return [
        {
            **asdict(r),
            **(
                {"overhead_ratio": r.overhead_ratio, "pinned_overhead_ratio": r.pinned_overhead_ratio}
                if isinstance(r, ColdRow)
                else {}
            ),
        }
        for r in rows
    ]


SIZES_MB = (10, 100, 500)


@dataclass(frozen=True)
class ColdRow:
    weights_mb: int
    warm_ms: float
    cold_ms: float
    raw_put_ms: float
    raw_pinned_put_ms: float | None = None
    """The same put from pinned host memory; None where pinning failed."""

    @property
    def overhead_ratio(self) -> float:
        """Cold request's extra time over a raw device_put of the same bytes."""
        return (self.cold_ms - self.warm_ms) / self.raw_put_ms

    @property
    def pinned_overhead_ratio(self) -> float | None:
        """Cold request's extra time over a raw put of the same bytes from pinned host memory."""
        if not self.raw_pinned_put_ms:
            return None
        return (self.cold_ms - self.warm_ms) / self.raw_pinned_put_ms


def run_cold(repeats: int = 5) -> list[ColdRow]:
    """Cold (weights evicted) against warm latency per model size, beside a raw device_put."""
    import statistics as stats

    from hloserve.models import _xla
    from hloserve.models.bundle import load_bundle, read_weights

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "sizes"
        for mb in (*SIZES_MB, 0):
            _export_weighty(repository / f"w{mb}", np.ones(max(4, mb * (1 << 18)), np.float32))
        raw, raw_pinned = {}, {}

        def median_put_ms(host: list[Any]) -> float:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                placed = _xla.put_all(host)
                for a in placed:
                    a.block_until_ready()
                times.append(time.perf_counter() - started)
                _xla.free(placed)
            return stats.median(times) * 1e3

        for mb in SIZES_MB:
            host = read_weights(load_bundle(repository / f"w{mb}"))
            raw[mb] = median_put_ms(host)
            try:
                pinned = _xla.pin(host)
            except Exception:  # no pinned memory here: the row says so with None
                raw_pinned[mb] = None
            else:
                raw_pinned[mb] = median_put_ms(pinned)
                _xla.free(pinned)
        port = _free_port()
        server = start_server(  # a budget of 1 byte: every load evicts whatever else is there
            port,
            settings={
                "HLOSERVE_SERVER_MODEL_REPOSITORY": str(repository),
                "HLOSERVE_WEIGHTS_BUDGET_BYTES": "1",
            },
        )
        try:
            for mb in SIZES_MB:
                cold, warm = cold_and_warm(f"127.0.0.1:{port}", "w0", f"w{mb}", repeats)
                rows.append(ColdRow(mb, stats.median(warm), stats.median(cold), raw[mb], raw_pinned[mb]))
        finally:
            server.terminate()
            server.wait(60)
    return rows


def cold_and_warm(
    url: str, evictor: str, model: str, repeats: int, pause_s: float = 0.0
) -> tuple[list[float], list[float]]:
    """Milliseconds of `repeats` requests to `model` right after a request to `evictor` evicted
    its weights (cold), each followed by the same request again (warm)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), np.float32))

    def timed(name: str) -> float:
        started = time.perf_counter()
        client.infer(name, [tensor])
        return (time.perf_counter() - started) * 1e3

    cold, warm = [], []
    try:
        for _ in range(repeats):
            timed(evictor)
            cold.append(timed(model))
            warm.append(timed(model))
            time.sleep(pause_s)
    finally:
        client.close()
    return cold, warm


def cold_table(rows: list[ColdRow]) -> str:
    lines = [
        "{:>10} {:>8} {:>8} {:>12} {:>15} {:>15} {:>15}".format(
            "weights", "warm ms", "cold ms", "raw put ms", "pinned put ms", "overhead/put", "overhead/pinned"
        )
    ]
    for r in rows:
        pinned = "-" if r.raw_pinned_put_ms is None else f"{r.raw_pinned_put_ms:.3f}"
        ratio = "-" if r.pinned_overhead_ratio is None else f"{r.pinned_overhead_ratio:.1f}"
        times = f"{r.warm_ms:8.2f} {r.cold_ms:8.2f} {r.raw_put_ms:12.3f} {pinned:>15}"
        lines.append(f"{r.weights_mb:>7} MB {times} {r.overhead_ratio:15.1f} {ratio:>15}")
    return "\n".join(lines)
