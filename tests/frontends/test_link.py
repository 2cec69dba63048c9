"""The link's engine side, fed by a driver that writes requests into it directly (the frontend's
end, `FrontendLink`, over a real socketpair and a real /dev/shm arena), in front of a real
in-process engine: answers equal the model's, errors carry K=0's statuses, a withdrawn request
gives its slot back, and a closed link fails what waits on it."""

from __future__ import annotations

import asyncio
import os
import pickle
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from export_examples import reference
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from support.numerics import assert_close
from support.servers import make_config

from hloserve.config import ModelSettings
from hloserve.engine.buffer_pool import BufferPool
from hloserve.frontends.engine_link import EngineLink, EngineServices
from hloserve.frontends.frontend_link import FrontendLink
from hloserve.frontends.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    Counted,
    FrameReader,
    Hello,
    Ran,
    Returned,
    Run,
    TensorRef,
    frame,
    send_frames,
)
from hloserve.worker import Worker, serve

OUT_BYTES = 4 << 10


@asynccontextmanager
async def linked(**scheduler: Any) -> AsyncIterator[tuple[Worker, FrontendLink, BufferPool]]:
    config = make_config(http_port=-1, metrics_port=-1, scheduler=scheduler or None)
    async with serve(config) as worker, trio.open_nursery() as nursery:
        engine_end, frontend_end = trio.socket.socketpair()
        with BufferPool(1 << 20, 8, name="hloserve-test-link") as arena:
            await nursery.start(EngineLink(trio.SocketStream(engine_end), worker.models).run)
            link = FrontendLink(trio.SocketStream(frontend_end), arena)
            await nursery.start(link.run)
            yield worker, link, arena
            nursery.cancel_scope.cancel()


def run(test: Callable[[], Awaitable[None]]) -> None:
    trio.run(test)


async def frames(reader: FrameReader, count: int) -> list[tuple[int, Any]]:
    """The next `count` frames, however many each read completes."""
    received: list[tuple[int, Any]] = []
    while len(received) < count:
        batch = await reader.receive()
        assert batch, f"the stream ended after {len(received)} of {count} frames"
        received += batch
    assert len(received) == count, received
    return received


def test_concurrent_requests_answer_what_the_model_computes() -> None:
    async def test() -> None:
        async with linked() as (_, link, arena):
            rng = np.random.default_rng(0)
            xs = [rng.random((rows, 16), dtype=np.float32) for rows in (1, 2, 3, 5, 8, 2, 1, 4)]
            answers: list[np.ndarray | None] = [None] * len(xs)

            async def one(i: int) -> None:
                (answers[i],) = await link.infer("mlp", [xs[i]], len(xs[i]), [0], 10.0, OUT_BYTES)

            async with trio.open_nursery() as requests:
                for i in range(len(xs)):
                    requests.start_soon(one, i)
            for x, answer in zip(xs, answers, strict=True):
                assert_close(answer, reference("mlp", x))
            assert arena.statistics().free_slots == arena.n_slots  # every slot came back

    run(test)


def test_an_output_that_does_not_fit_travels_inline() -> None:
    async def test() -> None:
        async with linked() as (_, link, _arena):
            x = np.ones((3, 16), np.float32)
            (answer,) = await link.infer("mlp", [x], 3, [0], None, 8)
            assert_close(answer, reference("mlp", x))

    run(test)


@pytest.mark.parametrize(
    ("model", "status", "says"),
    [("nope", Status.NOT_FOUND, "nope"), ("mlp", Status.DEADLINE_EXCEEDED, "mlp")],
)
def test_errors_carry_the_single_process_status(model: str, status: Status, says: str) -> None:
    async def test() -> None:
        async with linked() as (_, link, arena):
            with pytest.raises(GRPCError) as raised:
                await link.infer(model, [np.ones((2, 16), np.float32)], 2, [0], -1.0, OUT_BYTES)
            assert raised.value.status == status and says in (raised.value.message or "")
            (answer,) = await link.infer("mlp", [np.ones((1, 16), np.float32)], 1, [0], None, OUT_BYTES)
            assert answer.shape == (1, 4)
            assert arena.statistics().free_slots == arena.n_slots

    run(test)


