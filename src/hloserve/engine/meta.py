"""Meta models: a model.py `run(inputs, call)` that answers a request by calling other models.

Data-dependent logic between models (a detector's boxes deciding whether a classifier runs)
does not fit one static graph, so a meta bundle holds plain Python instead of an executable.
`run` executes in a worker thread, on the request's own behalf; each `call(model, inputs)`
goes through that model's hooks and queue like any request, except that it is *committed*: it
goes ahead of the queue and of the dispatcher's discipline, so a meta request already running
finishes before new work starts, and it is never dropped for laxity. Upstream's rules apply: a
meta calls only the models in its `meta.calls`, never another meta; a gate bounds the metas
running at once (those that call nothing bypass it); the meta's deadline bounds the gate, each
sub-call and `call.scratch`; `call.scratch` carves buffers from a staging pool once per request.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast, overload

import numpy as np
import trio
from numpy.typing import DTypeLike

from hloserve.actors.messages import Infer
from hloserve.engine.buffer_pool import BufferPool, PoolAcquireTimeout, PoolSlot
from hloserve.engine.pipeline import Route, arrange, client_outputs, named
from hloserve.engine.policy import PolicyParams, learn_cost
from hloserve.engine.statistics import Statistics
from hloserve.errors import DeadlineExceeded, HloserveError, HookFailed, ModelNotFound, ModelNotReady
from hloserve.models.manifest import Manifest
from hloserve.models.model_py import MetaRun, NamedTensor

if TYPE_CHECKING:
    from hloserve.engine.model_table import ModelEntry

__all__ = ["Call", "MetaModels"]

Shape = Sequence[int] | int
"""A scratch buffer's shape: its dimensions, or one length."""


def _trio_time(deadline: float | None) -> float:
    """A `time.monotonic()` deadline on trio's clock."""
    return math.inf if deadline is None else trio.current_time() + (deadline - time.monotonic())


class Call:
    """The `call` a meta model's `run` receives: `call(model, inputs)` and `call.scratch(...)`."""

    def __init__(
        self,
        meta: str,
        calls: Sequence[str],
        models: Mapping[str, ModelEntry],
        deadline: float | None,
        pool: BufferPool | None,
    ) -> None:
        self._meta = meta
        self._calls = frozenset(calls)
        self._models = models
        self._deadline = deadline
        self._pool = pool
        self._token = trio.lowlevel.current_trio_token()
        self.slot: PoolSlot | None = None
        """The scratch slots this request holds (released when `run` returns)."""
        self._scratched = False
        self.seconds = 0.0
        """Wall time spent inside calls, queueing and hooks included."""

    def _remaining(self) -> float | None:
        if self._deadline is None:
            return None
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(self._meta, -remaining)
        return remaining

    def __call__(
        self, model: str, inputs: Sequence[NamedTensor], requested_outputs: Sequence[str] = ()
    ) -> list[NamedTensor]:
        """Run `model` on `inputs` (its client-facing tensors) and return its outputs, all of
        them or the `requested_outputs`; its hooks run here, in this thread."""
        if model not in self._calls:
            raise ValueError(f"called undeclared model {model!r}; add it to meta.calls of {self._meta!r}")
        self._remaining()
        started = time.perf_counter()
        try:
            return self._call(model, inputs, requested_outputs)
        finally:
            self.seconds += time.perf_counter() - started

    def _call(self, model: str, inputs: Sequence[NamedTensor], requested: Sequence[str]) -> list[NamedTensor]:
        entry = self._models.get(model)
        if entry is None:
            raise ModelNotFound(model, f"called by meta model {self._meta!r}")
        if not entry.ready or entry.queue is None or entry.bundle is None:
            raise ModelNotReady(model, entry.error or "not loaded")
        manifest = entry.bundle.manifest
        outputs = {spec.name: i for i, spec in enumerate(manifest.outputs)}
        unknown = [name for name in requested if name not in outputs]
        if unknown:
            raise ValueError(f"call({model!r}): no output(s) {unknown}; it has {sorted(outputs)}")
        selected = [outputs[name] for name in requested] or list(range(len(outputs)))
        try:
            arrays, extent = arrange(list(inputs), manifest.inputs)
        except ValueError as e:
            raise ValueError(f"call({model!r}): {e}") from None
        rows = 1 if extent is None else extent
        route = Route(model, manifest, entry.hooks, selected)
        arrays, executable_rows = route.inward(arrays, rows)
        entry.check_rows(executable_rows, f"a call from meta model {self._meta!r}")
        reply: concurrent.futures.Future[list[np.ndarray]] = concurrent.futures.Future()
        request = Infer(
            model,
            arrays,
            executable_rows,
            route.executable_outputs,
            reply,
            time.monotonic(),
            self._deadline,
            committed=True,
        )
        trio.from_thread.run_sync(entry.queue.submit_nowait, request, trio_token=self._token)
        try:
            result = reply.result(timeout=self._remaining())
        except concurrent.futures.TimeoutError:
            trio.from_thread.run_sync(entry.queue.withdraw_nowait, request, trio_token=self._token)
            raise DeadlineExceeded(model, 0.0) from None
        return named([manifest.outputs[i] for i in selected], route.outward(result, rows))

    @overload
    def scratch(self, shape: Shape, dtype: DTypeLike) -> np.ndarray: ...
    @overload
    def scratch(self, shape: Sequence[tuple[Shape, DTypeLike]]) -> list[np.ndarray]: ...
    def scratch(
        self, shape: Shape | Sequence[tuple[Shape, DTypeLike]], dtype: DTypeLike | None = None
    ) -> np.ndarray | list[np.ndarray]:
        """Buffers for this request, carved at once from the staging pool and released when
        `run` returns: `scratch(shape, dtype)` gives one array, `scratch([(shape, dtype), ...])`
        a list. Once per request; plain arrays when the server has no pool."""
        if self._scratched:
            raise RuntimeError("call.scratch may be used once per request; ask for every buffer in one call")
        self._scratched = True
        single = dtype is not None
        specs: list[tuple[Shape, DTypeLike]] = (
            [(cast("Shape", shape), dtype)]
            if dtype is not None
            else list(cast("Sequence[tuple[Shape, DTypeLike]]", shape))
        )
        if self._pool is None:
            arrays = [np.empty(s, dtype=np.dtype(d)) for s, d in specs]
        else:
            pool = self._pool
            span = pool.span_for(specs)
            try:
                self.slot = trio.from_thread.run(
                    pool.acquire_slot, span, _trio_time(self._deadline), trio_token=self._token
                )
            except PoolAcquireTimeout:
                raise DeadlineExceeded(self._meta, 0.0) from None
            arrays = pool.scratch(self.slot, specs)
        return arrays[0] if single else arrays

    def release(self) -> None:
        """Give back the scratch slot, once `run` has returned (on the loop)."""
        if self.slot is not None:
            assert self._pool is not None
            self._pool.release(self.slot)
            self.slot = None


