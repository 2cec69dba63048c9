"""Hot reload (`server.reload`): model.py, weights, added and removed bundles, while serving.

The `live` fixture runs with 0 and 2 frontends; the half-written bundle test is the watcher's
debounce alone, which runs in the engine either way (one process, suite time).
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.bundles import PARAMS, X, affine, affine_output, save_affine_weights, write_affine
from support.numerics import close
from support.servers import make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.engine import reloader

SCALED_PY = """
import time
from hloserve import NamedTensor, register_model

def preprocess(inputs):
    time.sleep(0.02)  # requests spend their time here, so a reload finds some of them inside
    return inputs

def postprocess(outputs):
    return [NamedTensor("OUTPUT", outputs[0].data * {factor})]

register_model("scaled", preprocess=preprocess, postprocess=postprocess)
"""


def _hammer(url: str, model: str, stop: threading.Event, answers: list[Any], failures: list[Any]) -> None:
    """Send requests to `model` until `stop` (at most 20000), recording answers and failures."""
    client = grpcclient.InferenceServerClient(url)
    while not stop.is_set() and len(answers) < 20_000:
        try:
            answers.append(affine_output(client, model))
        except InferenceServerException as e:
            failures.append(e)
    client.close()


def _eventually(check: Callable[[], bool], within_s: float = 10.0) -> None:
    give_up = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < give_up, "the repository change was not applied in time"
        time.sleep(0.05)


@pytest.fixture(name="live", params=[0, 2], ids=["frontends0", "frontends2"])
def _live(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, Any, str]]:
    """A watched repository (`scaled` with a model.py, `steady` hammered by a background client)."""
    write_affine(tmp_path / "steady")
    write_affine(tmp_path / "scaled")
    (tmp_path / "scaled" / "model.py").write_text(SCALED_PY.format(factor=2))
    config = make_config(tmp_path, reload=True, repository_poll_s=0.05, reload_debounce_s=0.2)
    with start_worker(config, frontends=request.param) as server:
        client = grpcclient.InferenceServerClient(server.url)
        stop, failures, served = threading.Event(), [], []
        background = threading.Thread(target=_hammer, args=(server.url, "steady", stop, served, failures))
        background.start()
        yield tmp_path, client, server.url
        stop.set()
        background.join(30)
        client.close()
    assert served and not failures, (
        f"{len(failures)} failures on the model that was not reloaded: {failures[:1]}"
    )
    assert all(close(s, affine(PARAMS, X)) for s in served)


def _is(value: np.ndarray, want: np.ndarray) -> bool:
    return bool(close(value, want))


def test_an_edited_model_py_re_registers_its_hooks(live: Any) -> None:
    path, client, _ = live
    assert _is(affine_output(client, "scaled"), affine(PARAMS, X) * 2)
    (path / "scaled" / "model.py").write_text(SCALED_PY.format(factor=3))
    _eventually(lambda: _is(affine_output(client, "scaled"), affine(PARAMS, X) * 3))


def test_a_broken_model_py_keeps_the_old_hooks_until_it_is_fixed(live: Any) -> None:
    path, client, _ = live
    (path / "scaled" / "model.py").write_text("raise SyntaxError('half an edit')\n")
    time.sleep(1.0)  # 20 polls: long past the debounce
    assert _is(affine_output(client, "scaled"), affine(PARAMS, X) * 2)
    assert client.is_model_ready("scaled")
    (path / "scaled" / "model.py").write_text(SCALED_PY.format(factor=5))
    _eventually(lambda: _is(affine_output(client, "scaled"), affine(PARAMS, X) * 5))


def test_changed_weights_reload_the_bundle_while_its_own_clients_keep_going(live: Any) -> None:
    path, client, url = live
    doubled = {"b": PARAMS["b"] * 2, "w": PARAMS["w"] * 2}
    old, new = affine(PARAMS, X) * 2, affine(doubled, X) * 2
    stop, answers, failures = threading.Event(), [], []
    # requests in flight (some inside the slow hook) as the model is swapped
    threads = [
        threading.Thread(target=_hammer, args=(url, "scaled", stop, answers, failures)) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    save_affine_weights(path / "scaled", doubled)
    try:
        _eventually(lambda: _is(affine_output(client, "scaled"), new))
        time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not failures, f"{len(failures)} requests to the reloaded model failed: {failures[:1]}"
    assert all(_is(a, old) or _is(a, new) for a in answers) and any(_is(a, new) for a in answers)


def test_added_and_removed_bundles_load_and_unload(live: Any) -> None:
    path, client, _ = live
    write_affine(path / "added")
    _eventually(lambda: client.is_model_ready("added"))
    assert _is(affine_output(client, "added"), affine(PARAMS, X))
    shutil.rmtree(path / "added")
    _eventually(lambda: "added" not in [m.name for m in client.get_model_repository_index().models])
    with pytest.raises(InferenceServerException, match="unknown model: 'added'"):
        affine_output(client, "added")


_real_scandir = os.scandir


class _VanishingScan:
    """os.scandir whose directory's files are all removed once its entries are read."""

    def __init__(self, path: str | Path) -> None:
        self._entries = _real_scandir(path)
        self._path = str(path)
        self._read = False

    def __enter__(self) -> _VanishingScan:
        return self

    def __exit__(self, *_: object) -> None:
        self._entries.close()

    def __iter__(self) -> _VanishingScan:
        return self

    def __next__(self) -> os.DirEntry[str]:
        entry = next(self._entries)
        if not self._read and self._path.endswith("leaving"):
            self._read = True
            for name in os.listdir(self._path):
                os.unlink(os.path.join(self._path, name))
        return entry


def test_a_bundle_emptied_while_it_is_scanned_is_skipped_and_its_listing_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_affine(tmp_path / "staying")
    write_affine(tmp_path / "leaving")
    monkeypatch.setattr(reloader.os, "scandir", _VanishingScan)
    unclosed: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unclosed.append)
    found = reloader.scan(tmp_path)
    gc.collect()
    assert set(found) == {"staying"}  # the next scan says what became of "leaving"
    assert unclosed == [], [u.object for u in unclosed]


def test_a_half_written_bundle_is_not_loaded_before_it_settles(tmp_path: Path) -> None:
    source = write_affine(tmp_path / "staging" / "arriving")
    repository = tmp_path / "repository"
    repository.mkdir()
    config = make_config(repository, reload=True, repository_poll_s=0.05, reload_debounce_s=1.0)
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        target = repository / "arriving"
        target.mkdir()
        for name in ("manifest.yaml", "model.b1.mlir", "model.b2.mlir"):
            shutil.copyfile(source / name, target / name)
        weights = (source / "weights.safetensors").read_bytes()
        (target / "weights.safetensors").write_bytes(weights[: len(weights) // 2])  # still copying
        seen = []
        for _ in range(12):  # 0.6 s of copying, shorter than the debounce
            index = client.get_model_repository_index().models  # on disk, listed unloaded
            seen.extend((m.state, m.reason) for m in index if m.reason != "unloaded")
            time.sleep(0.05)
        (target / "weights.safetensors").write_bytes(weights)
        _eventually(lambda: client.is_model_ready("arriving"))
        assert seen == [], f"the half-written bundle was acted on: {seen}"
        assert _is(affine_output(client, "arriving"), affine(PARAMS, X))
        client.close()
