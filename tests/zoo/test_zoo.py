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
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from support.servers import ROOT, ServerThread, make_config, residency, start_worker
from tritonclient.utils import np_to_triton_dtype

from hloserve.export._torchvision import prepare_torchvision_import
from hloserve.export.verification import compare, default_tolerance
from hloserve.models.bundle import load_bundle

prepare_torchvision_import()
import specs  # noqa: E402  # imports torchvision and timm: after the line above

pytestmark = pytest.mark.timeout(2700)  # the first run exports the whole zoo (21 models, 2 at a time)

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
    specs.SEGMENTER,
    specs.DETECTOR,
    specs.ENCODER,
    # issue 35's families: plain, grouped, depthwise, shuffled and fire convolutions, atrous
    # convolutions, windowed attention, an MLP-Mixer, a normalization-free net
    "resnet18",
    "resnext50_32x4d",
    "mobilenet_v2",
    "shufflenet_v2_x1_0",
    "squeezenet1_1",
    specs.ATROUS,
    "maxvit_t",
    "timm_mixer_s16_224",
    "timm_nf_resnet26",
)
BATCH_SIZES = "1,4"
REQUESTS = {"batch 1": 1, "padded (3 on 4)": 3, "split (6 over 4 and smaller)": 6}
SPECS = Path(specs.__file__).resolve()
_EXPORTER_SOURCES = tuple(
    sorted(
        path
        for package in ("export", "models")
        for path in (ROOT / "src" / "hloserve" / package).glob("*.py")
    )
)
"""What an export depends on: the exporters and the model format they write and verify with."""
_SPEC_FILES = (SPECS, specs.DETECTOR_MODEL_PY)


def _cache_root() -> Path:
    """The exports of this version of the specs and exporter, with these libraries."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in _SPEC_FILES))
    for path in _EXPORTER_SOURCES:
        digest.update(path.read_bytes())
    for package in ("torch", "torchvision", "timm", "transformers", "torchax", "jax", "jaxlib"):
        digest.update(f"{package}=={importlib.metadata.version(package)};".encode())
    base = os.environ.get("HLOSERVE_ZOO_CACHE") or Path.home() / ".cache" / "hloserve" / "zoo"
    return Path(base) / digest.hexdigest()[:16]


def _export_seconds(root: Path, name: str) -> Path:
    """Where `_export` records how many seconds its export of `name` took (`benches anchors`
    reports them)."""
    return root / "seconds" / f"{name}.export"


def _export(name: str, root: Path) -> str | None:
    """`hloserve export` of one zoo model into `root` (unless cached); None, or why it failed."""
    if (root / "repository" / name / "manifest.yaml").exists():
        return None
    staging = root / "staging" / name
    shutil.rmtree(staging, ignore_errors=True)
    command = [sys.executable, "-m", "hloserve.cli", "export", f"{SPECS}:{name}"]
    started = time.perf_counter()
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
    seconds = _export_seconds(root, name)
    seconds.parent.mkdir(parents=True, exist_ok=True)
    seconds.write_text(f"{time.perf_counter() - started:.2f}")
    return None


def _selected(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The zoo models this session's selected tests name (`-k bert_base`), or the whole zoo."""
    named = {
        item.callspec.params["name"]
        for item in request.session.items
        if hasattr(item, "callspec") and "name" in item.callspec.params
    }
    chosen = tuple(name for name in ZOO if name in named)
    whole = any(item.name.startswith("test_zoo_models_took") for item in request.session.items)
    return chosen if chosen and not whole else ZOO


@pytest.fixture(scope="module", name="exported")
def _exported(request: pytest.FixtureRequest) -> dict[str, str | None]:
    """Each selected zoo model exported (two at a time: the machine has two cores), or why not."""
    root = _cache_root()
    names = _selected(request)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(names, pool.map(lambda name: _export(name, root), names), strict=True))
    return results


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_exports_with_default_options(name: str, exported: dict[str, str | None]) -> None:
    assert exported[name] is None, f"hloserve export {SPECS.name}:{name} failed:\n{exported[name]}"


