"""The staging pool: contiguous runs, FIFO waiters, deadlines, double release, zero-copy scratch."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import trio
import trio.testing

from hloserve.engine.buffer_pool import BufferPool, PoolAcquireTimeout


def test_concurrent_acquirers_get_disjoint_contiguous_runs() -> None:
    async def main() -> None:
        with BufferPool(8 * 1024, n_slots=8, use_shm=False) as pool:
            owner = [-1] * 8
            rng = random.Random(0)

            async def user(i: int) -> None:
                for _ in range(5):
                    slot = await pool.acquire_slot(rng.randint(1, 3))
                    run = range(slot.index, slot.index + slot.span)
                    assert all(owner[j] == -1 for j in run), "overlapping runs"
                    for j in run:
                        owner[j] = i
                    assert slot.offset == slot.index * pool.slot_bytes and slot.nbytes == slot.span * 1024
                    await trio.sleep(rng.random() / 1000)
                    for j in run:
                        owner[j] = -1
                    pool.release(slot)

            async with trio.open_nursery() as nursery:
                for i in range(50):
                    nursery.start_soon(user, i)
            assert pool.statistics().free_slots == 8 and pool.statistics().acquired == 0

    trio.run(main)


def test_waiters_are_served_in_arrival_order() -> None:
    async def main() -> None:
        pool = BufferPool(4 * 64, n_slots=4, use_shm=False)
        held = [await pool.acquire_slot(1) for _ in range(4)]
        served: list[str] = []

        async def want(name: str, span: int) -> None:
            slot = await pool.acquire_slot(span)
            served.append(name)
            pool.release(slot)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(want, "big", 3)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(want, "small", 1)
            await trio.testing.wait_all_tasks_blocked()
            pool.release(held[0])  # one slot free: "small" fits, but "big" came first
            await trio.testing.wait_all_tasks_blocked()
            assert served == [] and pool.statistics().waiting == 2
            pool.release(held[1])
            pool.release(held[2])
        assert served == ["big", "small"]

    trio.run(main)


def test_deadline_raises_and_leaves_the_line() -> None:
    async def main() -> None:
        pool = BufferPool(2 * 64, n_slots=2, use_shm=False)
        first = await pool.acquire_slot(2)
        with pytest.raises(PoolAcquireTimeout, match="no 1 contiguous free slot"):
            await pool.acquire_slot(1, deadline=trio.current_time() + 0.5)
        assert pool.statistics().waiting == 0
        pool.release(first)
        assert (await pool.acquire_slot(2)).span == 2

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_cancelled_waiter_leaves_the_line() -> None:
    async def main() -> None:
        pool = BufferPool(64, n_slots=1, use_shm=False)
        first = await pool.acquire_slot()
        with trio.move_on_after(0.1):
            await pool.acquire_slot()
        assert pool.statistics().waiting == 0
        pool.release(first)
        pool.release(await pool.acquire_slot())

    trio.run(main)


def test_oversized_span_and_double_release() -> None:
    async def main() -> None:
        pool = BufferPool(4 * 64, n_slots=4, use_shm=False)
        with pytest.raises(ValueError, match="span 5 must be between 1 and the pool's 4 slots"):
            await pool.acquire_slot(5)
        slot = await pool.acquire_slot(2)
        pool.release(slot)
        with pytest.raises(RuntimeError, match="released twice"):
            pool.release(slot)

    trio.run(main)


def test_scratch_arrays_alias_the_shared_memory() -> None:
    async def main() -> None:
        with BufferPool(4 * 4096, n_slots=4) as pool:
            assert pool.key is not None and os.path.exists(f"/dev/shm{pool.key}")
            assert oct(os.stat(f"/dev/shm{pool.key}").st_mode & 0o777) == "0o600"
            slot = await pool.acquire_slot(2)
            a, b = pool.scratch(slot, [((2, 3), np.float32), (5, np.int64)])
            assert a.shape == (2, 3) and b.shape == (5,) and b.dtype == np.int64
            assert pool.array_offset(a) == slot.offset and pool.array_offset(b) % 64 == 0
            assert pool.array_offset(b) >= pool.array_offset(a) + a.nbytes
            a[:] = 1.5
            b[:] = 7
            with open(f"/dev/shm{pool.key}", "rb") as f:  # what the server would map
                f.seek(pool.array_offset(b))
                np.testing.assert_array_equal(np.frombuffer(f.read(40), np.int64), [7] * 5)
            written = pool.memory()[slot.offset : slot.offset + a.nbytes]
            np.testing.assert_array_equal(np.frombuffer(written, np.float32), [1.5] * 6)
            with pytest.raises(ValueError, match="need more than the slot's 8192 bytes"):
                pool.scratch(slot, [((3000,), np.float32)])
            key = pool.key
        assert not os.path.exists(f"/dev/shm{key}")

    trio.run(main)


def test_span_for_is_enough_slots_for_scratch_to_carve() -> None:
    async def main() -> None:
        with BufferPool(1024, n_slots=8, use_shm=False) as pool:  # 128-byte slots
            assert pool.span_for([((10,), np.float32)]) == 1  # 40 bytes + alignment
            specs = [((100,), np.float32), ((3, 5), np.int64)]  # 400 + 120 bytes, each aligned
            span = pool.span_for(specs)
            assert span == 6  # (400 + 64 + 120 + 64) / 128, rounded up: each array's pad counted
            slot = await pool.acquire_slot(span)
            a, b = pool.scratch(slot, specs)
            assert a.shape == (100,) and b.shape == (3, 5)
            assert pool.array_offset(b) + b.nbytes <= slot.offset + slot.nbytes

    trio.run(main)
