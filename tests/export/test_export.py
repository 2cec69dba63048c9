"""The JAX and Flax exporter writes ReactantServer.jl's bundle format, verifies it in a fresh process,
refuses what cannot be a bundle, and the shipped example repository is current.

Serving an exported bundle runs with one process: the exporter is under test, not the server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import tritonclient.grpc as grpcclient
import yaml
from flax import linen, nnx
from safetensors import safe_open
from support.bundles import PARAMS as AFFINE
from support.bundles import affine
from support.servers import EXAMPLES, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.cli import main
from hloserve.export.jax import (
    InputSpec,
    OutputSpec,
    ScratchError,
    VerificationError,
    export_bundle,
    verify_bundle,
)
from hloserve.models import _xla
from hloserve.models._scratch import module_memory
from hloserve.models.bundle import load_bundle, read_weights
from hloserve.models.executable_cache import ExecutableCache

sys.path.insert(0, str(EXAMPLES.parent))
import export_examples
from support.numerics import assert_close

jax, jnp = _xla.jax, _xla.jnp
LOCAL_PLATFORM = "cpu" if _xla.device().platform == "cpu" else "cuda"


def nested(params: dict, x: np.ndarray, t: np.ndarray) -> tuple:  # type: ignore[type-arg]
    h = x @ params["layers"][0]["w"] + params["layers"][1]["b"]
    return h * params["scale"], (t * 2).sum(axis=1)


PARAMS = {
    "layers": [{"w": np.ones((3, 2), np.float32)}, {"b": np.array([0.5, -0.5], np.float32)}],
    "scale": np.float32(3.0),
}


def test_export_writes_modules_weights_and_a_column_major_manifest(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        directory = export_bundle(
            nested,
            PARAMS,
            [InputSpec("X", (3,), np.float32, letters="f"), InputSpec("T", (2, 5), np.int64)],
            tmp_path / "nested",
            batch_sizes=(4, 1),
            outputs=[OutputSpec("Y", letters="k"), OutputSpec("S", letters="a")],
        )
    assert [(e["event"], e.get("batch_size"), e.get("step")) for e in logs] == [
        ("exported batch size", 1, "1/2"),
        ("exported batch size", 4, "2/2"),
        ("XLA options not tried", 4, None),  # a module this quick is not tuned
        ("bundle verified in a fresh process", None, None),
    ]
    assert sorted(p.name for p in directory.iterdir()) == [
        "manifest.yaml",
        "model.b1.mlir",
        "model.b4.mlir",
        "weights.safetensors",
    ]
    manifest = yaml.safe_load((directory / "manifest.yaml").read_text())
    assert manifest["executable_inputs"][1] == {
        "name": "T",
        "dtype": "i64",
        "shape": "can",
        "dims": {"a": 2, "c": 5},
    }
    assert manifest["executable_outputs"] == [
        {"name": "Y", "dtype": "f32", "shape": "kn", "dims": {"k": 2}},
        {"name": "S", "dtype": "i64", "shape": "an", "dims": {"a": 5}},
    ]
    assert manifest["batching"] == {"compiled_batch_sizes": [1, 4]}
    assert oct((directory / "weights.safetensors").stat().st_mode & 0o777) == "0o644"
    header = (directory / "model.b4.mlir").read_text().split("func.func public @main(")[1].split(")")[0]
    assert header.count("%arg") == 5 and "tensor<4x3xf32>" in header.split(",")[0]  # inputs first
    assert "aliasing_output" not in header and "buffer_donor" not in header

    with safe_open(directory / "weights.safetensors", "numpy") as f:
        order = json.loads(f.metadata()["argument_order"])
    assert order == ["layers.0.w", "layers.1.b", "scale"]  # jax's flattening order of PARAMS
    assert manifest["name"] == "nested" and manifest["format_version"] == "2.0"
    provenance = manifest["provenance"]
    assert provenance.pop("exported_at").endswith("+00:00")
    assert provenance.pop("xla_tuning")["batch_size"] == 4  # what it holds: tests/export/test_tuning.py
    assert provenance == {
        "exporter": "hloserve 0.1.0",
        "jax_version": jax.__version__,
        "platform": "cpu",
        "module_format": "text",
        "source_framework": "jax",
        "batch_sizes": [1, 4],
    }
    bundle = load_bundle(directory)
    assert [w.name for w in bundle.weights] == order
    weights = [_xla.put(w) for w in read_weights(bundle)]
    x = np.random.default_rng(0).random((4, 3), dtype=np.float32)
    t = np.arange(40, dtype=np.int64).reshape(4, 2, 5)
    executable = _xla.compile_module(bundle.module_for(4).source)
    y, s = _xla.to_numpy(_xla.run(executable, [_xla.put(x), _xla.put(t), *weights]))
    want_y, want_s = nested(PARAMS, x, t)
    assert_close(y, want_y)
    np.testing.assert_array_equal(s, want_s)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"batch_sizes": (0, 2)}, "distinct positive integers"),
        ({"batch_sizes": (2, 2)}, "distinct positive integers"),
        ({"outputs": [OutputSpec("A")]}, "1 output names for 2 outputs"),
        ({"name": "other"}, "must equal its directory's name"),
        ({"platform": "tpu"}, "platform must be 'cpu' or 'cuda', got 'tpu'"),
        ({"module_format": "mlirbc"}, "module_format must be 'text' or 'bytecode', got 'mlirbc'"),
        ({"client_outputs": [InputSpec("G", (1,), np.int64)]}, "need a model_py that produces them"),
        ({"model_py": Path("/nonexistent/model.py")}, "model_py '/nonexistent/model.py' is not a file"),
        ({"sample_inputs": [np.ones((1, 3))]}, "1 sample inputs for 2 inputs"),
        (
            {"sample_inputs": [np.ones((1, 3)), np.ones((1, 5, 2))]},
            r"'T' has shape \(1, 5, 2\), expected \[rows, \*\[2, 5\]\]",
        ),
    ],
)
def test_export_refuses_bad_arguments(tmp_path: Path, kwargs: dict, says: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=says):
        export_bundle(
            nested,
            PARAMS,
            [InputSpec("X", (3,)), InputSpec("T", (2, 5), np.int64)],
            tmp_path / "bad",
            **kwargs,
        )


def test_export_refuses_an_output_without_a_batch_axis(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a leading batch axis"):
        export_bundle(lambda p, x: x.sum(), {}, [InputSpec("X", (3,))], tmp_path / "scalar", batch_sizes=(2,))


def test_export_refuses_a_branch_on_input_values(tmp_path: Path) -> None:
    def sign_dependent(params: Any, x: Any) -> Any:
        return x if x.sum() > 0 else -x

    with pytest.raises(
        ValueError, match=r"^the model branches on \(or converts to Python\) the values of its inputs"
    ):
        export_bundle(sign_dependent, {}, [InputSpec("X", (3,))], tmp_path / "branchy")
    assert not (tmp_path / "branchy" / "manifest.yaml").exists()


def test_export_refuses_a_module_taking_more_than_inputs_and_weights(tmp_path: Path) -> None:
    """An ordered effect threads a token through main: an argument the server cannot bind."""

    def printing(params: Any, x: Any) -> Any:
        jax.debug.print("x={x}", x=x, ordered=True)
        return x * params["w"]

    with pytest.raises(
        ValueError,
        match=r"^the module's main takes 3 arguments \(!stablehlo.token, .*1 inputs \+ 1 weights = 2",
    ):
        export_bundle(printing, {"w": np.ones(3, np.float32)}, [InputSpec("X", (3,))], tmp_path / "printing")


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x: Any) -> Any:
        return linen.Dense(3)(linen.relu(linen.Dense(16)(x)))


def test_flax_models_exported_and_served_match_flax(tmp_path: Path) -> None:
    """An nnx module (eval mode: running statistics, no dropout) as text and a linen model as
    bytecode, each at batch sizes 1 and 4, answer tritonclient as Flax does."""
    nnx_model = NnxMLP(nnx.Rngs(0))
    nnx_model.norm.mean[...] = jnp.linspace(-1, 1, 16, dtype=np.float32)
    nnx_model.norm.var[...] = jnp.linspace(0.5, 2, 16, dtype=np.float32)
    export_bundle(
        nnx_model,
        None,
        [InputSpec("X", (6,))],
        tmp_path / "nnx_mlp",
        batch_sizes=(1, 4),
        outputs=[OutputSpec("Y")],
    )
    assert nnx_model.drop.deterministic is False, "the caller's model keeps its training mode"
    linen_model = LinenMLP()
    variables = linen_model.init(jax.random.key(0), jnp.ones((1, 6), np.float32))
    export_bundle(
        linen_model.apply,
        variables,
        [InputSpec("X", (6,))],
        tmp_path / "linen_mlp",
        batch_sizes=(1, 4),
        outputs=[OutputSpec("Y")],
        module_format="bytecode",
    )
    nnx_bundle, linen_bundle = load_bundle(tmp_path / "nnx_mlp"), load_bundle(tmp_path / "linen_mlp")
    assert [w.name for w in nnx_bundle.weights] == [
        "hidden.bias", "hidden.kernel", "norm.bias", "norm.mean", "norm.scale", "norm.var",
        "out.bias", "out.kernel",
    ]  # fmt: skip
    assert [w.name for w in linen_bundle.weights][:2] == ["params.Dense_0.bias", "params.Dense_0.kernel"]
    assert all(m.source.startswith(b"ML\xefR") for m in linen_bundle.modules)  # type: ignore[union-attr]

    nnx_model.eval()
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for rows in (1, 4, 3):
            x = np.random.default_rng(rows).standard_normal((rows, 6)).astype(np.float32)
            tensor = grpcclient.InferInput("X", [rows, 6], "FP32")
            tensor.set_data_from_numpy(x)
            served = client.infer("nnx_mlp", [tensor]).as_numpy("Y")
            assert_close(served, np.asarray(nnx_model(jnp.asarray(x))))
            served = client.infer("linen_mlp", [tensor]).as_numpy("Y")
            assert_close(served, np.asarray(linen_model.apply(variables, x)))
        client.close()


def test_verification_catches_a_bundle_that_differs_from_its_model(tmp_path: Path) -> None:
    """A weight altered after export is found by running the bundle, not by reading its header."""
    directory = export_bundle(
        affine,
        AFFINE,
        [InputSpec("INPUT", (4,))],
        tmp_path / "affine",
        batch_sizes=(1, 2),
        outputs=[OutputSpec("OUTPUT")],
    )
    bias = next(w for w in load_bundle(directory).weights if w.name == "b")
    with (directory / "weights.safetensors").open("r+b") as f:
        f.seek(bias.offset)
        f.write((AFFINE["b"] + 1).tobytes())
    inputs = {size: [np.arange(4 * size, dtype=np.float32).reshape(size, 4)] for size in (1, 2)}
    expected = {size: [affine(AFFINE, x)] for size, (x,) in inputs.items()}
    with pytest.raises(
        VerificationError,
        match=r"^bundle 'affine', output 'OUTPUT', batch size 1 \(f32\): differs from the model by up to 1 "
        r"\(0.156 of its largest magnitude 6.4\); at index \[0, 0\] the bundle gives 6.2, the model 5.2; "
        r"the tolerance is rtol=0.0001 \(of each element\) plus atol=1e-05 \(of 6.4\); "
        r"it would pass with atol=0.16 or rtol=0.2$",
    ):
        verify_bundle(directory, inputs, expected)


def test_the_fresh_process_loads_the_executables_the_exporter_compiled(tmp_path: Path) -> None:
    """Export compiles each module once: verification's fresh process loads the scratch check's
    executables from the cache it is given. Planted under the affine modules' keys, executables
    of another module give themselves away by their answers; without the cache it compiles."""
    directory = export_bundle(
        affine, AFFINE, [InputSpec("INPUT", (4,))], tmp_path / "affine", batch_sizes=[1, 2]
    )
    other = export_bundle(
        lambda p, x: x @ p["w"] - p["b"], AFFINE, [InputSpec("INPUT", (4,))], tmp_path / "other",
        batch_sizes=[1, 2], verify=False,
    )  # fmt: skip
    cache = ExecutableCache(tmp_path / "cache")
    cache.directory.mkdir()
    for mine, theirs in zip(load_bundle(directory).modules, load_bundle(other).modules, strict=True):
        planted = _xla.serialize_executable(_xla.compile_module(theirs.source))
        (cache.directory / f"{cache.key(mine.source)}.xla").write_bytes(planted)
    inputs = {size: [np.arange(4 * size, dtype=np.float32).reshape(size, 4)] for size in (1, 2)}
    expected = {size: [affine(AFFINE, x)] for size, (x,) in inputs.items()}
    verify_bundle(directory, inputs, expected)
    with pytest.raises(VerificationError, match="differs from the model"):
        verify_bundle(directory, inputs, expected, executables=cache.directory)


def test_verification_is_skipped_with_a_warning_for_another_platform(tmp_path: Path) -> None:
    other = "cuda" if LOCAL_PLATFORM == "cpu" else "cpu"
    with structlog.testing.capture_logs() as logs:
        directory = export_bundle(
            affine, AFFINE, [InputSpec("INPUT", (4,))], tmp_path / "elsewhere", platform=other
        )
    assert logs[-1] == {
        "event": "bundle not verified: it is lowered for another platform than this machine's",
        "log_level": "warning",
        "bundle": "elsewhere",
        "platform": other,
        "local_platform": LOCAL_PLATFORM,
    }
    assert yaml.safe_load((directory / "manifest.yaml").read_text())["provenance"]["platform"] == other


def test_export_writes_client_tensors_and_model_py_and_drops_old_modules(tmp_path: Path) -> None:
    directory = tmp_path / "graded"
    export_bundle(affine, AFFINE, [InputSpec("INPUT", (4,))], directory, batch_sizes=(1, 8), verify=False)
    model_py = tmp_path / "grader.py"
    model_py.write_text("# turns OUTPUT into grades\n")
    export_bundle(
        affine,
        AFFINE,
        [InputSpec("INPUT", (4,))],
        directory,
        batch_sizes=(1, 2),
        client_inputs=[InputSpec("IMAGE", (-1,), np.uint8, letters="p")],
        client_outputs=[InputSpec("grade", (1,), np.int64, letters="y")],
        model_py=model_py,
        verify=False,
    )
    assert sorted(p.name for p in directory.iterdir()) == [
        "manifest.yaml", "model.b1.mlir", "model.b2.mlir", "model.py", "weights.safetensors",
    ]  # fmt: skip
    assert (directory / "model.py").read_text() == "# turns OUTPUT into grades\n"
    manifest = yaml.safe_load((directory / "manifest.yaml").read_text())
    assert manifest["client_inputs"] == [{"name": "IMAGE", "dtype": "u8", "shape": "pn", "dims": {"p": -1}}]
    assert manifest["client_outputs"] == [{"name": "grade", "dtype": "i64", "shape": "yn", "dims": {"y": 1}}]
    loaded = load_bundle(directory).manifest  # the server accepts them beside a model.py
    assert [t.name for t in loaded.inputs] == ["IMAGE"] and [t.name for t in loaded.outputs] == ["grade"]
    model_py.unlink()  # exported again beside the model.py it ships
    export_bundle(
        affine, AFFINE, [InputSpec("INPUT", (4,))], directory, model_py=directory / "model.py", verify=False
    )
    assert (directory / "model.py").read_text() == "# turns OUTPUT into grades\n"


SPEC = """\
import numpy as np
from hloserve.export.jax import InputSpec, OutputSpec

