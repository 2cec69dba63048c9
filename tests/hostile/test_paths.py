"""Model names are plain names and bundles load only from inside the repository.

A hostile client names a path in RepositoryModelLoad (or a control RPC) hoping the server will
read a bundle from elsewhere and execute its `model.py`. Every bundle planted outside the
repository here writes a marker file when its `model.py` runs; the marker must never appear,
and the server must keep serving.

One process: the name and path checks run in the engine (loads go there from any frontend).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from grpclib.const import Status
from support.bundles import edit_manifest
from support.clients import assert_control_refused, assert_serves
from support.servers import EXAMPLES, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve._proto import hloserve_control as hc
from hloserve.models.bundle import MAX_NAME_BYTES


def _planted(directory: Path, marker: Path) -> Path:
    """A valid bundle at `directory` whose model.py writes `marker` when it is executed."""
    shutil.copytree(EXAMPLES / "mlp", directory)
    edit_manifest(directory, lambda m: m.update(name=directory.name))
    (directory / "model.py").write_text(
        f"from pathlib import Path\nfrom hloserve import register_model\n"
        f"Path({str(marker)!r}).write_text('model.py ran')\nregister_model({directory.name!r})\n"
    )
    return directory


@pytest.fixture(scope="module", name="site")
def _site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A repository (mlp, cnn), bundles planted outside it, links from it, and a server."""
    root = tmp_path_factory.mktemp("paths")
    repository, outside = root / "repository", root / "outside"
    marker = root / "MARKER"
    for name in ("mlp", "cnn"):
        shutil.copytree(EXAMPLES / name, repository / name)
    _planted(outside / "evil", marker)
    (repository / "linked").symlink_to(_planted(outside / "linked", marker), target_is_directory=True)
    hooked = repository / "hooked"  # a bundle of the repository whose model.py is a link out
    shutil.copytree(EXAMPLES / "mlp", hooked)
    edit_manifest(hooked, lambda m: m.update(name="hooked"))
    (hooked / "model.py").symlink_to(_planted(outside / "hooked", marker) / "model.py")
    looped = repository / "looped"  # a module file that is a link to itself
    shutil.copytree(EXAMPLES / "mlp", looped)
    edit_manifest(looped, lambda m: m.update(name="looped"))
    (looped / "model.b1.mlir").unlink()
    (looped / "model.b1.mlir").symlink_to("model.b1.mlir")
    # A link that stays inside (a Kubernetes volume is made of these) is a bundle like any other.
    shutil.copytree(EXAMPLES / "cnn", repository / "..data" / "kept")
    edit_manifest(repository / "..data" / "kept", lambda m: m.update(name="kept"))
    (repository / "kept").symlink_to(Path("..data") / "kept", target_is_directory=True)
    # Linked and hooked exist from the start: startup must refuse them as well.
    with start_worker(make_config(repository)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        yield server, client, repository, outside, marker
        client.close()


def _refused(status: str, says: str, call: Any, *args: Any, **kwargs: Any) -> str:
    """`call(*args, **kwargs)` fails with `status` and a message containing `says`; the message."""
    with pytest.raises(InferenceServerException) as raised:
        call(*args, **kwargs)
    message = raised.value.message() or ""
    assert raised.value.status() == f"StatusCode.{status}", message
    assert says in message, message
    return message


NOT_A_PATH = "a model name is a plain name, not a path"


def test_load_refuses_paths_and_runs_nothing_from_outside(site: Any) -> None:
    server, client, _, outside, marker = site
    for name in (
        str(outside / "evil"),  # absolute
        f"../{outside.name}/evil",  # climbs out
        "mlp/../cnn",  # another bundle under a made-up name
        "mlp\\..\\cnn",
    ):
        _refused("INVALID_ARGUMENT", NOT_A_PATH, client.load_model, name)
    _refused("INVALID_ARGUMENT", "may not be '.' or '..'", client.load_model, "..")
    _refused("INVALID_ARGUMENT", "no NUL or control characters", client.load_model, "mlp\x00")
    _refused("INVALID_ARGUMENT", "no NUL or control characters", client.load_model, "mlp\n")
    long = _refused("INVALID_ARGUMENT", f"at most {MAX_NAME_BYTES} bytes", client.load_model, "m" * 10_240)
    assert len(long) < 400  # the name is quoted only in part
    _refused("INVALID_ARGUMENT", "must not be empty", client.load_model, "")
    _refused("NOT_FOUND", "the repository has no bundle 'nothing'", client.load_model, "nothing")
    assert not marker.exists()
    assert "mlp/../cnn" not in [m.name for m in client.get_model_repository_index().models]
    assert_serves(server.url)


def test_a_bundle_linked_from_outside_is_refused(site: Any) -> None:
    """A bundle directory that is a link leading out of the repository, or a bundle whose
    model.py is one, is refused at startup and on load; its model.py never runs. A loop of
    links is one bad bundle, not a failed startup."""
    server, client, _, _, marker = site
    index = {m.name: m for m in client.get_model_repository_index().models}
    for name, file in (("linked", "linked/"), ("hooked", "model.py")):
        assert index[name].state == "UNAVAILABLE"
        assert f"file '{file}': is a link leading outside the model repository" in index[name].reason
        says = f"bundle '{name}', file '{file}': is a link leading outside the model repository"
        _refused("INVALID_ARGUMENT", says, client.load_model, name)
    assert "file 'model.b1.mlir': is a link that cannot be followed" in index["looped"].reason
    assert not marker.exists()
    assert_serves(server.url)


def test_load_refuses_a_model_py_or_a_path_leaving_the_bundle_and_config_fields_it_cannot_apply(
    site: Any,
) -> None:
    """Triton's load may carry files to load the model from: a model.py, or a path leading out
    of the bundle, is refused, nothing is written and the model.py never runs; a config applies
    only serving settings, never the bundle."""
    server, client, repository, _, marker = site
    model_py = f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n".encode()
    for key, says in (
        ("file:1/model.py", "no code from a client runs in the server"),
        ("file:../../escape/model.py", "may not hold '..'"),
        ("file:/tmp/model.py", "must be relative to the bundle directory"),
    ):
        _refused("INVALID_ARGUMENT", says, client.load_model, "mlp", config="{}", files={key: model_py})
    backend = '{"backend": "python"}'
    _refused(
        "INVALID_ARGUMENT", "field 'backend': is not supported", client.load_model, "mlp", config=backend
    )
    assert not marker.exists() and not (repository / "mlp" / "1").exists()
    assert not (repository.parent / "escape").exists()
    assert_serves(server.url)


def test_a_link_inside_the_repository_loads(site: Any) -> None:
    server, client, _, _, _ = site
    assert client.is_model_ready("kept")
    client.load_model("kept")
    assert client.is_model_ready("kept")
    assert_serves(server.url)


def test_unload_and_control_names_are_checked(site: Any) -> None:
    server, client, _, _, marker = site
    _refused("INVALID_ARGUMENT", NOT_A_PATH, client.unload_model, "../repository/mlp")
    _refused("INVALID_ARGUMENT", "no NUL", client.unload_model, "mlp\x00")
    _refused("NOT_FOUND", "unknown model: 'nope'", client.unload_model, "nope")
    calls = (
        lambda s: s.set_model_policy(hc.SetModelPolicyRequest(name="/mlp", has_weight=True, weight=1)),
        lambda s: s.set_model_residency(hc.SetModelResidencyRequest(name="a/b", target=hc.Residency.SYSTEM)),
        lambda s: s.compact_memory(hc.CompactMemoryRequest(reload_models=["mlp", "..\\mlp"])),
    )
    assert_control_refused(server, calls, Status.INVALID_ARGUMENT, NOT_A_PATH)
    assert client.is_model_ready("mlp")
    assert not marker.exists()
    assert server.call(lambda: dict(server.worker._turns)) == {}  # no lock outlives its call
    assert_serves(server.url)


def test_the_watcher_ignores_directories_that_are_not_model_names(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "mlp", tmp_path / "mlp")
    config = make_config(tmp_path, reload=True, repository_poll_s=0.02, reload_debounce_s=0.0)
    with start_worker(config) as server:
        marker = tmp_path / "MARKER"
        _planted(tmp_path / "bad\x1bname", marker)
        os.rename(tmp_path / "mlp", tmp_path / "mlp2")  # what the watcher does apply, to wait on
        edit_manifest(tmp_path / "mlp2", lambda m: m.update(name="mlp2"))
        deadline = time.monotonic() + 10
        while "mlp2" not in server.call(lambda: set(server.worker.models)):
            assert time.monotonic() < deadline, "the watcher did not load mlp2"
            time.sleep(0.02)
        assert server.call(lambda: sorted(server.worker.models)) == ["mlp2"]
        assert not marker.exists()
