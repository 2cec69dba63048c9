"""The service's seam: a gRPC front end whose executable inputs go over a real link (socketpair,
/dev/shm arena) to an engine, as a frontend process's will, answers through tritonclient what the
single process answers: plain models on many connections at once, model.py hooks run on the
front end's side, and the same statuses for a missing model and a passed deadline."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any

import numpy as np
import pytest
import trio
import trio_asyncio
import tritonclient.grpc as grpcclient
from export_examples import reference
from support.clients import infer
from support.numerics import assert_close, assert_grades
from support.servers import make_config
from tritonclient.utils import InferenceServerException

from hloserve._transport import grpclib_patches as _grpclib_patches
from hloserve.api.data_plane import LocalDataPlane
from hloserve.api.grpc_service import InferenceService
from hloserve.api.model_plane import LocalModelPlane
from hloserve.api.repository_plane import LocalRepositoryPlane
from hloserve.api.wire_codec import KnownFieldsCodec
from hloserve.config import ModelSettings
from hloserve.engine.buffer_pool import BufferPool
from hloserve.engine.meta import MetaModels
from hloserve.engine.metrics import Metrics
from hloserve.engine.policy import PolicyParams
from hloserve.frontends.engine_link import EngineLink
from hloserve.frontends.frontend_link import FrontendLink, execute_over
from hloserve.worker import serve


class FrontEndOverLink:
    """An engine (`serve`) and, in the same trio run on a background thread, a second gRPC front
    end whose ModelInfer executes over a link to it: what a frontend process will host."""

    def __init__(self, **scheduler: Any) -> None:
        self.config = make_config(http_port=-1, metrics_port=-1, scheduler=scheduler or None)
        self._started: queue.Queue[Any] = queue.Queue()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self.port = 0

    async def _main(self) -> None:
        self._token, self._stop = trio.lowlevel.current_trio_token(), trio.Event()
        try:
            async with serve(self.config) as worker, trio.open_nursery() as nursery:
                engine_end, frontend_end = trio.socket.socketpair()
                await nursery.start(EngineLink(trio.SocketStream(engine_end), worker.models).run)
                with BufferPool(32 << 20, 16, name="hloserve-test-seam") as arena:
                    link = FrontendLink(trio.SocketStream(frontend_end), arena)
                    await nursery.start(link.run)
                    metas = MetaModels(worker.models, 1, 1, None, worker.statistics, PolicyParams())
                    tables = {"config": self.config, "models": worker.models, "statistics": worker.statistics}
                    plane = LocalDataPlane(
                        **tables, metrics=Metrics(worker.statistics), metas=metas, execute=execute_over(link)
                    )
                    service = InferenceService(
                        data=plane,
                        models=LocalModelPlane(**tables, host=worker, platform="cpu"),
                        repository=LocalRepositoryPlane(**tables, host=worker),
                    )
                    server = _grpclib_patches.GracefulServer(
                        [service],
                        codec=KnownFieldsCodec(),
                        limits=_grpclib_patches.TransportLimits.from_config(self.config.server),
                    )
                    await trio_asyncio.aio_as_trio(server.start)("127.0.0.1", 0)
                    self.port = server.port
                    self._started.put(None)
                    await self._stop.wait()
                    await trio_asyncio.aio_as_trio(server.shutdown)(1.0)
                    nursery.cancel_scope.cancel()
        except BaseException as e:
            self._started.put(e)
            raise

    def __enter__(self) -> FrontEndOverLink:
        self._thread.start()
        if isinstance(started := self._started.get(timeout=120), BaseException):
            raise RuntimeError("the front end over a link did not start") from started
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(30)

    def client(self) -> grpcclient.InferenceServerClient:
        # Its own TCP connection: grpcio otherwise shares one among a process's channels.
        url = f"127.0.0.1:{self.port}"
        return grpcclient.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)])


@pytest.fixture(scope="module", name="front")
def _front() -> Iterator[FrontEndOverLink]:
    with FrontEndOverLink() as front:
        yield front


def test_many_connections_at_once_answer_what_the_model_computes(front: FrontEndOverLink) -> None:
    def one(seed: int) -> None:
        x = np.random.default_rng(seed).random((1 + seed % 5, 16), dtype=np.float32)
        with closing(front.client()) as client:
            for _ in range(5):
                answer = infer(client, "mlp", {"INPUT0": x}).as_numpy("OUTPUT0")
                assert_close(answer, reference("mlp", x))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(16)))


def test_hooks_run_on_the_front_end_and_the_model_over_the_link(front: FrontEndOverLink) -> None:
    images = np.random.RandomState(7).randint(0, 256, (8, 224, 224), dtype=np.uint8)  # split: 6 + 2 rows
    with closing(front.client()) as client:
        grade = infer(client, "severity_grader", {"INPUT__0": images}).as_numpy("grade")
    logits = reference("severity_grader", images)
    assert_grades(grade, logits)


def test_a_large_inline_request_crosses_the_arena(front: FrontEndOverLink) -> None:
    images = np.random.default_rng(3).random((8, 224, 224, 3), dtype=np.float32)  # 4.8 MB
    with closing(front.client()) as client:
        mean = infer(client, "pool", {"IMAGE": images}).as_numpy("MEAN")
    assert_close(mean, images.mean(axis=(1, 2)), ulps=1024)


def test_a_missing_model_is_not_found_as_in_one_process(front: FrontEndOverLink) -> None:
    with closing(front.client()) as client:
        with pytest.raises(InferenceServerException) as raised:
            infer(client, "nope", {"INPUT0": np.ones((1, 16), np.float32)})
        assert raised.value.status() == "StatusCode.NOT_FOUND" and "nope" in raised.value.message()
        assert infer(client, "mlp", {"INPUT0": np.ones((1, 16), np.float32)}).as_numpy("OUTPUT0").shape == (
            1,
            4,
        )


def test_a_request_past_its_deadline_is_deadline_exceeded_and_the_front_end_serves_on() -> None:
    # The queue holds a lone row 2 s for a fuller batch; the client allows 0.3 s.
    with FrontEndOverLink(models={"mlp": ModelSettings(max_queue_delay_us=2_000_000)}) as front:
        with closing(front.client()) as client:
            with pytest.raises(InferenceServerException) as raised:
                infer(client, "mlp", {"INPUT0": np.ones((1, 16), np.float32)}, client_timeout=0.3)
            assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"
            x = np.ones((16, 16), np.float32)  # a full batch runs at once
            answer = infer(client, "mlp", {"INPUT0": x}, client_timeout=10).as_numpy("OUTPUT0")
            assert_close(answer, reference("mlp", x))
