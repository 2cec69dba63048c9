"""Hostile clients of Triton system shared memory, against a worker in a subprocess.

A subprocess, because the old failure was a SIGBUS that kills the whole process. Every object is
a real /dev/shm entry made by the test and removed after; the server allows shared memory and
is capped at `MAX_REGIONS` regions and `MAX_BYTES` bytes so the caps are reached quickly.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import export_examples
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from support.clients import assert_serves
from support.numerics import assert_close
from support.servers import ServerProcess, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.api.shm_registry import ShmRegistry
from hloserve.config import load_config
from hloserve.errors import ConfigError

MAX_REGIONS, MAX_BYTES = 8, 1 << 20
X = np.random.default_rng(13).random((4, 16), dtype=np.float32)
IN_BYTES, OUT_BYTES = X.nbytes, 4 * 4 * 4


@pytest.fixture(scope="module", name="server", params=[0, 2], ids=["frontends0", "frontends2"])
def _server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    env = {
        "HLOSERVE_SERVER_SHM_MAX_REGIONS": str(MAX_REGIONS),
        "HLOSERVE_SERVER_SHM_MAX_BYTES": str(MAX_BYTES),
    }
    with start_worker(
        process="subprocess", args=["--allow-client-shm"], env=env, frontends=request.param
    ) as server:
        yield server


@pytest.fixture(name="client")
def _client(server: ServerProcess) -> Iterator[Any]:
    client = grpcclient.InferenceServerClient(server.url)
    yield client
    assert server.process.poll() is None, "the server died"
    client.unregister_system_shared_memory()
    client.close()


class Objects:
    """Entries this test makes in /dev/shm (any kind), each removed after."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def path(self, label: str) -> Path:
        path = Path(f"/dev/shm/hloserve_hostile_{os.getpid()}_{label}")
        self.paths.append(path)
        return path

    def regular(self, label: str, data: bytes) -> str:
        """A regular object holding `data`; its key."""
        path = self.path(label)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.pwrite(fd, data, 0)
        os.close(fd)
        return f"/{path.name}"

    def remove(self) -> None:
        for path in self.paths:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)


@pytest.fixture(name="objects")
def _objects() -> Iterator[Objects]:
    objects = Objects()
    yield objects
    objects.remove()


def expect(call: Callable[[], Any], status: str, *says: str) -> str:
    """`call` fails with `status` and a bounded message holding each of `says`."""
    with pytest.raises(InferenceServerException) as raised:
        call()
    message = str(raised.value.message())
    assert raised.value.status() == f"StatusCode.{status}", message
    assert all(s in message for s in says), message
    assert len(message) < 1024, message
    return message


def infer(client: Any, *, input_region: str | None = None, output_region: str | None = None) -> Any:
    tensor = grpcclient.InferInput("INPUT0", list(X.shape), "FP32")
    if input_region is None:
        tensor.set_data_from_numpy(X)
    else:
        tensor.set_shared_memory(input_region, IN_BYTES)
    output = grpcclient.InferRequestedOutput("OUTPUT0")
    if output_region is not None:
        output.set_shared_memory(output_region, OUT_BYTES)
    return client.infer("mlp", [tensor], outputs=[output], client_timeout=30)


def fds(server: ServerProcess) -> int:
    return len(os.listdir(f"/proc/{server.pid}/fd"))


def object_fds(server: ServerProcess) -> int:
    """The server's descriptors of this test's /dev/shm objects."""
    prefix = f"/dev/shm/hloserve_hostile_{os.getpid()}_"
    links = [os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.pid}/fd")]
    return sum(link.startswith(prefix) for link in links)


def eventually(predicate: Callable[[], bool], timeout: float = 5) -> bool:
    """Whether `predicate` holds within `timeout` (a closed connection's descriptor goes a little
    after the client's close)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- what the key names ---------------------------------------------------------------------


def test_a_symlink_is_never_followed(
    client: Any, server: ServerProcess, objects: Objects, tmp_path: Path
) -> None:
    """A link in /dev/shm to a host file is refused; the file is neither read nor written."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 4096)
    link = objects.path("link")
    link.symlink_to(secret)
    expect(
        lambda: client.register_system_shared_memory("out", f"/{link.name}", 4096),
        "INVALID_ARGUMENT",
        f"'/{link.name}'",
        "symbolic link",
    )
    expect(lambda: infer(client, output_region="out"), "INVALID_ARGUMENT", "'out': is not registered")
    assert secret.read_bytes() == b"s" * 4096
    assert_serves(server.url)


