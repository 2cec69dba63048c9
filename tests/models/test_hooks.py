"""model.py hooks on a live server: pre- and post-processing, client specs, failing hooks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from export_examples import reference
from support.bundles import PARAMS, affine, edit_manifest, write_affine, write_total
from support.clients import infer
from support.numerics import assert_close, assert_grades
from support.servers import EXAMPLES, make_config, start_worker
from tritonclient.utils import InferenceServerException

HOOK_SLEEP_S = 1.0  # long beside a loaded machine's stalls, so the overlap it shows is unmistakable

HOOKED_PY = f"""
import time
import numpy as np
from hloserve import NamedTensor, register_model

def preprocess(inputs):
    values = inputs[0].data
    if not np.isfinite(values).all():
        raise ValueError("values must be finite")
    if values.shape[1] == 7:
        time.sleep({HOOK_SLEEP_S})  # a slow hook, to show hooks overlap and never block the server
    grid = np.linspace(0, 1, values.shape[1])
    rows = [np.interp(np.linspace(0, 1, 4), grid, row) for row in values]
    return [NamedTensor("INPUT", np.asarray(rows, dtype=np.float32))]

def postprocess(outputs):
    scores = outputs[0].data
    label = scores.argmax(axis=1)[:, None]
    if (np.abs(scores) > 1e6).any():
        label = label.astype(np.float64)  # a buggy hook: the wrong dtype
    above = scores[:, scores.max(axis=0) > 3.0]
    return [NamedTensor("label", label), NamedTensor("above", above)]

register_model("hooked", preprocess=preprocess, postprocess=postprocess)
"""


DOUBLED_PY = """
import numpy as np
from hloserve import NamedTensor, register_model

