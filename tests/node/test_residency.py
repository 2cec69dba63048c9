"""Residency hints on workers whose residency is externally managed: the controller pins on each
worker what `lpt_packing` placed there (SetModelResidency) and releases the rest, so the worker,
which loads nothing by itself, serves what its routes send it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as triton
from grpclib.client import Channel
from support.bundles import assert_affine_answers, write_affine
from support.servers import ServerProcess, start_worker

from hloserve._proto import hloserve_control as control
from hloserve.config import NodeConfig
from hloserve.fleet.controller import Controller, WorkerLink

pytestmark = pytest.mark.slow

EXTERNAL = {"HLOSERVE_WEIGHTS_EXTERNALLY_MANAGED": "true", "HLOSERVE_SERVER_HTTP_PORT": "-1"}


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    repository: Path = tmp_path_factory.mktemp("repository")
    for name in ("a", "b"):
        write_affine(repository / name)
    with (
        start_worker(process="subprocess", repository=repository, env=EXTERNAL) as first,
        start_worker(process="subprocess", repository=repository, env=EXTERNAL) as second,
    ):
        assert isinstance(first, ServerProcess) and isinstance(second, ServerProcess)
        yield [first, second]


async def _on_device(address: str) -> set[str]:
    host, _, port = address.rpartition(":")
    channel = Channel(host, int(port))
    try:
        status = await control.ControlServiceStub(channel).model_control_status(
            control.ModelControlStatusRequest()
        )
    finally:
        channel.close()
    return {m.name for m in status.models if m.device_resident}


def test_each_worker_pins_what_was_placed_on_it_and_releases_the_rest(workers: list[ServerProcess]) -> None:
    links = [WorkerLink(f"worker{i}", f"127.0.0.1:{w.grpc_port}", None) for i, w in enumerate(workers)]
    controller = Controller(NodeConfig(scheduling="lpt_packing"), links, lambda routes: None)

    async def rounds() -> tuple[list[set[str]], list[set[str]], dict[str, tuple[str, ...]]]:
        try:
            unpinned = [await _on_device(w.address) for w in links]
            await controller.round()  # the startup placement, then its hints
            first = [await _on_device(w.address) for w in links]
            controller.replicas["a"] = -1  # a on every worker, at the next repack
            controller.requested += 1  # as Repack asks for one
            await controller.round()
            return unpinned, first, dict(controller.placed)
        finally:
            for link in links:
                link.reset()

    unpinned, first, placed = asyncio.run(rounds())
    assert unpinned == [set(), set()]  # externally managed: nothing on the device by itself
    assert sorted(first, key=sorted) == [{"a"}, {"b"}]  # spread, one model each
    assert placed["a"] == ("worker0", "worker1")
    after = asyncio.run(_gather(links))
    assert after == [{m for m, ws in placed.items() if link.name in ws} for link in links]
    for worker in workers:  # what is routed there is served there
        client = triton.InferenceServerClient(f"127.0.0.1:{worker.grpc_port}")
        assert_affine_answers(client, "a")


async def _gather(links: list[WorkerLink]) -> list[set[str]]:
    return [await _on_device(w.address) for w in links]
