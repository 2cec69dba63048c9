"""A catalogue ten times larger than the weight budget, under Zipf-distributed traffic.

Ten models of 8 MB of weights each (cheap maths: the weights are what moves), a budget of one
model's weights, and four clients picking models by a Zipf law (s = 1.1). The same load runs
against the same catalogue with no budget (everything resident); the table gives throughput,
errors, loads and evictions, and the ratio of the two throughputs.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benches.serving import _free_port, install, start_server

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


def _catalogue(directory: Path) -> None:
    from hloserve.export import InputSpec, export_bundle

    def model(params: Any, x: Any) -> Any:
        return x @ params["w"] + params["big"][:4]

    for i in range(MODELS):
        params = {"big": np.full(WEIGHT_FLOATS, i, np.float32), "w": np.eye(16, 4, dtype=np.float32)}
        export_bundle(model, params, [InputSpec("INPUT0", (16,))], directory / f"m{i}", batch_sizes=(1,))


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


def run(window_ms: int = 3000) -> list[Row]:
    install()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "catalogue"
        _catalogue(repository)
        for label, budget in (
            ("none (all resident)", None),
            ("1/10 of the catalogue", WEIGHT_FLOATS * 4 + 1024),
        ):
            os.environ["HLOSERVE_SERVER_MODEL_REPOSITORY"] = str(repository)
            if budget is None:
                os.environ.pop("HLOSERVE_WEIGHTS_BUDGET_BYTES", None)
            else:
                os.environ["HLOSERVE_WEIGHTS_BUDGET_BYTES"] = str(budget)
            port = _free_port()
            server = start_server(port)
            try:
                ok, errors = _load(f"127.0.0.1:{port}", SECONDS)
                loads, evictions = _residency_counts(port)
            finally:
                server.terminate()
                server.wait(60)
                os.environ.pop("HLOSERVE_SERVER_MODEL_REPOSITORY", None)
                os.environ.pop("HLOSERVE_WEIGHTS_BUDGET_BYTES", None)
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


def table(rows: list[Row]) -> str:
    lines = ["{:<22} {:>9} {:>7} {:>6} {:>10}".format("budget", "infer/s", "errors", "loads", "evictions")]
    for r in rows:
        lines.append(f"{r.budget:<22} {r.throughput:9.1f} {r.errors:7d} {r.loads:6d} {r.evictions:10d}")
    if len(rows) == 2:
        lines.append(
            f"throughput with the budget / all resident: {rows[1].throughput / rows[0].throughput:.2f}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