register_model("doubled", preprocess=lambda inputs: [NamedTensor("X", np.concatenate([inputs[0].data] * 2))])
"""


def _client_specs(manifest: dict[str, Any]) -> None:
    manifest["client_inputs"] = [{"name": "values", "dtype": "f64", "shape": "vn", "dims": {"v": -1}}]
    manifest["client_outputs"] = [
        {"name": "label", "dtype": "i64", "shape": "yn", "dims": {"y": 1}},
        {"name": "above", "dtype": "f32", "shape": "kn", "dims": {"k": -1}},
    ]


def write_hooked(directory: Path, source: str = HOOKED_PY) -> Path:
    write_affine(directory, batch_sizes=(1, 2, 4))
    edit_manifest(directory, _client_specs)
    (directory / "model.py").write_text(source)
    return directory


def expected(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    grid = np.linspace(0, 1, values.shape[1])
    x = np.asarray([np.interp(np.linspace(0, 1, 4), grid, row) for row in values], np.float32)
    scores = affine(PARAMS, x)
    return scores.argmax(axis=1)[:, None].astype(np.int64), scores[:, scores.max(axis=0) > 3.0]


@pytest.fixture(scope="module", name="hooked", params=[0, 2], ids=["frontends0", "frontends2"])
def _hooked(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    repository = tmp_path_factory.mktemp("hooks")
    write_hooked(repository / "hooked")
    write_affine(repository / "plain")
    broken = write_affine(repository / "broken")
    edit_manifest(broken, lambda m: m.update(client_outputs=m["executable_outputs"]))
    (broken / "model.py").write_text("raise RuntimeError('cannot find the label map')\n")
    doubled = write_total(repository / "doubled")
    (doubled / "model.py").write_text(DOUBLED_PY)
    misnamed = write_affine(repository / "misnamed")
    (misnamed / "model.py").write_text("from hloserve import register_model\nregister_model('other')\n")
    with start_worker(make_config(repository), frontends=request.param) as server:
        client = grpcclient.InferenceServerClient(server.url)
        yield client
        client.close()


@pytest.mark.parametrize("shape", [(1, 3), (2, 9), (3, 5), (4, 4)])
def test_hooks_transform_client_tensors_of_any_length(hooked: Any, shape: tuple[int, int]) -> None:
    values = np.random.RandomState(sum(shape)).uniform(-3, 6, shape)
    result = infer(hooked, "hooked", {"values": values})
    label, above = expected(values)
    np.testing.assert_array_equal(result.as_numpy("label"), label)
    assert_close(result.as_numpy("above"), above)
    assert result.as_numpy("label").dtype == np.int64


def test_a_requested_subset_of_client_outputs(hooked: Any) -> None:
    values = np.linspace(0, 5, 6).reshape(1, 6)
    result = infer(hooked, "hooked", {"values": values}, outputs=("above",))
    assert [o.name for o in result.get_response().outputs] == ["above"]
    assert_close(result.as_numpy("above"), expected(values)[1])


def test_metadata_shows_the_client_facing_tensors(hooked: Any) -> None:
    metadata = hooked.get_model_metadata("hooked")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("values", "FP64", [-1, -1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("label", "INT64", [-1, 1]),
        ("above", "FP32", [-1, -1]),
    ]


def test_client_specs_are_enforced_before_the_hook(hooked: Any) -> None:
    tensor = grpcclient.InferInput("values", [1, 3], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as raised:
        hooked.infer("hooked", [tensor])
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "'values'" in raised.value.message() and "'FP64'" in raised.value.message()
    values = np.ones((1, 3))
    np.testing.assert_array_equal(
        infer(hooked, "hooked", {"values": values}).as_numpy("label"), expected(values)[0]
    )


def test_a_preprocess_making_more_rows_than_the_model_runs_is_refused(hooked: Any) -> None:
    def send(rows: int) -> Any:
        tensor = grpcclient.InferInput("X", [rows, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((rows, 4), np.float32))
        return hooked.infer("doubled", [tensor])

    with pytest.raises(InferenceServerException) as raised:
        send(2)  # doubled to 4 rows; the model's outputs have no batch axis, so 2 is its most
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "preprocess made 4 rows; the largest compiled batch size is 2" in raised.value.message()
    np.testing.assert_array_equal(send(1).as_numpy("TOTAL"), np.full(4, 2.0, np.float32))


def test_a_raising_hook_is_internal_with_its_message_and_the_model_keeps_serving(hooked: Any) -> None:
    with pytest.raises(InferenceServerException) as raised:
        infer(hooked, "hooked", {"values": np.array([[1.0, np.nan, 2.0]])})
    assert raised.value.status() == "StatusCode.INTERNAL"
    assert "model 'hooked': preprocess failed: ValueError: values must be finite" in raised.value.message()
    values = np.ones((1, 3))
    np.testing.assert_array_equal(
        infer(hooked, "hooked", {"values": values}).as_numpy("label"), expected(values)[0]
    )


def test_a_hook_returning_the_wrong_dtype_is_internal_and_names_the_tensor(hooked: Any) -> None:
    with pytest.raises(InferenceServerException) as raised:
        infer(hooked, "hooked", {"values": np.full((1, 3), 1e9)})
    assert raised.value.status() == "StatusCode.INTERNAL"
    message = raised.value.message()
    assert "postprocess" in message and "'label' is float64, expected int64" in message
    assert infer(hooked, "hooked", {"values": np.ones((2, 3))}).as_numpy("label").shape == (2, 1)


@pytest.mark.serial
def test_hooks_run_in_threads_beside_each_other_and_the_loop(hooked: Any, tmp_path: Path) -> None:
    slow = np.ones((1, 7))  # the hook sleeps HOOK_SLEEP_S for rows of 7 values
    plain = grpcclient.InferInput("INPUT", [1, 4], "FP32")
    plain.set_data_from_numpy(np.ones((1, 4), np.float32))
    with ThreadPoolExecutor(4) as pool:
        started = time.perf_counter()
        slow_calls = [pool.submit(infer, hooked, "hooked", {"values": slow}) for _ in range(3)]
        time.sleep(0.05)
        answered = hooked.infer("plain", [plain])  # served while three hooks sleep
        plain_s = time.perf_counter() - started
        for call in slow_calls:
            np.testing.assert_array_equal(call.result().as_numpy("label"), expected(slow)[0])
        all_s = time.perf_counter() - started
    assert_close(answered.as_numpy("OUTPUT"), affine(PARAMS, np.ones((1, 4))))
    # Margins of half a sleep: a plain model that waited behind one hook, or hooks that ran one
    # after another, would take a whole sleep more.
    assert plain_s < HOOK_SLEEP_S / 2, f"a plain model waited {plain_s:.2f} s behind sleeping hooks"
    assert all_s < 1.5 * HOOK_SLEEP_S, f"three hooks took {all_s:.2f} s: they did not overlap"


def test_a_model_py_that_fails_makes_only_its_bundle_unavailable(hooked: Any) -> None:
    index = {m.name: m for m in hooked.get_model_repository_index().models}
    assert index["hooked"].state == "READY" and index["plain"].state == "READY"
    assert index["broken"].state == "UNAVAILABLE"
    assert "model.py" in index["broken"].reason and "cannot find the label map" in index["broken"].reason
    assert index["misnamed"].state == "UNAVAILABLE"
    assert "register_model('other')" in index["misnamed"].reason and "bundle's" in index["misnamed"].reason
    assert not hooked.is_model_ready("broken")


def test_the_severity_grader_grades_as_the_reference(triton: Any) -> None:
    images = np.random.RandomState(7).randint(0, 256, (8, 224, 224), dtype=np.uint8)  # 8 rows: 6 + 3
    tensor = grpcclient.InferInput("INPUT__0", list(images.shape), "UINT8")
    tensor.set_data_from_numpy(images)
    grade = triton.infer("severity_grader", [tensor]).as_numpy("grade")
    logits = reference("severity_grader", images)
    assert_grades(grade, logits)
    assert grade.dtype == np.int64 and len(set(grade.ravel())) > 2  # the images reach several grades
    assert not (EXAMPLES / "severity_grader" / "__pycache__").exists()  # nothing written into bundles
