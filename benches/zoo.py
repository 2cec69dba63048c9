"""The zoo's models (tests/zoo) served by hloserve beside torch eager on the same machine.

Each zoo model is exported as `tox -e zoo` exports it (sharing its cache,
`$HLOSERVE_ZOO_CACHE`), one `hloserve serve` (not pinned, no weight budget) serves them, and
for each model at batch 1 and 4 (its compiled sizes, so one request is one execution):

- hloserve's compute per execution: ModelStatistics' compute_infer time over its count, after
  warm-up, over `REPEATS` sequential requests;
- the whole request's latency through gRPC (tritonclient, inputs and outputs included; model.py's
  postprocess too, for the detector), median of the same requests;
- torch eager's time for the same module on the same inputs in this process (median of
  `REPEATS`, after warm-up), with torch's default thread count, printed with the table.

The ratio is hloserve's compute over torch's: above 1, XLA:CPU is slower. `--quick` runs one
small model at batch 1 with few repeats (what tests/test_benches.py runs).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benches.serving import _free_port

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 10
WARMUP = 3
QUICK_MODELS = ("regnet_y_400mf",)


@dataclass(frozen=True)
class Row:
    model: str
    batch: int
    hloserve_ms: float
    torch_ms: float
    ratio: float
    grpc_ms: float
    torch_threads: int


def _zoo() -> Any:
    """tests/zoo/test_zoo.py as a module: its export cache, its models' builders and inputs."""
    for path in (ROOT / "examples", ROOT / "tests", ROOT / "tests" / "zoo"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import test_zoo

    return test_zoo


def _serve(repository: Path, executables: Path, port: int) -> subprocess.Popen[bytes]:
    import tritonclient.grpc as grpcclient

    env = {
        **{k: v for k, v in os.environ.items() if k != "HLOSERVE_ZOO_CACHE"},  # not a server setting
        "HLOSERVE_LOGGING_FORMAT": "json",
        "HLOSERVE_SERVER_MODEL_REPOSITORY": str(repository),
        "HLOSERVE_SERVER_EXECUTABLE_CACHE": str(executables),
    }
    command = [sys.executable, "-m", "hloserve.cli", "serve", "--grpc-port", str(port)]
    command += ["--http-port", "-1", "--metrics-port", "-1"]
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 1200  # compiles every model's executables unless cached
        while time.monotonic() < deadline:
            try:
                if client.is_server_ready():
                    client.close()
                    return process
            except Exception:  # not listening yet
                pass
            if process.poll() is not None:
                errors.seek(0)
                raise RuntimeError(f"hloserve serve exited: {errors.read().decode()[-3000:]}")
            time.sleep(0.5)
        process.kill()
        raise RuntimeError("hloserve serve did not become ready")


def _served(client: Any, name: str, inputs: dict[str, Any], repeats: int) -> tuple[float, float]:
    """(compute ms per execution from ModelStatistics, median gRPC latency ms)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for key, array in inputs.items():
        tensors.append(grpcclient.InferInput(key, list(array.shape), np_to_triton_dtype(array.dtype)))
        tensors[-1].set_data_from_numpy(array)
    for _ in range(WARMUP):
        client.infer(name, tensors, client_timeout=600)

    def compute() -> tuple[int, int]:
        stats = client.get_inference_statistics(name).model_stats[0].inference_stats.compute_infer
        return stats.ns, stats.count

    ns_before, count_before = compute()
    latencies = []
    for _ in range(repeats):
        started = time.perf_counter()
        client.infer(name, tensors, client_timeout=600)
        latencies.append(time.perf_counter() - started)
    ns_after, count_after = compute()
    per_execution = (ns_after - ns_before) / max(count_after - count_before, 1) / 1e6
    return per_execution, statistics.median(latencies) * 1e3


def _eager(model: Any, inputs: dict[str, Any], repeats: int) -> float:
    import torch

    arguments = [torch.from_numpy(a) for a in inputs.values()]
    times = []
    with torch.no_grad():
        for k in range(WARMUP + repeats):
            started = time.perf_counter()
            model(*arguments)
            if k >= WARMUP:
                times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def run(window_ms: int = 0, quick: bool = False, models: list[str] | None = None) -> list[Row]:
    del window_ms  # a fixed number of requests, not a window
    import torch
    import tritonclient.grpc as grpcclient

    zoo = _zoo()
    names = tuple(models or (QUICK_MODELS if quick else zoo.ZOO))
    unknown = [n for n in names if n not in zoo.ZOO]
    if unknown:
        raise ValueError(f"not zoo models: {unknown}; the zoo: {list(zoo.ZOO)}")
    batches, repeats = ((1,), 3) if quick else ((1, 4), REPEATS)
    root = zoo._cache_root()
    for name in names:
        failed = zoo._export(name, root)
        if failed is not None:
            raise RuntimeError(f"export of {name} failed:\n{failed}")
    with tempfile.TemporaryDirectory() as scratch:  # only the chosen models, linked
        repository = Path(scratch) / "repository"
        repository.mkdir()
        for name in names:
            (repository / name).symlink_to(root / "repository" / name, target_is_directory=True)
        port = _free_port()
        server = _serve(repository, root / "executables", port)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        rows = []
        try:
            for name in names:
                model = zoo._builder(name)()
                for batch in batches:
                    inputs = zoo._requests(name, batch, seed=1)
                    compute, grpc = _served(client, name, inputs, repeats)
                    eager = _eager(model, inputs, repeats)
                    rows.append(
                        Row(name, batch, round(compute, 2), round(eager, 2), round(compute / eager, 2),
                            round(grpc, 2), torch.get_num_threads())
                    )  # fmt: skip
                    print(f"  {rows[-1]}", flush=True)
                del model
        finally:
            client.close()
            server.terminate()
            server.wait(60)
    return rows


def table(rows: list[Row]) -> str:
    lines = [f"{'model':<32} {'batch':>5} {'hloserve ms':>12} {'torch ms':>10} {'ratio':>6} {'gRPC ms':>9}"]
    for r in rows:
        figures = f"{r.hloserve_ms:>12.2f} {r.torch_ms:>10.2f} {r.ratio:>6.2f} {r.grpc_ms:>9.2f}"
        lines.append(f"{r.model:<32} {r.batch:>5} {figures}")
    if rows:
        ratios = sorted(r.ratio for r in rows)
        lines.append(
            f"median ratio {statistics.median(ratios):.2f}, max {ratios[-1]:.2f}; "
            f"torch eager with {rows[0].torch_threads} threads"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
