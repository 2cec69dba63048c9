"""RepositoryModelLoad with Triton's `file:` parameters: a bundle sent in the request."""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support.bundles import (
    PARAMS,
    X,
    affine,
    affine_output,
    assert_affine_answers,
    save_affine_weights,
    write_affine,
)
from support.clients import wait_until
from support.numerics import assert_close
from support.servers import make_config, start_worker
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

MAX_FILES = 4  # an affine bundle's: manifest, two modules, weights
SPARE_BYTES = 16


def bundle_files(directory: Path, scale: float = 1.0) -> dict[str, bytes]:
    """The files of an affine bundle (its weights times `scale`) as `load_model(files=...)` takes
    them; the bundle is named as `directory` (the manifest's name is the model's)."""
    source = write_affine(directory)
    if scale != 1.0:
        save_affine_weights(source, {k: v * scale for k, v in PARAMS.items()})
    return {f"file:{p.relative_to(source)}": p.read_bytes() for p in sorted(source.rglob("*")) if p.is_file()}


@pytest.fixture(name="served")
def _served(tmp_path: Path) -> Any:
    repository = tmp_path / "repository"
    write_affine(repository / "steady")
    files = bundle_files(tmp_path / "sent")
    limit = sum(len(v) for v in files.values()) + SPARE_BYTES  # other names take a few bytes more
    config = make_config(repository, max_load_files=MAX_FILES, max_load_file_bytes=limit)
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        yield server, client, files, tmp_path
        client.close()


def private_directories(server: Any) -> list[Path]:
    root = server.worker.loads_directory
    return [] if root is None else sorted(root.iterdir())


def test_a_bundle_sent_as_files_is_served_until_unloaded(served: Any) -> None:
    server, client, files, _ = served
    client.load_model("sent", config="{}", files=files)
    assert_affine_answers(client, "sent")
    [private] = private_directories(server)
    assert (private.stat().st_mode & 0o777) == 0o700
    assert sorted(p.name for p in (private / "sent").iterdir()) == sorted(k[5:] for k in files)
    assert client.get_model_config("sent").config.max_batch_size == 2
    client.unload_model("sent")
    assert private_directories(server) == []
    assert not client.is_model_ready("sent")
    assert_affine_answers(client, "steady")


def test_a_replacement_removes_the_private_directory_and_shutdown_the_rest(served: Any) -> None:
    server, client, files, tmp_path = served
    client.load_model("steady", config="{}", files=bundle_files(tmp_path / "double" / "steady", scale=2.0))
    [first] = private_directories(server)
    doubled = affine({k: v * 2 for k, v in PARAMS.items()}, X)
    assert_close(affine_output(client, "steady"), doubled)
    client.load_model("steady", config="{}", files=bundle_files(tmp_path / "again" / "steady"))
    [second] = private_directories(server)
    assert second != first
    assert_affine_answers(client, "steady")
    client.load_model("steady")  # the repository's copy replaces the one sent
    assert private_directories(server) == []
    assert_affine_answers(client, "steady")
    client.load_model("sent", config="{}", files=files)
    root = server.worker.loads_directory
    server.stop()
    assert not root.exists()


def test_a_failed_load_from_files_leaves_nothing_and_keeps_the_old_version(served: Any) -> None:
    server, client, files, _ = served
    client.load_model("sent", config="{}", files=files)
    [private] = private_directories(server)
    broken = {**files, "file:weights.safetensors": b"\0" * 8}
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("sent", config="{}", files=broken)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "weights.safetensors" in (raised.value.message() or "")
    assert private_directories(server) == [private]  # the old version's, still serving
    assert_affine_answers(client, "sent")
    without_manifest = {k: v for k, v in files.items() if k != "file:manifest.yaml"}
    with pytest.raises(InferenceServerException, match=r"no bundle 'fresh' \(no manifest\.yaml\)"):
        client.load_model("fresh", config="{}", files=without_manifest)
    assert private_directories(server) == [private]