@pytest.fixture(scope="module", name="server")
def _server(exported: dict[str, str | None]) -> Iterator[ServerThread]:
    """One server over the exported zoo, its weight budget a little over half the zoo's weights
    (and at least the largest model's): the models take turns on the device."""
    repository = _cache_root() / "repository"
    sizes = [load_bundle(repository / n).weight_nbytes for n, failed in exported.items() if failed is None]
    budget = max(int(max(sizes) * 1.1), sum(sizes) // 2)
    if len(exported) == len(ZOO):
        assert budget < sum(sizes), "the budget must not hold the whole zoo"
    config = make_config(repository, executable_cache=_cache_root() / "executables")
    config = config.replace("weights", budget_bytes=budget)
    with start_worker(config, timeout=1200) as server:
        yield server


def _requests(name: str, rows: int, seed: int) -> dict[str, np.ndarray]:
    """The inputs of one request to the zoo model `name`, by name."""
    if name == specs.ENCODER:
        ids, mask = specs.tokens(rows, seed=seed)
        return {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    if name == specs.DETECTOR:
        return {"IMAGE": specs.detector_images(rows, seed=seed).numpy()}
    return {"IMAGE": specs.images(rows, seed=seed).numpy()}


def _builder(name: str) -> Callable[[], torch.nn.Module]:
    builders = {
        specs.SEGMENTER: specs.build_segmenter,
        specs.ATROUS: lambda: specs.build_segmenter(specs.ATROUS),
        specs.DETECTOR: specs.build_detector,
        specs.ENCODER: specs.build_encoder,
    }
    return builders.get(name, lambda: specs.build(name))


def _detections() -> Any:
    """The detector's model.py as a module (its register_model call made a no-op)."""
    spec = importlib.util.spec_from_file_location("zoo_ssdlite_model", specs.DETECTOR_MODEL_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with mock.patch("hloserve.register_model"):
        spec.loader.exec_module(module)
    return module


def _expected(name: str, model: torch.nn.Module, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the client should get: torch's output (by name); the detector's through model.py's
    numpy postprocess, run here on torch's boxes and scores."""
    with torch.no_grad():
        result = model(*(torch.from_numpy(a) for a in inputs.values()))
    if not isinstance(result, dict):
        return {"LOGITS": result.numpy()}
    result = {key: value.numpy() for key, value in result.items()}
    if name != specs.DETECTOR:
        return result
    found = [_detections().detect(b, s) for b, s in zip(result["boxes"], result["scores"], strict=True)]
    names = ("detection_boxes", "detection_scores", "detection_labels")
    return {n: np.stack([f[k] for f in found]) for k, n in enumerate(names)}


def _unmatched_detections(served: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> list[str]:
    """The expected detections the server did not return (same label, box and score within the
    f32 tolerance of 320 pixels and of 1), among those scoring clearly above the image's last
    kept score: random weights give near-equal scores, and which of them fill the last places
    of the 100 may turn on a rounding step."""
    rtol = 1e-4
    missing = []
    for image, (boxes, scores, labels) in enumerate(
        zip(*(expected[n] for n in ("detection_boxes", "detection_scores", "detection_labels")), strict=True)
    ):
        cutoff = scores[labels >= 0].min(initial=0.0) + rtol
        got = [served[n][image] for n in ("detection_boxes", "detection_scores", "detection_labels")]
        for box, score, label in zip(boxes, scores, labels, strict=True):
            if label < 0 or score <= cutoff:
                continue
            near = (
                (got[2] == label)
                & (abs(got[1] - score) <= rtol)
                & (abs(got[0] - box).max(axis=1) <= rtol * 320)
            )
            if not near.any():
                missing.append(f"image {image}: label {label} score {score:.6g} box {box.round(3).tolist()}")
    return missing


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_serves_what_torch_computes(name: str, server: ServerThread) -> None:
    model = _builder(name)()
    client = grpcclient.InferenceServerClient(server.url)
    try:
        for seed, (request, rows) in enumerate(REQUESTS.items(), 1):
            inputs = _requests(name, rows, seed)
            tensors = []
            for key, array in inputs.items():
                tensors.append(grpcclient.InferInput(key, list(array.shape), np_to_triton_dtype(array.dtype)))
                tensors[-1].set_data_from_numpy(array)
            expected = _expected(name, model, inputs)
            started = time.perf_counter()
            result = client.infer(name, tensors, client_timeout=600)
            elapsed = time.perf_counter() - started
            served_outputs = {output: result.as_numpy(output) for output in expected}
            if name == specs.DETECTOR:
                assert all(
                    served_outputs[o] is not None and served_outputs[o].shape == w.shape
                    for o, w in expected.items()
                )
                missing = _unmatched_detections(served_outputs, expected)
                assert not missing, f"{name}, {request}: {len(missing)} detections missing: {missing[:5]}"
                print(f"{name} {request}: {elapsed:.2f}s, every detection above the last place served")
                continue
            worst = 0.0
            for output, want in expected.items():
                served = served_outputs[output]
                assert served is not None and served.shape == want.shape, (output, served, want.shape)
                if np.issubdtype(want.dtype, np.floating):
                    assert abs(want).max() > 0, f"{output} all 0: the comparison would prove nothing"
                difference = compare(served, want, default_tolerance(want.dtype))
                assert difference.ok, f"{name}, {request}, {output}: {difference.describe()}"
                worst = max(worst, difference.relative)
            print(f"{name} {request}: {elapsed:.2f}s, relative difference {worst:.2g}")
    finally:
        client.close()


def test_zoo_models_took_turns_under_the_budget(server: ServerThread) -> None:
    """The budget holds about half the zoo: serving every model evicted some."""
    state = residency(server)
    assert sum(evictions for _, _, evictions in state.values()) > 0, state