def test_a_cancelled_request_is_withdrawn_and_its_slot_comes_back() -> None:
    async def test() -> None:
        # The queue holds a lone request half a second for a fuller batch: cancelled meanwhile.
        async with linked(models={"mlp": ModelSettings(max_queue_delay_us=500_000)}) as (worker, link, arena):
            x = np.ones((2, 16), np.float32)
            with trio.move_on_after(0.1) as scope:
                await link.infer("mlp", [x], 2, [0], None, OUT_BYTES)
            assert scope.cancelled_caught
            assert arena.statistics().free_slots == arena.n_slots - 1  # held while the engine may read it
            with trio.fail_after(10):
                while arena.statistics().free_slots != arena.n_slots:
                    await trio.sleep(0.01)
            assert worker.statistics["mlp"].drops["cancelled"] == 1
            (answer,) = await link.infer("mlp", [x], 2, [0], None, OUT_BYTES)
            assert_close(answer, reference("mlp", x))

    run(test)


def test_an_answer_that_comes_after_its_future_was_cancelled_gives_the_slot_back() -> None:
    """A gRPC client that cancels: grpclib cancels the handler, which cancels the future it awaits
    at once but only runs its `leave` on a later turn of the asyncio loop. An answer read in
    between found a done future and no `left` mark, and kept its slot for ever: a soak's
    frontend leaked ~250 of its 256 slots in 50 minutes of cancelled calls, then made every
    request wait for room until its deadline."""

    loop = asyncio.new_event_loop()  # for its futures only, never run: the handler's late turn

    async def test() -> None:
        async with linked() as (_, link, arena):
            x = np.ones((2, 16), np.float32)
            for _ in range(arena.n_slots + 1):  # more than the arena holds: none may stay
                future: asyncio.Future[list[np.ndarray]] = loop.create_future()
                ident = link.submit("mlp", [x], 2, [0], None, OUT_BYTES, future)
                assert ident is not None, "the arena had no room: an earlier slot was kept"
                future.cancel()  # the client left; its handler has not yet called leave
                with trio.fail_after(10):
                    while arena.statistics().free_slots != arena.n_slots:
                        await trio.sleep(0.005)  # the engine answers; the slot comes back
                link.leave(ident)  # the handler's late turn: nothing left to withdraw
                assert arena.statistics().free_slots == arena.n_slots
            (answer,) = await link.infer("mlp", [x], 2, [0], None, OUT_BYTES)
            assert_close(answer, reference("mlp", x))

    try:
        run(test)
    finally:
        loop.close()


def test_an_engine_that_goes_away_fails_waiting_requests_as_unavailable() -> None:
    async def test() -> None:
        engine_end, frontend_end = trio.socket.socketpair()
        engine = trio.SocketStream(engine_end)
        with BufferPool(1 << 16, 2, name="hloserve-test-link") as arena:
            link = FrontendLink(trio.SocketStream(frontend_end), arena)
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)

                async def engine_reads_then_dies() -> None:
                    received = await frames(FrameReader(engine), 2)
                    assert [type(message) for _, message in received] == [Hello, Run]
                    await engine.aclose()

                nursery.start_soon(engine_reads_then_dies)
                with pytest.raises(GRPCError) as raised:
                    await link.infer("mlp", [np.ones((1, 16), np.float32)], 1, [0], None, OUT_BYTES)
                assert raised.value.status == Status.UNAVAILABLE
                assert "engine closed the link" in (raised.value.message or "")
            assert arena.statistics().free_slots == arena.n_slots

    run(test)


def test_frames_cut_anywhere_arrive_whole_and_in_order() -> None:
    """Frames written a few bytes at a time, one of them larger than a read, come out whole."""
    sent = [Hello("/a", 1), Returned(b"x" * (200 << 10)), Counted([("mlp", "OK", 0.5)]), Hello("/b", 2)]
    wire = b"".join(frame(i, m) for i, m in enumerate(sent, 1))

    async def test() -> None:
        a, b = trio.socket.socketpair()
        async with trio.SocketStream(a) as sender, trio.SocketStream(b) as receiver:

            async def dribble() -> None:
                for start in range(0, 63, 3):  # the first frames a few bytes at a time, then the rest
                    await sender.send_all(wire[start : start + 3])
                    await trio.sleep(0.001)
                await sender.send_all(wire[63:])
                await sender.aclose()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(dribble)
                reader = FrameReader(receiver)
                received = await frames(reader, len(sent))
                assert received == list(enumerate(sent, 1))
                assert await reader.receive() is None  # the end of the stream

    run(test)


def test_a_write_larger_than_the_socket_takes_arrives_whole() -> None:
    """`send_frames` writes what the socket takes at once and the rest as the reader drains it."""
    data = frame(1, Returned(os.urandom(8 << 20)))

    async def test() -> None:
        a, b = trio.socket.socketpair()
        async with trio.SocketStream(a) as sender, trio.SocketStream(b) as receiver:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_frames, sender, data)
                (received,) = await frames(FrameReader(receiver), 1)
            assert received == (1, Returned(pickle.loads(data[HEADER.size :]).value))

    run(test)