def raw_load(server: Any, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> grpc.RpcError:
    with grpc.insecure_channel(server.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.RepositoryModelLoadRequest(model_name="sent", parameters=parameters)
        with pytest.raises(grpc.RpcError) as raised:
            stub.RepositoryModelLoad(request, timeout=30)
    return raised.value


@pytest.mark.parametrize(
    ("change", "key", "says"),
    [
        ({"file:/etc/manifest.yaml": b"x"}, "file:/etc/manifest.yaml", "must be relative to the bundle"),
        ({"file:../escape": b"x"}, "file:../escape", "may not hold '..'"),
        ({"file:a//b": b"x"}, "file:a//b", "may not hold '..', '.' or empty parts"),
        ({"file:": b"x"}, "file:", "the path is empty"),
        ({"file:bad\x07name": b"x"}, "file:bad\x07name", "only printable characters"),
        ({"file:manifest.yaml/x": b"x"}, "file:manifest.yaml/x", "a file and a directory"),
        ({"file:" + "x" * 256: b"x"}, "file:" + "x" * 75, "at most 8 parts of at most 255 bytes each"),
        ({"file:" + "d/" * 8 + "f": b"x"}, "file:" + "d/" * 8 + "f", "at most 8 parts"),
        ({"file:model.py": b"import os"}, "file:model.py", "no code from a client runs"),
        ({"file:sub/model.py": b"import os"}, "file:sub/model.py", "no code from a client runs"),
        ({"file:extra": b""}, None, f"5 files sent; at most {MAX_FILES} (server.max_load_files)"),
    ],
)
def test_a_bad_file_parameter_is_refused_naming_it(
    served: Any, change: dict, key: str | None, says: str
) -> None:
    server, client, files, _ = served
    sent = dict(files) if key is None else {k: v for k, v in files.items() if k != "file:weights.safetensors"}
    with pytest.raises(InferenceServerException) as raised:  # a bad file in place of the weights
        client.load_model("sent", config="{}", files={**sent, **change})
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = raised.value.message() or ""
    assert says in message
    assert key is None or f"load parameter {key!r}" in message
    assert private_directories(server) == []
    assert not client.is_model_ready("sent")
    assert_affine_answers(client, "steady")
    client.load_model("sent", config="{}", files=files)  # the next good load is served
    assert_affine_answers(client, "sent")


def test_files_past_the_byte_limit_or_without_config_or_not_bytes_are_refused(served: Any) -> None:
    server, client, files, _ = served
    past = b"\n" * (SPARE_BYTES + 1)  # one byte past the limit
    bigger = {**files, "file:manifest.yaml": files["file:manifest.yaml"] + past}
    with pytest.raises(InferenceServerException, match=r"exceed \d+ bytes \(server.max_load_file_bytes\)"):
        client.load_model("sent", config="{}", files=bigger)
    with pytest.raises(InferenceServerException, match="file overrides need a 'config' parameter too"):
        client.load_model("sent", files=files)
    parameters = {k: service_pb2.ModelRepositoryParameter(bytes_param=v) for k, v in files.items()}
    parameters["config"] = service_pb2.ModelRepositoryParameter(string_param="{}")
    parameters["file:weights.safetensors"] = service_pb2.ModelRepositoryParameter(string_param="text")
    error = raw_load(server, parameters)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'file:weights.safetensors': a file's contents are bytes" in (error.details() or "")
    assert private_directories(server) == []
    exactly = {**files, "file:manifest.yaml": files["file:manifest.yaml"] + past[1:]}
    client.load_model("sent", config="{}", files=exactly)  # exactly at the limit: served
    assert_affine_answers(client, "sent")


def test_loading_from_files_can_be_turned_off(tmp_path: Path) -> None:
    files = bundle_files(tmp_path / "sent")
    write_affine(tmp_path / "repository" / "steady")
    with start_worker(make_config(tmp_path / "repository", max_load_files=0)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException, match="loading a bundle from files is turned off"):
            client.load_model("sent", config="{}", files=files)
        assert_affine_answers(client, "steady")
        assert server.worker.loads_directory is None


def test_rest_load_takes_files_in_base64(served: Any) -> None:
    server, client, files, tmp_path = served
    body = {"config": "{}", **{k: base64.b64encode(v).decode() for k, v in files.items()}}
    url = f"http://{server.http_url}/v2/repository/models/sent/load"

    def post() -> urllib.request.Request:
        return urllib.request.Request(url, json.dumps({"parameters": body}).encode(), method="POST")

    with urllib.request.urlopen(post(), timeout=60) as reply:
        assert reply.status == 200
    assert_affine_answers(client, "sent")
    rest = httpclient.InferenceServerClient(server.http_url)  # Triton's own REST client
    rest.load_model("again", config="{}", files=bundle_files(tmp_path / "again"))
    rest.close()
    assert_affine_answers(client, "again")
    body["file:manifest.yaml"] = "not base64!"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(post(), timeout=60)
    assert refused.value.code == 400
    error = json.loads(refused.value.read())["error"]
    assert "'file:manifest.yaml': expected the file's bytes in base64" in error
    assert_affine_answers(client, "sent")


def test_hot_reload_leaves_a_model_loaded_from_files_alone(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    write_affine(repository / "steady")
    config = make_config(repository, reload=True, repository_poll_s=0.05, reload_debounce_s=0.05)
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        client.load_model(
            "steady", config="{}", files=bundle_files(tmp_path / "double" / "steady", scale=2.0)
        )
        write_affine(repository / "twin")  # the watcher is alive: it loads a new bundle
        (repository / "steady" / "manifest.yaml").touch()
        os.utime(repository / "steady" / "manifest.yaml", (time.time() + 5, time.time() + 5))
        wait_until(lambda: client.is_model_ready("twin"), 30, "the watcher to load 'twin'")
        time.sleep(0.3)  # a few more polls: the changed 'steady' would have been reloaded by now
        doubled = affine({k: v * 2 for k, v in PARAMS.items()}, X)
        assert_close(affine_output(client, "steady"), doubled)
        assert server.worker.from_files("steady")