def make():
    params = {"w": np.arange(12, dtype=np.float32).reshape(4, 3)}
    return {"fn": lambda p, x: x @ p["w"], "params": params, "inputs": [InputSpec("X", (4,))],
            "outputs": [OutputSpec("Y")], "batch_sizes": [8]}

def listed():
    return [1, 2]

def broken():
    return 1 / 0

def misspelled():
    return {"fn": lambda p, x: x, "params": {}, "input": []}

def whole():
    params = {"w": np.arange(12, dtype=np.float32).reshape(4, 3)}
    return {"fn": lambda p, x: (x @ p["w"]).sum(axis=0), "params": params,
            "inputs": [InputSpec("X", (5, 4))], "outputs": [OutputSpec("Y")]}
"""


def test_cli_export_writes_a_verified_loadable_bundle(tmp_path: Path) -> None:
    (tmp_path / "spec.py").write_text(SPEC)
    out = tmp_path / "repository" / "matmul"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hloserve.cli",
            "export",
            f"{tmp_path / 'spec.py'}:make",
            "--out",
            str(out),
            "--batch-sizes",
            "1,2",
            "--bytecode",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "bundle verified in a fresh process" in done.stderr
    bundle = load_bundle(out)
    assert bundle.manifest.compiled_batch_sizes == (1, 2)  # the flag overrides the spec's [8]
    assert all(isinstance(m.source, bytes) for m in bundle.modules)
    x = np.ones((2, 4), np.float32)
    executable = _xla.compile_module(bundle.module_for(2).source)
    (y,) = _xla.to_numpy(_xla.run(executable, [_xla.put(x), *map(_xla.put, read_weights(bundle))]))
    np.testing.assert_array_equal(y, x @ np.arange(12, dtype=np.float32).reshape(4, 3))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("spec.py", "expected FILE.py:FUNCTION or package.module:FUNCTION, got '.*spec.py'"),
        ("absent.py:make", "no file 'absent.py'"),
        ("spec.py:nothing", "'.*spec.py' has no function 'nothing'"),
        ("spec.py:listed", "spec.py:listed returned list, expected a dict of exporter arguments"),
        ("spec.py:broken", "spec.py:broken failed: ZeroDivisionError: division by zero"),
        ("spec.py:misspelled", "returned arguments export_bundle cannot take: .*'input'"),
    ],
)
def test_cli_export_refuses_a_bad_spec_with_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spec: str, says: str
) -> None:
    (tmp_path / "spec.py").write_text(SPEC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the spec's folder is put on it
    spec = spec if spec.startswith("absent") else f"{tmp_path / spec}"
    assert main(["export", spec, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("hloserve export: ")
    assert not (tmp_path / "out").exists()


def test_shipped_example_repository_is_what_the_script_exports(tmp_path: Path) -> None:
    """Byte for byte, except the provenance, which records when and with what it was exported."""
    export_examples.export_all(tmp_path)
    assert sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()) == sorted(export_examples.MODELS)
    for model in export_examples.MODELS:
        fresh, shipped = tmp_path / model, EXAMPLES / model
        assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in shipped.iterdir())
        for path in fresh.iterdir():
            if path.name == "manifest.yaml":
                fresh_manifest, shipped_manifest = (
                    yaml.safe_load(p.read_text()) for p in (path, shipped / path.name)
                )
                del fresh_manifest["provenance"], shipped_manifest["provenance"]
                assert fresh_manifest == shipped_manifest, (
                    f"run examples/export_examples.py: {model}/manifest.yaml"
                )
                continue
            assert path.read_bytes() == (shipped / path.name).read_bytes(), (
                f"run examples/export_examples.py: {model}/{path.name}"
            )


def test_export_writes_an_image_input_s_format(tmp_path: Path) -> None:
    directory = export_bundle(
        lambda p, x: x.mean(axis=(1, 2)),
        {},
        [InputSpec("IMAGE", (4, 4, 3), np.float32, letters="hwc", format="NHWC")],
        tmp_path / "image",
        verify=False,
    )
    manifest = yaml.safe_load((directory / "manifest.yaml").read_text())
    assert manifest["executable_inputs"][0]["format"] == "NHWC"
    assert "format" not in manifest["executable_outputs"][0]


def column_sums(params: dict, x: np.ndarray) -> Any:  # type: ignore[type-arg]
    """A function of a whole [5, 4] input with no row to batch: x @ w summed over its rows, plus b."""
    return (x @ params["w"]).sum(axis=0) + params["b"]


def test_a_bundle_without_a_batch_axis_serves_as_triton_s_max_batch_size_0(tmp_path: Path) -> None:
    """Exported with batch_axis=False (verified in a fresh process), it has one model.mlir and
    no n axis; served, ModelConfig says max_batch_size 0 with whole dims, ModelMetadata has no
    -1, each request is one execution, and a batched shape is INVALID_ARGUMENT."""
    export_bundle(
        column_sums,
        AFFINE,
        [InputSpec("X", (5, 4), letters="rf")],
        tmp_path / "sums",
        batch_axis=False,
        outputs=[OutputSpec("Y", letters="k")],
    )
    bundle = load_bundle(tmp_path / "sums")
    assert [m.path.name for m in bundle.modules] == ["model.mlir"]
    manifest = yaml.safe_load((tmp_path / "sums" / "manifest.yaml").read_text())
    assert [t["shape"] for t in manifest["executable_inputs"] + manifest["executable_outputs"]] == ["fr", "k"]
    assert "batching" not in manifest
    with pytest.raises(ValueError, match="batch_sizes need a batch axis"):
        export_bundle(
            column_sums, AFFINE, [InputSpec("X", (5, 4))], tmp_path / "x", batch_axis=False, batch_sizes=[2]
        )
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        config = client.get_model_config("sums").config
        assert config.max_batch_size == 0
        assert [list(t.dims) for t in (*config.input, *config.output)] == [[5, 4], [3]]
        assert not config.HasField("dynamic_batching")
        metadata = client.get_model_metadata("sums")
        assert [list(t.shape) for t in (*metadata.inputs, *metadata.outputs)] == [[5, 4], [3]]
        for k in range(3):
            x = np.random.default_rng(k).standard_normal((5, 4)).astype(np.float32)
            tensor = grpcclient.InferInput("X", [5, 4], "FP32")
            tensor.set_data_from_numpy(x)
            served = client.infer("sums", [tensor]).as_numpy("Y")
            assert_close(served, column_sums(AFFINE, x))
        stats = client.get_inference_statistics("sums").model_stats[0]
        assert (stats.inference_count, stats.execution_count) == (3, 3)
        batched = grpcclient.InferInput("X", [1, 5, 4], "FP32")
        batched.set_data_from_numpy(np.zeros((1, 5, 4), np.float32))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("sums", [batched])
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        served = client.infer("sums", [tensor]).as_numpy("Y")  # the next good request
        assert_close(served, column_sums(AFFINE, x))
        client.close()


def test_cli_export_no_batch_axis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "spec.py").write_text(SPEC)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the spec's folder is put on it
    out = tmp_path / "whole"
    assert main(["export", f"{tmp_path / 'spec.py'}:whole", "--out", str(out), "--no-batch-axis"]) == 0
    bundle = load_bundle(out)
    assert not bundle.manifest.batched
    assert [m.batch_size for m in bundle.modules] == [0]
    assert main(["export", f"{tmp_path / 'spec.py'}:make", "--out", str(out), "--no-batch-axis"]) == 1


def per_token(params: dict, x: Any) -> Any:  # type: ignore[type-arg]
    """A weight broadcast to one copy per token before a batched matmul: 13x the module's bytes."""
    return jnp.einsum("bti,tio->bto", x, jnp.broadcast_to(params["w"], (64, 32, 32)))


