"""The one module that calls JAX: compile, place, run, read back, free, measure.

`jax.extend` and the jaxlib classes used here are semi-public, so every use of them is kept in
this file, behind plain functions, and covered by its own test. Importing this module checks
that the installed jax has every one of them (`SEMI_PUBLIC`), raising `JaxMismatch` naming the
versions and what is missing, then turns on x64 (so int64 tensors are not narrowed to int32)
before any array is made.

Calls that block (compile, wait for a result) release the GIL; callers run them in a worker
thread so the trio loop never stops.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # XLA's C++ logs duplicate our own errors

import jax
import jax.extend.backend
import jax.extend.mlir
import jax.numpy as jnp
import jaxlib
import jaxlib.version
import numpy as np
from jaxlib import xla_client
from jaxlib.mlir import ir

from hloserve import kernels
from hloserve._transport.requirements import missing
from hloserve.dtypes import by_mlir
from hloserve.models.aligned import host_buffer
from hloserve.models.signature import Signature, TensorType

SEMI_PUBLIC = (
    "jax.extend.backend.get_backend",
    "jax.extend.backend.get_compile_options",
    "jaxlib.xla_client.CompileOptions.env_option_overrides",
    "jax.extend.mlir.deserialize_portable_artifact",
    "jax._src.interpreters.mlir.make_ir_context",
    "jax.core.ShapedArray",
    "jaxlib.xla_client.DeviceList",
    "jaxlib.xla_client.batched_device_put",
    "jaxlib.xla_client.Client.compile_and_load",
    "jaxlib.xla_client.Client.deserialize_executable",
    "jaxlib.xla_client.LoadedExecutable.execute_sharded",
    "jaxlib.xla_client.LoadedExecutable.get_compiled_memory_stats",
    "jaxlib.xla_client.LoadedExecutable.serialize",
    "jaxlib._jax.ExecuteResults.disassemble_into_single_device_arrays",
    "jax.Device.memory",
)
"""The names below jax's public API that this module calls: they can move between releases."""


class JaxMismatch(RuntimeError):
    """The installed jax lacks names this module calls; raised at import, before serving."""


def check_jax(names: tuple[str, ...] = SEMI_PUBLIC) -> None:
    """Raise `JaxMismatch` naming the jax and jaxlib versions and every name in `names` missing."""
    absent = missing(names)
    if absent:
        raise JaxMismatch(
            f"jax {jax.__version__} (jaxlib {jaxlib.version.__version__}) lacks {', '.join(absent)}, which "
            "hloserve's XLA adapter calls: install a jax that hloserve supports (see its README) "
            "or update hloserve.models._xla for this one"
        )


check_jax()
_jax_mlir: Any = importlib.import_module("jax._src.interpreters.mlir")

jax.config.update("jax_enable_x64", True)
# On CPU, run each execution in the calling thread rather than handing it to XLA's own: a tiny
# model then takes ~23 us instead of ~73 us (two thread wake-ups), and the dispatcher decides
# by cost what runs inline and what goes to a worker thread. Takes effect if set before the CPU
# backend is made (an embedding process that made it earlier keeps asynchronous dispatch).
jax.config.update("jax_cpu_enable_async_dispatch", False)

__all__ = [
    "NATIVE_KERNELS",
    "DeviceArray",
    "Executable",
    "JaxMismatch",
    "Signature",
    "TensorType",
    "check_jax",
    "compile_module",
    "compiled_memory",
    "deserialize_executable",
    "device",
    "free",
    "host_buffer",
    "jax",
    "jnp",
    "main_signature",
    "memory_stats",
    "native_kernels_apply",
    "pin",
    "pinned_host_available",
    "pinning_pays",
    "put",
    "put_all",
    "run",
    "runtime_identity",
    "serialize_executable",
    "to_numpy",
    "warm_up",
    "with_native_kernels",
]

DeviceArray = jax.Array
Executable = Any  # jaxlib LoadedExecutable; not a public type
_DONATION_ATTRS = ("tf.aliasing_output", "jax.buffer_donor")