class _Hold:
    """What one meta request's `run` holds while its thread lives: a thread of
    `server.meta_threads`, a place in the gate (if it calls models) and its scratch slot.

    Passed to `trio.to_thread.run_sync` as its limiter, so trio lets go of it when the thread
    ends, not when the client does: a cancelled request answers at once and its `run`, which
    Python cannot stop, finishes in a thread that still counts (and keeps its scratch, which it
    may still be writing)."""

    def __init__(self, threads: trio.CapacityLimiter, gate: trio.CapacityLimiter | None, call: Call) -> None:
        self._threads = threads
        self._gate = gate
        self._call = call

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        if self._gate is not None:
            await self._gate.acquire_on_behalf_of(borrower)
        try:
            await self._threads.acquire_on_behalf_of(borrower)
        except BaseException:
            if self._gate is not None:
                self._gate.release_on_behalf_of(borrower)
            raise

    def release_on_behalf_of(self, borrower: object) -> None:
        self._threads.release_on_behalf_of(borrower)
        if self._gate is not None:
            self._gate.release_on_behalf_of(borrower)
        self._call.release()


class MetaModels:
    """Runs the requests of every meta model of a worker (on the loop; `run` in threads)."""

    def __init__(
        self,
        models: Mapping[str, ModelEntry],
        concurrency: int,
        threads: int,
        pool: BufferPool | None,
        statistics: Statistics,
        params: PolicyParams,
    ) -> None:
        self._models = models
        self._gate = trio.CapacityLimiter(concurrency)
        self._threads = trio.CapacityLimiter(threads)
        self._pool = pool
        self._statistics = statistics
        self._params = params

    async def infer(
        self, entry: ModelEntry, inputs: list[np.ndarray], rows: int, deadline: float | None
    ) -> list[np.ndarray]:
        """Answer one request of the meta model `entry`: its client outputs, in manifest order.
        Its deadline bounds the wait for the gate and a thread, and the run itself."""
        assert entry.bundle is not None and entry.meta_run is not None
        manifest = entry.bundle.manifest
        call = Call(entry.name, manifest.calls, self._models, deadline, self._pool)
        hold = _Hold(self._threads, self._gate if manifest.calls else None, call)
        with trio.move_on_at(_trio_time(deadline)) as waiting:
            outputs = await trio.to_thread.run_sync(
                _run,
                entry.name,
                entry.meta_run,
                manifest,
                call,
                inputs,
                rows,
                limiter=cast(trio.CapacityLimiter, hold),  # trio takes any object with its two methods
                abandon_on_cancel=True,
            )
        if waiting.cancelled_caught:
            assert deadline is not None
            raise DeadlineExceeded(entry.name, time.monotonic() - deadline)
        stats = self._statistics[entry.name]
        stats.record_execution(1, rows, 0.0, call.seconds, 0.0)
        learn_cost(stats.cost, 0, call.seconds, self._params)  # as upstream: a meta's cost is size 0
        return outputs

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def _run(
    meta: str, run: MetaRun, manifest: Manifest, call: Call, inputs: list[np.ndarray], rows: int
) -> list[np.ndarray]:
    """`run` on the client's inputs, its answer checked against client_outputs (in a thread)."""
    try:
        returned = run(named(manifest.inputs, inputs), call)
    except HloserveError:
        raise  # a sub-call's own status (deadline, not found, overload) is the request's
    except Exception as e:
        raise HookFailed(meta, "run", f"{type(e).__name__}: {e}") from e
    return client_outputs(meta, "run", manifest, returned, rows)
