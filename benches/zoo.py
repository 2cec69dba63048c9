"""The zoo's models (tests/zoo) served by hloserve beside torch eager on the same machine.

Each zoo model is exported as `tox -e zoo` exports it (sharing its cache,
`$HLOSERVE_ZOO_CACHE`), one `hloserve serve` (not pinned, no weight budget) serves them, and
for each model at batch 1 and 4 (its compiled sizes, so one request is one execution):

- hloserve's compute per execution: ModelStatistics' compute_infer time over its count, after
  warm-up, over `REPEATS` sequential requests;
- the whole request's latency through gRPC (tritonclient, inputs and outputs included; model.py's
  postprocess too, for the detector), median of the same requests;
- torch eager's time for the same module on the same inputs in this process, each call taken
  right after hloserve's request (median of `REPEATS`, after `WARMUP`), with as many threads as
  XLA:CPU's pool has: one per core, every core or `--threads N` (both confined to N cores).

The ratio is hloserve's compute over torch's: above 1, XLA:CPU is slower. `--quick` runs one
small model at batch 1 with few repeats (what tests/test_benches.py runs).
"""

from __future__ import annotations

import os
import shutil
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
REPEATS = 5
WARMUP = 2
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
    xla_flags: str


def _zoo() -> Any:
    """tests/zoo/test_zoo.py as a module: its export cache, its models' builders and inputs."""
    for path in (ROOT / "examples", ROOT / "tests", ROOT / "tests" / "zoo"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import test_zoo

    return test_zoo


def serve(
    repository: Path, port: int, executables: Path | None = None, cores: set[int] | None = None
) -> subprocess.Popen[bytes]:
    """`hloserve serve` over `repository`, once every model in it is ready. It listens only
    after loading, so a server that is live but not ready has failed a model: say which, why.
    `cores`: the CPUs it may run on (XLA:CPU sizes its thread pool by them)."""
    import tritonclient.grpc as grpcclient

    env = {
        **{k: v for k, v in os.environ.items() if k != "HLOSERVE_ZOO_CACHE"},  # not a server setting
        "HLOSERVE_LOGGING_FORMAT": "json",
        "HLOSERVE_SERVER_MODEL_REPOSITORY": str(repository),
        **({"HLOSERVE_SERVER_EXECUTABLE_CACHE": str(executables)} if executables else {}),
    }
    command = [sys.executable, "-m", "hloserve.cli", "serve", "--grpc-port", str(port)]
    command += ["--http-port", "-1", "--metrics-port", "-1"]
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: a full pipe would stall it
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 1200  # compiles every model's executables unless cached
        try:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    errors.seek(0)
                    raise RuntimeError(f"hloserve serve exited: {errors.read().decode()[-3000:]}")
                try:
                    live = client.is_server_live()
                except Exception:  # not listening yet
                    live = False
                if live:
                    if client.is_server_ready():
                        return process
                    failed = [m for m in client.get_model_repository_index().models if m.state != "READY"]
                    raise RuntimeError(
                        f"hloserve serve failed models: {[(m.name, m.reason) for m in failed]}"
                    )
                time.sleep(0.5)
            raise RuntimeError("hloserve serve did not start listening within 1200 s")
        except BaseException:
            process.kill()
            process.wait()
            raise
        finally:
            client.close()


def _repository(root: Path, names: tuple[str, ...], into: Path) -> Path:
    """A repository of the cached bundles `names`, hard-linked: the server refuses symbolic links
    that lead out of its repository (why the first draft's server never became ready)."""
    repository = into / "repository"
    for name in names:
        shutil.copytree(root / "repository" / name, repository / name, copy_function=os.link)
    return repository


def tensors(inputs: dict[str, Any]) -> list[Any]:
    """tritonclient's request inputs for the arrays `inputs` (by name)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    found = []
    for key, array in inputs.items():
        found.append(grpcclient.InferInput(key, list(array.shape), np_to_triton_dtype(array.dtype)))
        found[-1].set_data_from_numpy(array)
    return found


def served(client: Any, name: str, request: list[Any]) -> tuple[float, float]:
    """One request: (ms of compute it added to ModelStatistics, ms of its gRPC round trip). At a
    compiled batch size one request is one execution."""

    def compute_ns() -> int:
        return int(client.get_inference_statistics(name).model_stats[0].inference_stats.compute_infer.ns)

    before = compute_ns()
    started = time.perf_counter()
    client.infer(name, request, client_timeout=600)
    latency = time.perf_counter() - started
    return (compute_ns() - before) / 1e6, latency * 1e3


def _measure(client: Any, name: str, model: Any, inputs: dict[str, Any], repeats: int) -> tuple[float, ...]:
    """Medians in ms of (hloserve's compute per execution, torch eager's time, the gRPC request's
    latency), hloserve's request and torch's call taken in turn, so that load from elsewhere on
    the machine weighs on both alike."""
    import torch

    request = tensors(inputs)
    arguments = [torch.from_numpy(a) for a in inputs.values()]
    computes, eagers, latencies = [], [], []
    with torch.no_grad():
        for k in range(WARMUP + repeats):
            compute, latency = served(client, name, request)
            started = time.perf_counter()
            model(*arguments)
            eager = time.perf_counter() - started
            if k >= WARMUP:
                computes.append(compute)
                eagers.append(eager * 1e3)
                latencies.append(latency)
    return statistics.median(computes), statistics.median(eagers), statistics.median(latencies)


def run(
    window_ms: int = 0, quick: bool = False, models: list[str] | None = None, threads: int | None = None
) -> list[Row]:
    """`threads`: both sides run on that many cores (the first of those this process may use):
    the server is confined to them, so XLA:CPU's pool has that many threads, and so is this
    process, with torch set to as many threads. Default: every core, for both."""
    del window_ms  # a fixed number of requests, not a window
    import torch

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
    everywhere, torch_threads = os.sched_getaffinity(0), torch.get_num_threads()
    cores = set(sorted(everywhere)[:threads])
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))  # as many as XLA:CPU's pool, which has one per core
    try:
        return _run(zoo, names, batches, repeats, cores)
    finally:
        os.sched_setaffinity(0, everywhere)
        torch.set_num_threads(torch_threads)


def _run(
    zoo: Any, names: tuple[str, ...], batches: tuple[int, ...], repeats: int, cores: set[int]
) -> list[Row]:
    import torch
    import tritonclient.grpc as grpcclient

    root = zoo._cache_root()
    with tempfile.TemporaryDirectory(dir=root) as scratch:  # the same file system: links work
        repository = _repository(root, names, Path(scratch))
        port = _free_port()
        server = serve(repository, port, root / "executables", cores)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        rows = []
        try:
            for name in names:
                model = zoo._builder(name)()
                for batch in batches:
                    inputs = zoo._requests(name, batch, seed=1)
                    compute, eager, grpc = _measure(client, name, model, inputs, repeats)
                    rows.append(
                        Row(name, batch, round(compute, 2), round(eager, 2), round(compute / eager, 2),
                            round(grpc, 2), torch.get_num_threads(), os.environ.get("XLA_FLAGS", ""))
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