def test_export_refuses_a_module_whose_scratch_dwarfs_its_weights_and_inputs(tmp_path: Path) -> None:
    params = {"w": np.eye(32, dtype=np.float32)}
    inputs = [InputSpec("X", (64, 32))]
    with pytest.raises(
        ScratchError,
        match=r"^bundle 'wide', batch size 1: XLA plans 270 kB of scratch, 13.2x the module's weights, "
        r"inputs and outputs \(20.5 kB\); the limit is 4x\. .* accept it with --max-scratch-ratio N or "
        r"--allow-large-scratch \(max_scratch_ratio=None\)$",
    ):
        export_bundle(per_token, params, inputs, tmp_path / "wide", max_scratch_ratio=4)
    assert not (tmp_path / "wide").exists()
    directory = export_bundle(per_token, params, inputs, tmp_path / "wide", max_scratch_ratio=None)
    assert round(module_memory(load_bundle(directory).module_for(1).source).ratio, 1) == 13.2


def test_cli_export_takes_the_scratch_limit_and_its_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "spec.py").write_text(
        "import jax.numpy as jnp\nimport numpy as np\nfrom hloserve.export.jax import InputSpec\n\n"
        "def per_token(params, x):\n"
        "    return jnp.einsum('bti,tio->bto', x, jnp.broadcast_to(params['w'], (64, 32, 32)))\n\n"
        "def make():\n"
        "    return {'fn': per_token, 'params': {'w': np.eye(32, dtype=np.float32)},\n"
        "            'inputs': [InputSpec('X', (64, 32))]}\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))  # the spec's folder is put on it
    spec, out = f"{tmp_path / 'spec.py'}:make", str(tmp_path / "wide")
    assert main(["export", spec, "--out", out, "--max-scratch-ratio", "4"]) == 1
    assert "XLA plans 270 kB of scratch" in capsys.readouterr().err
    assert main(["export", spec, "--out", out, "--allow-large-scratch"]) == 0