@functools.cache
def device() -> Any:
    """The device hloserve executes on: the first GPU if there is one, else the CPU."""
    return jax.devices()[0]


def warm_up() -> None:
    """Initialise what raw modules rely on but never set up themselves.

    On CPU, modules with LAPACK custom calls segfault at execute unless jax has registered its
    LAPACK kernels, which lowering one linalg op does.
    """
    if device().platform == "cpu":
        jax.jit(jnp.linalg.inv).lower(jax.ShapeDtypeStruct((2, 2), np.float32))


def _tensor_type(t: ir.Type) -> TensorType:
    ranked = ir.RankedTensorType(t)
    return TensorType(tuple(ranked.shape), by_mlir(str(ranked.element_type)))


def main_signature(source: str | bytes) -> Signature:
    """Parse the `main` function of StableHLO text or a portable artifact (bytecode).

    Raises ValueError when the module does not parse or has no `main`, KeyError for an element
    type hloserve has no dtype for.
    """
    with _jax_mlir.make_ir_context():
        try:
            module = _parse(source)
        except Exception as e:  # MLIR raises its own error types; flatten them
            raise ValueError(f"not a StableHLO module: {str(e).strip().splitlines()[0]}") from None
        for view in module.body.operations:
            op = view.operation
            if op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
                donated: list[int] = []
                if "arg_attrs" in op.attributes:
                    for i, attrs in enumerate(ir.ArrayAttr(op.attributes["arg_attrs"])):
                        d = ir.DictAttr(attrs)
                        if any(name in d for name in _DONATION_ATTRS):
                            donated.append(i)
                return Signature(
                    tuple(_tensor_type(t) for t in ftype.inputs),
                    tuple(_tensor_type(t) for t in ftype.results),
                    tuple(donated),
                )
        raise ValueError("module has no function named 'main'")


XlaOptionValue = str | bool | int | float
XlaOptions = Mapping[str, XlaOptionValue]
"""XLA's debug options for one compile (`xla_cpu_...: value`), over its defaults and XLA_FLAGS."""


NATIVE_KERNELS = kernels.OPTION
"""hloserve's own key among a bundle's XLA options: true calls the native kernels in place of the
composites that name them (`with_native_kernels`), where they are built; XLA never sees it. Off
by default: a kernel is an opaque call that ends XLA's fusions around it, so it wins on some
models and loses on others, and the exporter keeps it only where it measured a win."""


def _compile_options(options: XlaOptions) -> Any:
    compile_options = jax.extend.backend.get_compile_options(num_replicas=1, num_partitions=1)
    overrides = sorted((name, value) for name, value in options.items() if name != NATIVE_KERNELS)
    if overrides:
        compile_options.env_option_overrides = overrides
    return compile_options


def compile_platform() -> str:
    """The platform this machine compiles for, as bundles name it: `cpu` or `cuda`."""
    return "cpu" if device().platform == "cpu" else "cuda"


def _parse(source: str | bytes) -> ir.Module:
    """StableHLO text or a portable artifact as a module, in the current context."""
    if isinstance(source, bytes):
        module: ir.Module = jax.extend.mlir.deserialize_portable_artifact(source)
        return module
    return ir.Module.parse(source)


def _native_kernels() -> kernels.Kernels | None:
    """The native kernels where this process executes on CPU and they are built; else None."""
    return kernels.load() if device().platform == "cpu" else None


def native_kernels_apply(source: str | bytes) -> bool:
    """Whether `source` names a native kernel's composite and the kernels are built here (never
    built for a module that names none)."""
    text = source.decode("latin-1") if isinstance(source, bytes) else source  # its names verbatim
    return any(name in text for name in kernels.TARGETS) and _native_kernels() is not None


