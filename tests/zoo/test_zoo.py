"""The zoo: real architectures from torchvision and timm (random weights, no downloads) exported
with `hloserve export` as a user runs it, served by one real server under a weight budget
smaller than the set, queried with tritonclient at batch 1, a padded size and a split size, and
compared with torch's own output under the exporter's scaled tolerances.

Not part of the everyday suite: `tox -e zoo` (or `pytest tests/zoo`). Exports and compiled
executables are cached under `$HLOSERVE_ZOO_CACHE` (default `~/.cache/hloserve/zoo`), keyed by
the specs, the exporter's sources and the library versions, so a second run only serves.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import tritonclient.grpc as grpcclient
from support.servers import ROOT, ServerThread, make_config, residency, start_worker

from hloserve._torchvision import prepare_torchvision_import
from hloserve.bundle import load_bundle
from hloserve.verification import compare, default_tolerance

prepare_torchvision_import()
import specs  # noqa: E402  # imports torchvision and timm: after the line above

pytestmark = pytest.mark.timeout(1800)  # the first run exports the whole zoo

ZOO = (
    "resnet50",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
    "vit_b_16",
    "swin_t",
    "densenet121",
    "regnet_y_400mf",
    "timm_deit_tiny_patch16_224",
)
BATCH_SIZES = "1,4"
REQUESTS = {"batch 1": 1, "padded (3 on 4)": 3, "split (6 over 4 and smaller)": 6}
SPECS = Path(specs.__file__).resolve()
_EXPORTER_SOURCES = (
    "export.py",
    "export_torch.py",
    "_torch_lowering.py",
    "_torchvision.py",
    "_scratch.py",
    "verification.py",
    "_xla.py",
    "bundle.py",
)


def _cache_root() -> Path:
    """The exports of this version of the specs and exporter, with these libraries."""
    digest = hashlib.sha256(SPECS.read_bytes())
    for name in _EXPORTER_SOURCES:
        digest.update((ROOT / "src" / "hloserve" / name).read_bytes())
    for package in ("torch", "torchvision", "timm", "torchax", "jax", "jaxlib"):
        digest.update(f"{package}=={importlib.metadata.version(package)};".encode())
    base = os.environ.get("HLOSERVE_ZOO_CACHE") or Path.home() / ".cache" / "hloserve" / "zoo"
    return Path(base) / digest.hexdigest()[:16]


def _export(name: str, root: Path) -> str | None:
    """`hloserve export` of one zoo model into `root` (unless cached); None, or why it failed."""
    if (root / "repository" / name / "manifest.yaml").exists():
        return None
    staging = root / "staging" / name
    shutil.rmtree(staging, ignore_errors=True)
    command = [sys.executable, "-m", "hloserve.cli", "export", f"{SPECS}:{name}"]
    done = subprocess.run(
        [*command, "--out", str(staging), "--batch-sizes", BATCH_SIZES],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        return "\n".join(done.stderr.strip().splitlines()[-5:])
    (root / "repository").mkdir(parents=True, exist_ok=True)
    staging.rename(root / "repository" / name)  # whole, or not at all
    return None


@pytest.fixture(scope="module", name="exported")
def _exported() -> dict[str, str | None]:
    """Each zoo model exported (two at a time: the machine has two cores), or why not."""
    root = _cache_root()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(ZOO, pool.map(lambda name: _export(name, root), ZOO), strict=True))
    return results


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_exports_with_default_options(name: str, exported: dict[str, str | None]) -> None:
    assert exported[name] is None, f"hloserve export {SPECS.name}:{name} failed:\n{exported[name]}"


@pytest.fixture(scope="module", name="server")
def _server(exported: dict[str, str | None]) -> Iterator[ServerThread]:
    """One server over the exported zoo, its weight budget a little over half the zoo's weights
    (and at least the largest model's): the models take turns on the device."""
    repository = _cache_root() / "repository"
    sizes = [load_bundle(repository / n).weight_nbytes for n in ZOO if exported[n] is None]
    budget = max(int(max(sizes) * 1.1), sum(sizes) // 2)
    assert budget < sum(sizes), "the budget must not hold the whole zoo"
    config = make_config(repository, executable_cache=_cache_root() / "executables")
    config = config.replace("weights", budget_bytes=budget)
    with start_worker(config, timeout=900) as server:
        yield server


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_serves_what_torch_computes(name: str, server: ServerThread) -> None:
    model = specs.build(name)
    client = grpcclient.InferenceServerClient(server.url)
    try:
        for seed, (request, rows) in enumerate(REQUESTS.items(), 1):
            image = specs.images(rows, seed=seed)
            tensor = grpcclient.InferInput("IMAGE", list(image.shape), "FP32")
            tensor.set_data_from_numpy(image.numpy())
            started = time.perf_counter()
            served = client.infer(name, [tensor], client_timeout=600).as_numpy("LOGITS")
            elapsed = time.perf_counter() - started
            with torch.no_grad():
                expected = model(image).numpy()
            assert served is not None and served.shape == expected.shape
            assert abs(expected).max() > 0, "logits all 0: the comparison would prove nothing"
            difference = compare(served, expected, default_tolerance(expected.dtype))
            assert difference.ok, f"{name}, {request}: {difference.describe()}"
            print(f"{name} {request}: {elapsed:.2f}s, relative difference {difference.relative:.2g}")
    finally:
        client.close()


def test_zoo_models_took_turns_under_the_budget(server: ServerThread) -> None:
    """The budget holds about half the zoo: serving every model evicted some."""
    state = residency(server)
    assert sum(evictions for _, _, evictions in state.values()) > 0, state