def test_a_reader_always_fed_lets_other_tasks_run() -> None:
    """Frames waiting at every read never starve the reader's neighbours."""
    forty = b"".join(frame(i, Counted([])) for i in range(40))

    async def test() -> None:
        a, b = trio.socket.socketpair()
        ticks = 0
        async with trio.SocketStream(a) as sender, trio.SocketStream(b) as receiver:
            reader = FrameReader(receiver)

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await trio.lowlevel.checkpoint()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(tick)
                for _ in range(50):  # the socket holds frames at every read
                    await send_frames(sender, forty)
                    assert await reader.receive()
                nursery.cancel_scope.cancel()
        # One pass per read; trio's random order within a pass moves the count by one or two.
        # Without the reader's checkpoint it stays at 0 or 1.
        assert ticks >= 40

    run(test)


def test_frames_are_bounded() -> None:
    async def test() -> None:
        a, b = trio.socket.socketpair()
        async with trio.SocketStream(a) as sender, trio.SocketStream(b) as receiver:
            await sender.send_all(HEADER.pack(MAX_FRAME_BYTES + 1, 7))
            with pytest.raises(ValueError, match="exceeds"):
                await FrameReader(receiver).receive()

    run(test)


def test_each_message_of_a_request_arrives_as_it_was_sent() -> None:
    """`Run`, `Ran` and `Counted` travel as plain tuples: what the reader gives back is equal,
    an inline output included, with frames written back to back in one write."""
    sent = [
        Run("mlp", [TensorRef(64, "<f4", (2, 16)), TensorRef(256, "|u1", (3,))], 2, [0, 1], None, (512, 128)),
        Ran([(512, "<f4", (2, 4)), np.arange(6, dtype=np.int64).reshape(2, 3)]),
        Counted([("mlp", "OK", 0.001), ("pool", "INVALID_ARGUMENT", 0.5)]),
        Hello("/hloserve-test", 1 << 20),
    ]

    async def test() -> None:
        a, b = trio.socket.socketpair()
        async with trio.SocketStream(a) as sender, trio.SocketStream(b) as receiver:
            await sender.send_all(b"".join(frame(i, m) for i, m in enumerate(sent, 1)))
            received_all = await frames(FrameReader(receiver), len(sent))
            for ident, (received, message) in enumerate(zip(received_all, sent, strict=True), 1):
                assert received[0] == ident
                assert type(received[1]) is type(message)
                if isinstance(message, Ran):
                    ref, inline = received[1].outputs
                    assert ref == message.outputs[0] and TensorRef(*ref).nbytes == 32
                    np.testing.assert_array_equal(inline, message.outputs[1])
                else:
                    assert received[1] == message

    run(test)


def test_counts_reach_the_engine_before_a_call_sent_after_them() -> None:
    """A frontend's counts go with its next write, not a frame each; a call sent after them (a
    ModelStatistics) finds every one of them counted."""
    counted: list[tuple[str, str, float]] = []

    async def seen(_: object) -> int:
        return len(counted)

    async def test() -> None:
        import trio_asyncio

        config = make_config(http_port=-1, metrics_port=-1)
        services = EngineServices(lambda *call: counted.append(call), {"seen": seen})
        async with serve(config) as worker, trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            engine_end, frontend_end = trio.socket.socketpair()
            with BufferPool(1 << 16, 2, name="hloserve-test-link") as arena:
                await nursery.start(EngineLink(trio.SocketStream(engine_end), worker.models, services).run)
                link = FrontendLink(trio.SocketStream(frontend_end), arena)
                await nursery.start(link.run)
                for i in range(5):
                    link.count("mlp", "OK" if i % 2 else "UNAVAILABLE", i / 10)
                assert await link.call("seen", None) == 5
                assert counted == [("mlp", "OK" if i % 2 else "UNAVAILABLE", i / 10) for i in range(5)]
                link.count("mlp", "OK", 1.0)
                assert await link.call("seen", None) == 6
                nursery.cancel_scope.cancel()

    run(test)


def test_no_arena_is_left_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    test_concurrent_requests_answer_what_the_model_computes()
    left = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("hloserve-test-link")}
    assert not left, f"arenas left behind: {sorted(left)}"
    assert Path("/dev/shm").is_dir()