def test_a_link_swapped_in_after_registration_changes_nothing(
    client: Any, server: ServerProcess, objects: Objects, tmp_path: Path
) -> None:
    """The region keeps the object it opened: renaming a link over its key redirects nothing."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 4096)
    key = objects.regular("swapped", bytes(4096))
    client.register_system_shared_memory("out", key, OUT_BYTES)
    path = Path("/dev/shm") / key[1:]
    staged = objects.path("staged")
    staged.symlink_to(secret)
    staged.rename(path)
    infer(client, output_region="out")
    assert secret.read_bytes() == b"s" * 4096
    assert_serves(server.url)


@pytest.mark.parametrize(
    ("kind", "says"), [("fifo", "is not a regular file"), ("directory", "Is a directory")]
)
def test_not_a_regular_file(
    client: Any, server: ServerProcess, objects: Objects, kind: str, says: str
) -> None:
    path = objects.path(kind)
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    expect(lambda: client.register_system_shared_memory("r", f"/{path.name}", 64), "INVALID_ARGUMENT", says)
    assert not client.get_system_shared_memory_status().regions
    assert_serves(server.url)


def test_an_object_of_another_uid_is_refused(client: Any, server: ServerProcess, objects: Objects) -> None:
    key = objects.regular("foreign", X.tobytes())
    os.chown(f"/dev/shm{key}", 12345, 12345)
    expect(
        lambda: client.register_system_shared_memory("in", key, IN_BYTES),
        "INVALID_ARGUMENT",
        "owned by uid 12345",
        "server.shm_allowed_uids",
    )
    assert_serves(server.url)
    # the uids a server allows are its configuration: one allowing 12345 opens it
    registry = ShmRegistry(owners=frozenset({12345}))
    np.testing.assert_array_equal(
        registry.register("in", key, 0, IN_BYTES).read(0, 64).view(np.float32), X[0]
    )
    registry.close()


@pytest.mark.parametrize(
    ("name", "key", "says"),
    [
        ("n" * 256, "/k", "name has 256 bytes; at most 255"),
        ("r", "/" + "k" * 256, "key has 257 bytes; at most 255"),
        ("r", "/../etc/passwd", "directly under /dev/shm"),
        ("r", "..", "directly under /dev/shm"),
        ("r", "//etc", "directly under /dev/shm"),
        ("r", "/", "directly under /dev/shm"),
        ("r", "/a\0b", "directly under /dev/shm"),
    ],
)
def test_bad_names_and_keys(client: Any, server: ServerProcess, name: str, key: str, says: str) -> None:
    expect(lambda: client.register_system_shared_memory(name, key, 64), "INVALID_ARGUMENT", says)
    assert_serves(server.url)


def test_a_huge_region_name_in_a_request_gets_a_short_answer(client: Any, server: ServerProcess) -> None:
    expect(lambda: infer(client, input_region="r" * 100_000), "INVALID_ARGUMENT", "at most 255")
    assert_serves(server.url)


# -- one name, one object --------------------------------------------------------------------


def test_re_registering_a_name_is_refused(client: Any, server: ServerProcess) -> None:
    """As Triton: the first registration keeps receiving its outputs."""
    key = f"/hloserve_hostile_{os.getpid()}"
    first = shm.create_shared_memory_region("first", f"{key}_first", OUT_BYTES)
    second = shm.create_shared_memory_region("second", f"{key}_second", OUT_BYTES)
    try:
        shm.set_shared_memory_region(second, [np.full(16, 7.0, np.float32)])
        client.register_system_shared_memory("out", f"{key}_first", OUT_BYTES)
        expect(
            lambda: client.register_system_shared_memory("out", f"{key}_second", OUT_BYTES),
            "ALREADY_EXISTS",
            "region 'out': is already registered",
        )
        infer(client, output_region="out")
        got = shm.get_contents_as_numpy(first, np.float32, [4, 4])
        assert_close(got, export_examples.reference("mlp", X))
        np.testing.assert_array_equal(shm.get_contents_as_numpy(second, np.float32, [16]), 7.0)
        assert client.get_system_shared_memory_status("out").regions["out"].key == f"{key}_first"
    finally:
        shm.destroy_shared_memory_region(first)
        shm.destroy_shared_memory_region(second)
    assert_serves(server.url)


# -- truncation --------------------------------------------------------------------------------


def test_a_truncated_object_is_an_error_not_a_crash(
    client: Any, server: ServerProcess, objects: Objects
) -> None:
    """Truncated after registration, an input or output region answers INVALID_ARGUMENT (it was SIGBUS)."""
    in_key = objects.regular("in", X.tobytes())
    out_key = objects.regular("out", bytes(OUT_BYTES))
    client.register_system_shared_memory("in", in_key, IN_BYTES)
    client.register_system_shared_memory("out", out_key, OUT_BYTES)
    assert_close(infer(client, input_region="in").as_numpy("OUTPUT0"), export_examples.reference("mlp", X))
    os.truncate(f"/dev/shm{in_key}", 0)
    expect(
        lambda: infer(client, input_region="in"),
        "INVALID_ARGUMENT",
        "region 'in'",
        "truncated to 0 bytes",
    )
    os.truncate(f"/dev/shm{out_key}", 8)
    expect(
        lambda: infer(client, output_region="out"), "INVALID_ARGUMENT", "region 'out'", "truncated to 8 bytes"
    )
    assert os.stat(f"/dev/shm{out_key}").st_size == 8, "a refused write must not grow the object"
    assert server.process.poll() is None
    assert_serves(server.url)


def test_truncation_racing_requests_never_kills_the_server(
    client: Any, server: ServerProcess, objects: Objects
) -> None:
    """An object shrunk and regrown while requests read and write it: each request succeeds or is
    refused, and the server survives (a check before the copy alone would race)."""
    in_key = objects.regular("in", X.tobytes())
    out_key = objects.regular("out", bytes(OUT_BYTES))
    client.register_system_shared_memory("in", in_key, IN_BYTES)
    client.register_system_shared_memory("out", out_key, OUT_BYTES)
    stop = threading.Event()

    def churn() -> None:
        for _ in range(100_000):
            if stop.is_set():
                return
            for key, size in ((in_key, IN_BYTES), (out_key, OUT_BYTES)):
                os.truncate(f"/dev/shm{key}", 0)
                os.truncate(f"/dev/shm{key}", size)

    churner = threading.Thread(target=churn)
    churner.start()
    outcomes = []
    try:
        for _ in range(60):
            try:
                infer(client, input_region="in", output_region="out")
                outcomes.append("OK")
            except InferenceServerException as e:
                assert e.status() == "StatusCode.INVALID_ARGUMENT", e.message()
                assert "truncated" in str(e.message()), e.message()
                outcomes.append("INVALID_ARGUMENT")
    finally:
        stop.set()
        churner.join(30)
    assert len(outcomes) == 60 and "INVALID_ARGUMENT" in outcomes
    assert server.process.poll() is None
    assert_serves(server.url)


# -- caps and descriptors -----------------------------------------------------------------------


def test_region_cap_then_unregister_makes_room(client: Any, server: ServerProcess, objects: Objects) -> None:
    key = objects.regular("small", bytes(64))
    for i in range(MAX_REGIONS):
        client.register_system_shared_memory(f"r{i}", key, 64)
    assert object_fds(server) == MAX_REGIONS
    expect(
        lambda: client.register_system_shared_memory("one-more", key, 64),
        "RESOURCE_EXHAUSTED",
        f"{MAX_REGIONS} regions are registered",
        "server.shm_max_regions",
    )
    client.unregister_system_shared_memory("r0")
    assert object_fds(server) == MAX_REGIONS - 1, "unregister closes the descriptor at once"
    client.register_system_shared_memory("one-more", key, 64)
    client.unregister_system_shared_memory()
    assert object_fds(server) == 0
    assert_serves(server.url)


def test_byte_cap_then_unregister_makes_room(client: Any, server: ServerProcess, objects: Objects) -> None:
    key = objects.regular("big", bytes(MAX_BYTES))
    client.register_system_shared_memory("most", key, MAX_BYTES - 64)
    expect(
        lambda: client.register_system_shared_memory("more", key, 128),
        "RESOURCE_EXHAUSTED",
        f"128 bytes on top of the {MAX_BYTES - 64} registered exceed {MAX_BYTES}",
        "server.shm_max_bytes",
    )
    client.register_system_shared_memory("rest", key, 64)
    client.unregister_system_shared_memory("most")
    client.register_system_shared_memory("more", key, 128)
    assert sorted(client.get_system_shared_memory_status().regions) == ["more", "rest"]
    assert_serves(server.url)


def test_descriptors_return_to_baseline_after_unregister_all(
    client: Any, server: ServerProcess, objects: Objects
) -> None:
    """Registering up to the cap and unregistering all, with requests reading the regions, many
    times over: the server's descriptor count comes back to where it was."""
    key = objects.regular("in", X.tobytes())
    client.get_system_shared_memory_status()  # the connection's own descriptor is in the baseline
    assert eventually(lambda: object_fds(server) == 0)
    baseline = fds(server)
    for round_ in range(10):
        for i in range(MAX_REGIONS):
            client.register_system_shared_memory(f"r{i}", key, IN_BYTES)
        assert fds(server) >= baseline + MAX_REGIONS
        infer(client, input_region=f"r{round_ % MAX_REGIONS}")
        client.unregister_system_shared_memory()
    assert eventually(lambda: fds(server) == baseline), (fds(server), baseline)
    assert_serves(server.url)


def test_allowed_uids_are_checked_when_the_config_loads() -> None:
    config = load_config(environ={"HLOSERVE_SERVER_SHM_ALLOWED_UIDS": "0, 12345"})
    assert config.server.shm_owner_uids == {0, 12345}
    assert load_config(environ={}).server.shm_owner_uids == {os.geteuid()}
    with pytest.raises(ConfigError, match=r"server\.shm_allowed_uids: got 'root'; expected comma-separated"):
        load_config(environ={"HLOSERVE_SERVER_SHM_ALLOWED_UIDS": "root"})
