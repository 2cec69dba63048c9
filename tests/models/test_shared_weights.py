"""Shared host weights: two worker processes, one region per model, the last holder unlinks it.

One process per worker: shared weights are the engine's.
"""

from __future__ import annotations

import os
import signal
import stat
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.bundles import PARAMS, assert_affine_answers, write_affine
from support.servers import start_worker

from hloserve.models.bundle import load_bundle
from hloserve.models.shared_weights import SharedHostWeights


def test_attach_fill_and_last_holder_unlinks(tmp_path: Path) -> None:
    bundle = load_bundle(write_affine(tmp_path / f"sw{os.getpid()}"))
    first = SharedHostWeights.acquire(bundle, 0o640)
    second = SharedHostWeights.acquire(bundle, 0o640)
    assert first.filled and not second.filled and first.name == second.name
    region = Path("/dev/shm") / first.name
    assert stat.S_IMODE(region.stat().st_mode) == 0o640
    np.testing.assert_array_equal(second.arrays[1], PARAMS["w"])
    assert all(a.ctypes.data % 64 == 0 for a in second.arrays)
    first.release()
    assert region.exists()  # the second worker still holds it
    second.release()
    assert not region.exists()
    Path(f"{region}.lock").unlink()  # kept by design (a lock must outlive its region); the test tidies


def test_a_stale_version_nobody_holds_is_swept_and_a_held_one_kept(tmp_path: Path) -> None:
    directory = write_affine(tmp_path / f"sweep{os.getpid()}")
    crashed = SharedHostWeights.acquire(load_bundle(directory), 0o640)
    os.close(crashed._lock_fd)  # the worker died holding it: its flock is gone, the region stays
    stale = Path("/dev/shm") / crashed.name
    os.utime(directory / "weights.safetensors", ns=(1, 1))  # a changed bundle: a new digest
    current = SharedHostWeights.acquire(load_bundle(directory), 0o640)
    assert current.name != crashed.name and not stale.exists()
    os.utime(directory / "weights.safetensors", ns=(2, 2))
    newest = SharedHostWeights.acquire(load_bundle(directory), 0o640)
    assert (Path("/dev/shm") / current.name).exists()  # still held by `current`: never swept
    current.release()
    newest.release()
    for region in {crashed.name, current.name, newest.name}:
        Path(f"/dev/shm/{region}.lock").unlink()


@pytest.mark.slow
def test_two_worker_processes_share_one_region(tmp_path: Path) -> None:
    model = f"shared{os.getpid()}"
    write_affine(tmp_path / model)
    env = {
        "HLOSERVE_SERVER_MODEL_REPOSITORY": str(tmp_path),
        "HLOSERVE_WEIGHTS_SHARED_HOST_WEIGHTS": "true",
        "HLOSERVE_WEIGHTS_SHARED_HOST_WEIGHTS_MODE": "640",
        "HLOSERVE_SERVER_CACHE_EXECUTABLES": "false",
    }
    with ExitStack() as stack:
        workers = [
            stack.enter_context(start_worker(process="subprocess", repository=None, env=env))
            for _ in range(2)
        ]
        regions = sorted(Path("/dev/shm").glob(f"hloserve-w-{model}-*"))
        regions = [r for r in regions if not r.name.endswith(".lock")]
        assert len(regions) == 1, regions
        assert stat.S_IMODE(regions[0].stat().st_mode) == 0o640
        for worker in workers:
            client = grpcclient.InferenceServerClient(worker.url)
            assert_affine_answers(client, model)
            client.close()
        workers[0].process.send_signal(signal.SIGTERM)
        assert workers[0].process.wait(60) == 0
        assert regions[0].exists()  # the other worker still holds it
        workers[1].process.send_signal(signal.SIGTERM)
        assert workers[1].process.wait(60) == 0
        assert not regions[0].exists()  # the last holder unlinked it
        Path(f"{regions[0]}.lock").unlink()