def with_native_kernels(source: str | bytes) -> str | bytes:
    """`source` with each composite that names a native kernel (`hloserve.kernels`) replaced by
    a call to it through XLA's FFI, its operands, results and attributes unchanged; `source`
    itself where there is none, or the kernels are off or not built."""
    if not native_kernels_apply(source):
        return source
    with _jax_mlir.make_ir_context(), ir.Location.unknown():
        module = _parse(source)
        composites: list[ir.Operation] = []

        def visit(op: ir.Operation) -> ir.WalkResult:
            if (
                op.name == "stablehlo.composite"
                and ir.StringAttr(op.attributes["name"]).value in kernels.TARGETS
            ):
                composites.append(op)
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        for op in composites:
            call = ir.Operation.create(
                "stablehlo.custom_call",
                results=[result.type for result in op.results],
                operands=list(op.operands),
                attributes={
                    "call_target_name": ir.StringAttr.get(ir.StringAttr(op.attributes["name"]).value),
                    "api_version": ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 4),
                    "backend_config": (  # a bundle's composite without any: the call says what is missing
                        op.attributes["composite_attributes"]
                        if "composite_attributes" in op.attributes
                        else ir.DictAttr.get({})
                    ),
                    "operand_layouts": _row_major(operand.type for operand in op.operands),
                    "result_layouts": _row_major(result.type for result in op.results),
                },
                loc=op.location,
                ip=ir.InsertionPoint(op),
            )
            for old, new in zip(op.results, call.results, strict=True):
                old.replace_all_uses_with(new)
            op.erase()
        return str(module)


def _row_major(types: Iterable[ir.Type]) -> ir.ArrayAttr:
    """The default (row-major) layout of each tensor type, as a custom call names them."""
    index = ir.IndexType.get()
    layouts = []
    for t in types:
        rank = ir.RankedTensorType(t).rank
        minor_to_major = [ir.IntegerAttr.get(index, d) for d in range(rank - 1, -1, -1)]
        layouts.append(
            ir.DenseIntElementsAttr.get(minor_to_major, type=ir.RankedTensorType.get([rank], index))
        )
    return ir.ArrayAttr.get(layouts)


def compile_module(source: str | bytes, options: XlaOptions | None = None) -> Executable:
    """Compile StableHLO text or a portable artifact for `device()`, with XLA `options` over the
    defaults (an unknown option or value raises), and native kernels where they apply
    (`with_native_kernels`) where `options` turn them on (`NATIVE_KERNELS`). Blocks; GIL
    released."""
    dev = device()
    options = options or {}
    if options.get(NATIVE_KERNELS, False):
        source = with_native_kernels(source)
    return jax.extend.backend.get_backend(dev.platform).compile_and_load(
        source, xla_client.DeviceList((dev,)), _compile_options(options)
    )


def serialize_executable(executable: Executable) -> bytes:
    """The compiled executable as bytes, to load again with `deserialize_executable`."""
    return bytes(executable.serialize())


def deserialize_executable(blob: bytes, options: XlaOptions | None = None) -> Executable:
    """An executable serialized by this jaxlib for this device kind, compiled with `options`
    (only ever load your own: deserializing can run arbitrary code). Raises on a corrupt or
    foreign blob."""
    dev = device()
    options = options or {}
    if options.get(NATIVE_KERNELS, False):
        _native_kernels()  # the FFI targets it may call, registered first
    return jax.extend.backend.get_backend(dev.platform).deserialize_executable(
        blob, xla_client.DeviceList((dev,)), _compile_options(options)
    )


def runtime_identity(options: XlaOptions | None = None) -> str:
    """What an executable compiled with `options` depends on: jaxlib's version, the platform, the
    device kind, XLA_FLAGS (they change the code XLA generates) where set, and the native kernels
    where `options` turn them on and they are built."""
    dev = device()
    flags = os.environ.get("XLA_FLAGS", "").strip()
    native = _native_kernels() if (options or {}).get(NATIVE_KERNELS, False) else None
    return (
        f"jaxlib {jaxlib.version.__version__}; {dev.platform}; {dev.device_kind}"
        + (f"; XLA_FLAGS {flags}" if flags else "")
        + (f"; kernels {native.digest}" if native else "")
    )


def compiled_memory(executable: Executable) -> dict[str, int]:
    """Scratch and argument bytes XLA planned for an executable."""
    stats = executable.get_compiled_memory_stats()
    return {
        "temp_bytes": int(stats.temp_size_in_bytes),
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
    }


@functools.cache
def _sharding(memory_kind: str | None = None) -> jax.sharding.Sharding:
    """The device's placement, in its own memory or in `memory_kind` (such as PINNED_HOST)."""
    sharding: jax.sharding.Sharding = jax.sharding.make_single_device_sharding(
        device(), memory_kind=memory_kind
    )
    return sharding


def put(array: np.ndarray) -> DeviceArray:
    """Copy a host array to the device (on CPU, 64-byte aligned arrays are aliased, not copied).

    Goes straight to jaxlib's `batched_device_put`: `jax.device_put` spends ~20 us in dispatch
    machinery per call, more than a tiny request's whole execution; this takes ~3 us.
    """
    dev = device()
    put: jax.Array = xla_client.batched_device_put(
        jax.core.ShapedArray(array.shape, array.dtype), _sharding(), [array], [dev]
    )
    return put


PINNED_HOST = "pinned_host"
"""JAX's memory kind for page-locked host memory, which a GPU copies from by DMA."""


@functools.cache
def pinned_host_available() -> bool:
    """Whether `device()` can address pinned host memory (GPUs, and the CPU backend from jax
    0.4.32 on)."""
    try:
        device().memory(PINNED_HOST)
    except Exception:  # JaxRuntimeError INVALID_ARGUMENT: no such memory kind on this device
        return False
    return True


def pinning_pays() -> bool:
    """Whether a copy from pinned host memory beats one from pageable memory: on an accelerator.
    On the CPU the device aliases a pageable array, and a pinned one costs a copy."""
    platform: str = device().platform
    return platform != "cpu"


def pin(arrays: Sequence[np.ndarray]) -> list[DeviceArray]:
    """Copies of host arrays in pinned (page-locked) host memory, from which `put_all` copies to
    the device at the bus's speed. Blocks until they are in place. Pinning is slow (about
    1-2 GB/s on a GPU machine): do it once, at start-up. Raises what the backend raises when it
    cannot (no pinned memory kind, the locked-memory limit, too little memory)."""
    pinned: list[DeviceArray] = jax.device_put(list(arrays), _sharding(PINNED_HOST))
    for array in pinned:
        array.block_until_ready()
    return pinned


def put_all(arrays: Sequence[np.ndarray | DeviceArray]) -> list[DeviceArray]:
    """Copy a model's host floor to the device: numpy arrays one by one through `put`; arrays
    in pinned host memory (`pin`) in one batched transfer (a DMA per array on a GPU)."""
    if arrays and not isinstance(arrays[0], np.ndarray):
        placed: list[DeviceArray] = jax.device_put(list(arrays), _sharding())
        return placed
    return [put(a) for a in arrays]  # type: ignore[arg-type]


def run(executable: Executable, args: Sequence[DeviceArray]) -> list[DeviceArray]:
    """Run one execution: on CPU it completes before returning; on a GPU it is launched and
    its results are ready when read."""
    results = executable.execute_sharded(list(args))
    return [per_device[0] for per_device in results.disassemble_into_single_device_arrays()]


def to_numpy(arrays: Sequence[DeviceArray]) -> list[np.ndarray]:
    """Wait for results and read them to host memory. Blocks; GIL released while waiting."""
    return [np.asarray(a) for a in arrays]


def free(arrays: Sequence[DeviceArray]) -> None:
    """Release device buffers now instead of at garbage collection."""
    for a in arrays:
        a.delete()


def memory_stats() -> dict[str, int] | None:
    """The device allocator's statistics, or None where the backend keeps none (CPU)."""
    stats = device().memory_stats()
    return None if stats is None else {k: int(v) for k, v in stats.items()}
