"""Write a server-loadable bundle from a JAX function, a Flax model or a traced PyTorch module.

`export_bundle(fn, params, inputs, directory)` traces `fn(params, *inputs)` (or a `flax.nnx`
module called on the inputs) once per batch size and writes ReactantServer.jl's format:
`model.b{N}.mlir` (StableHLO text, or a portable artifact) taking the inputs first and the
weights last, one `weights.safetensors` with `argument_order`, and `manifest.yaml` with
column-major letter shapes (batch letter `n` last). The traps of exporting through JAX
are handled here: x64 on so int64 stays int64, `keep_unused=True` so no
weight is pruned from the signature, no donation, weights cast to the module's argument types
and saved C-contiguous with mode 0644. A bundle is only as good as its last check, so it is then
loaded in a fresh process by the server's own loader and compared with the model
(`verify_bundle`). `hloserve.export.torch` feeds PyTorch modules through the same writer.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import structlog
import yaml

from hloserve import dtypes
from hloserve._version import __version__
from hloserve.export.tuning import tune as tune_module
from hloserve.export.verification import VerificationError, verify_bundle
from hloserve.models import _xla
from hloserve.models._scratch import DEFAULT_MAX_SCRATCH_RATIO, ScratchError, check_scratch, module_memory
from hloserve.models.bundle import WEIGHTS
from hloserve.models.executable_cache import ExecutableCache
from hloserve.models.names import MODEL_PY

__all__ = [
    "PRECISIONS",
    "InputSpec",
    "OutputSpec",
    "Precision",
    "ScratchError",
    "Traceable",
    "VerificationError",
    "export_bundle",
    "verify_bundle",
]
# VerificationError and verify_bundle live in hloserve.export.verification; exported here for callers.

jax = _xla.jax
jnp = jax.numpy
log = structlog.get_logger("hloserve.export")

_LETTERS = [c for c in string.ascii_lowercase if c not in "nb"]
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: dict[str, np.dtype] = {
    "fp32": np.dtype(np.float32),
    "bf16": dtypes.by_token("bf16").numpy,
    "fp16": np.dtype(np.float16),
}
"""`precision=` (`--precision`): the float type the weights are stored in and the graph computes
in. fp32 leaves the model as it is; bf16 and fp16 halve the weight bytes."""
UNBATCHED = 0
"""The batch size of a bundle without a batch axis (its one module, `model.mlir`)."""
_OLD_FILES = re.compile(rf"^(model(\.b[0-9]+)?\.mlir|{re.escape(WEIGHTS)})$")
_VALUE_DEPENDENT = (
    jax.errors.ConcretizationTypeError,  # includes TracerBoolConversionError (`if x > 0:`)
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One input: its name, its shape without the batch axis (row-major; its whole shape in a
    bundle exported with `batch_axis=False`), its dtype.

    Also describes `client_inputs` and `client_outputs`, where a size of -1 marks a variable axis.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any = np.float32
    """A numpy dtype (or anything `np.dtype` takes; ml_dtypes for bf16 and fp8), not a token."""
    letters: str | None = None
    """Manifest letters for the non-batch axes in row-major order; generated when None."""
    format: str | None = None
    """An image input's layout, `NHWC` or `NCHW` (ModelConfig reports it, as Triton does)."""


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One output: its name and optional letters (row-major, no batch); shape and dtype are traced."""

    name: str
    letters: str | None = None


@dataclass(frozen=True, slots=True)
class Traceable:
    """A model as the writer takes it, whatever framework it came from (`hloserve.export.torch`)."""

    framework: str
    """Provenance `source_framework`: `jax`, `flax.nnx`, `torch`."""
    weight_names: Sequence[str]
    weights: Sequence[np.ndarray]
    function_for: Callable[[int], Callable[..., Any]]
    """Batch size → a JAX-traceable function of (inputs..., weights...) returning an array or a tuple."""
    reference: Callable[..., Any]
    """The original model on host inputs (with their batch axis): what verification compares with."""
    versions: Mapping[str, Any] = field(default_factory=dict)
    """Framework versions and how the weights were prepared, for the provenance."""


def _letters(given: str | None, rank: int, where: str) -> str:
    letters = given if given is not None else "".join(_LETTERS[:rank])
    if len(letters) != rank or len(set(letters)) != rank or set(letters) & set("nb"):
        raise ValueError(f"{where}: letters {letters!r} must be {rank} distinct letters other than n and b")
    return letters


def _tensor(
    name: str, dtype: Any, shape: tuple[int, ...], letters: str, batch_axis: bool = True
) -> dict[str, Any]:
    """A manifest tensor: letters reversed to column-major, batch axis `n` last (if it has one)."""
    return {
        "name": name,
        "dtype": dtypes.by_numpy(np.dtype(dtype)).token,
        "shape": letters[::-1] + ("n" if batch_axis else ""),
        "dims": dict(zip(letters, shape, strict=True)),
    }


def _spec_tensor(spec: InputSpec, batch_axis: bool = True) -> dict[str, Any]:
    letters = _letters(spec.letters, len(spec.shape), spec.name)
    tensor = _tensor(spec.name, spec.dtype, spec.shape, letters, batch_axis)
    return tensor if spec.format is None else {**tensor, "format": spec.format}


def _weight_name(path: Sequence[Any]) -> str:
    parts = []
    for key in path:
        part = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        parts.append(str(part))
    return ".".join(parts)


def _as_tuple(result: Any) -> tuple[Any, ...]:
    return tuple(result) if isinstance(result, tuple | list) else (result,)


# --- front ends ---------------------------------------------------------------------------------


def _from_jax(fn: Callable[..., Any], params: Any, n_inputs: int) -> Traceable:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)

    def flat(*args: Any) -> Any:
        return fn(jax.tree_util.tree_unflatten(treedef, args[n_inputs:]), *args[:n_inputs])

    def reference(*arrays: np.ndarray) -> Any:
        return fn(jax.tree_util.tree_map(jnp.asarray, params), *map(jnp.asarray, arrays))

    names = [_weight_name(path) for path, _ in leaves]
    weights = [np.require(np.asarray(leaf), requirements="C") for _, leaf in leaves]
    return Traceable("jax", names, weights, lambda size: flat, reference)


def _is_nnx_module(obj: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")  # an nnx module exists only once flax.nnx is imported
    return nnx is not None and isinstance(obj, nnx.Module)


def _from_nnx(model: Any, n_inputs: int) -> Traceable:
    """A flax.nnx module in eval mode (a copy: the caller's keeps its mode).

    Its RNG state (dropout keys and counters) is baked into the module as constants, not made
    weights: a PRNG key has no safetensors dtype, and a served model draws no random numbers.
    """
    import flax
    from flax import nnx

    model = nnx.clone(model)
    model.eval()
    graphdef, *split = nnx.split(model, nnx.RngState, ...)
    rng_state, state = split
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)

    def flat(*args: Any) -> Any:
        weights = jax.tree_util.tree_unflatten(treedef, args[n_inputs:])
        return nnx.merge(graphdef, rng_state, weights)(*args[:n_inputs])

    def reference(*arrays: np.ndarray) -> Any:
        return model(*map(jnp.asarray, arrays))

    # A path ends in the Variable's `.value`; the weight is `l1.kernel`, not `l1.kernel.value`.
    names = [
        _weight_name(path[:-1] if getattr(path[-1], "name", None) == "value" else path) for path, _ in leaves
    ]
    weights = [np.require(np.asarray(leaf), requirements="C") for _, leaf in leaves]
    return Traceable(
        "flax.nnx", names, weights, lambda size: flat, reference, {"flax_version": flax.__version__}
    )


# --- lowering -----------------------------------------------------------------------------------


def _lower(function: Callable[..., Any], specs: Sequence[Any], platform: str) -> tuple[Any, Any]:
    """The traced function's output shapes and its lowering for `platform`."""

    def flat(*args: Any) -> tuple[Any, ...]:  # the name shows in the module: `module @jit_flat`
        return _as_tuple(function(*args))

    try:
        traced = jax.jit(flat, keep_unused=True).trace(*specs)
    except _VALUE_DEPENDENT as e:
        first = str(e).strip().splitlines()[0]
        raise ValueError(
            "the model branches on (or converts to Python) the values of its inputs or weights, so it "
            f"cannot be a static graph; use jnp.where or jax.lax.cond instead ({type(e).__name__}: {first})"
        ) from e
    return traced.out_info, traced.lower(lowering_platforms=(platform,))


def _check_arity(lowered: Any, n_inputs: int, n_weights: int) -> None:
    """Refuse a module whose `main` takes more than the server binds (inputs, then weights)."""
    module = lowered.compiler_ir("stablehlo")
    main = next(
        op
        for op in module.body.operations
        if op.operation.name == "func.func" and op.sym_name.value == "main"
    )
    arguments = [str(t) for t in main.type.inputs]
    if len(arguments) != n_inputs + n_weights:
        raise ValueError(
            f"the module's main takes {len(arguments)} arguments ({', '.join(arguments[:3])}, ...), but "
            f"the bundle binds {n_inputs} inputs + {n_weights} weights = {n_inputs + n_weights}; an "
            "ordered effect (jax.debug.print(ordered=True), io_callback) adds a token, lifted state more"
        )


def _portable_artifact(text: str) -> bytes:
    """StableHLO text as portable-artifact bytecode, targeting a StableHLO version four weeks
    old (as jax.export does) so that a server on a slightly older jaxlib can still read it."""
    from jax.extend.mlir.dialects import stablehlo

    target = stablehlo.get_version_from_compatibility_requirement(
        stablehlo.StablehloCompatibilityRequirement.WEEK_4
    )
    return bytes(jax.extend.mlir.serialize_portable_artifact(text, target))


def _check_batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    sizes = sorted(batch_sizes)
    if not sizes or sizes[0] < 1 or len(set(sizes)) != len(sizes):
        raise ValueError(f"batch_sizes must be distinct positive integers, got {list(batch_sizes)}")
    return sizes


# --- the writer ---------------------------------------------------------------------------------


def export_bundle(
    fn: Callable[..., Any] | Traceable,
    params: Any,
    inputs: Sequence[InputSpec],
    directory: Path,
    *,
    name: str | None = None,
    batch_sizes: Sequence[int] | None = None,
    batch_axis: bool = True,
    outputs: Sequence[OutputSpec] | None = None,
    platform: Literal["cpu", "cuda"] = "cpu",
    module_format: Literal["text", "bytecode"] = "text",
    description: str = "",
    client_inputs: Sequence[InputSpec] | None = None,
    client_outputs: Sequence[InputSpec] | None = None,
    model_py: Path | None = None,
    verify: bool = True,
    sample_inputs: Sequence[np.ndarray] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_scratch_ratio: float | None = DEFAULT_MAX_SCRATCH_RATIO,
    precision: Precision = "fp32",
    tune: bool = True,
) -> Path:
    """Export `fn(params, *inputs)` as the bundle `directory`; returns the directory.

    `fn` is a JAX function of a parameter pytree (a Flax linen `apply` is one), or a
    `flax.nnx.Module` called on the inputs (then `params` is None; it is exported in eval mode).
    Every input and output gets a leading batch axis, compiled at `batch_sizes` (default 1);
    with `batch_axis=False` none does: the shapes are whole, one module `model.mlir` is written,
    and the server runs each request alone (Triton's max_batch_size 0). `platform` is `cpu` or
    `cuda` (no GPU is needed to lower for cuda; a module lowered for one may not run on the other).
    `module_format="bytecode"` writes StableHLO portable artifacts, which newer jaxlibs promise
    to read. `client_inputs`/`client_outputs` describe what clients send and get when the
    `model_py` file (copied in as `model.py`) transforms them; the server allows them only then.
    `name` defaults to the directory's name and must equal it, since the server names a bundle
    after its directory.

    With `verify` (the default), the bundle is loaded in a fresh process by the server's own
    loader, run at each batch size on `sample_inputs` (rows repeated to fill a batch; seeded
    random data when None) and compared with `fn`: element by element within `atol` times the
    output's largest magnitude plus `rtol` times the element's (by default per dtype, see
    `hloserve.export.verification.DEFAULT_TOLERANCES`; given, they apply to every output).
    Verification needs the platform of this machine; for another it is skipped with a logged
    warning.

    On this machine's platform each module is also compiled once after lowering and its
    scratch (XLA's planned temporary memory) logged; a module whose scratch exceeds
    `max_scratch_ratio` times its weights, inputs and outputs is refused (None: never). With
    `tune` (the default), the largest batch size's module is then timed with XLA's defaults and
    with each of `hloserve.export.tuning.platform_candidates`' option sets; one clearly faster is
    written to the manifest (`xla_options`), which the server compiles with, and the times to
    `provenance.xla_tuning`.

    `precision="bf16"` or `"fp16"` stores the float weights (those wider than 16 bits) in that
    type and computes in it: inside the module, float inputs are cast down at its entry and
    float outputs back to the model's types at its exit, so clients send and get the same dtypes
    (the manifest's are unchanged). Integer weights and inputs stay integers. Verification then
    compares with the float32 model within the precision's tolerance
    (`hloserve.export.verification.precision_tolerance`) and logs top-1 agreement for logits.

    Raises:
        ValueError: the arguments are inconsistent, or the model cannot be a bundle (it branches
            on input values, an output has no batch axis, its module takes other arguments).
        ScratchError: (a ValueError) a module plans more scratch than `max_scratch_ratio` allows.
        VerificationError: the written bundle does not reproduce the model.
    """
    directory = Path(directory)
    if name is not None and name != directory.name:
        raise ValueError(f"bundle name {name!r} must equal its directory's name {directory.name!r}")
    if not batch_axis and batch_sizes is not None:
        raise ValueError("batch_sizes need a batch axis; a bundle with batch_axis=False has one module")
    sizes = _check_batch_sizes(batch_sizes or (1,)) if batch_axis else [UNBATCHED]
    if platform not in ("cpu", "cuda"):
        raise ValueError(f"platform must be 'cpu' or 'cuda', got {platform!r}")
    if module_format not in ("text", "bytecode"):
        raise ValueError(f"module_format must be 'text' or 'bytecode', got {module_format!r}")
    if max_scratch_ratio is not None and not max_scratch_ratio > 0:
        raise ValueError(f"max_scratch_ratio must be > 0 or None, got {max_scratch_ratio!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    for option, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not 0 <= value < float("inf"):
            raise ValueError(f"{option} must be a finite number >= 0, got {value!r}")
    if (client_inputs is not None or client_outputs is not None) and model_py is None:
        raise ValueError("client_inputs and client_outputs need a model_py that produces them")
    if model_py is not None and not Path(model_py).is_file():
        raise ValueError(f"model_py {str(model_py)!r} is not a file")
    if sample_inputs is not None:
        if len(sample_inputs) != len(inputs):
            raise ValueError(f"{len(sample_inputs)} sample inputs for {len(inputs)} inputs")
        for spec, rows in zip(inputs, sample_inputs, strict=True):
            if not batch_axis and np.shape(rows) != tuple(spec.shape):
                raise ValueError(
                    f"sample input {spec.name!r} has shape {np.shape(rows)}, expected {list(spec.shape)}"
                )
            if batch_axis and (np.shape(rows)[1:] != tuple(spec.shape) or not len(rows)):
                raise ValueError(
                    f"sample input {spec.name!r} has shape {np.shape(rows)}, "
                    f"expected [rows, *{list(spec.shape)}]"
                )

    # Each module is compiled once: the scratch check's executable goes to a cache that the
    # verification's fresh process loads from (keyed by the module's bytes, as the server's).
    with tempfile.TemporaryDirectory(prefix="hloserve-export-") as compiled:
        executables = ExecutableCache(Path(compiled))
        if isinstance(fn, Traceable):
            traceable = fn
        elif _is_nnx_module(fn):
            if params is not None:
                raise ValueError("a flax.nnx module carries its own parameters: pass params=None")
            traceable = _from_nnx(fn, len(inputs))
        else:
            traceable = _from_jax(fn, params, len(inputs))
        reference = traceable  # what verification compares with: the model in its own precision
        if precision != "fp32":
            traceable = _in_precision(traceable, inputs, PRECISIONS[precision], batch_axis)
        weights = list(traceable.weights)
        weight_specs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]

        local = _xla.compile_platform()
        modules: dict[int, str | bytes] = {}
        traced_outputs: list[tuple[tuple[int, ...], np.dtype]] = []
        for step, size in enumerate(sizes, 1):
            started = time.perf_counter()
            batch = (size,) if batch_axis else ()
            in_specs = [jax.ShapeDtypeStruct((*batch, *i.shape), np.dtype(i.dtype)) for i in inputs]
            out_info, lowered = _lower(traceable.function_for(size), [*in_specs, *weight_specs], platform)
            for k, out in enumerate(out_info):
                if batch_axis and (not out.shape or out.shape[0] != size):
                    raise ValueError(
                        f"output {k} has shape {out.shape}; hloserve needs a leading batch axis of {size} "
                        "(or export with batch_axis=False)"
                    )
            outputs_here = [(tuple(out.shape[len(batch) :]), np.dtype(out.dtype)) for out in out_info]
            if traced_outputs and outputs_here != traced_outputs:
                raise ValueError(
                    f"outputs (shape after the batch axis, dtype) {outputs_here} at batch size {size} "
                    f"but {traced_outputs} at {sizes[0]}"
                )
            traced_outputs = outputs_here
            _check_arity(lowered, len(inputs), len(weights))
            text = lowered.as_text()
            signature = _xla.main_signature(text)
            modules[size] = _portable_artifact(text) if module_format == "bytecode" else text
            memory = {}  # what XLA plans: measurable on this machine's platform only
            if platform == local:
                measured = module_memory(modules[size], executables)
                memory = {
                    "scratch_mb": round(measured.scratch / 1e6, 1),
                    "scratch_ratio": round(measured.ratio, 2),
                }
                check_scratch(measured, f"bundle {directory.name!r}, batch size {size}", max_scratch_ratio)
            log.info(
                "exported batch size",
                bundle=directory.name,
                batch_size=size,
                step=f"{step}/{len(sizes)}",
                seconds=round(time.perf_counter() - started, 2),
                **memory,
            )
        tuning = None
        if tune and platform == local:
            tuning = tune_module(modules[sizes[-1]], sizes[-1], weights, executables)
        out_specs = (
            list(outputs)
            if outputs is not None
            else [OutputSpec(f"output_{k}") for k in range(len(traced_outputs))]
        )
        if len(out_specs) != len(traced_outputs):
            raise ValueError(f"{len(out_specs)} output names for {len(traced_outputs)} outputs")

        # Everything is traced and checked: only now is the directory touched.
        directory.mkdir(parents=True, exist_ok=True)
        for path in directory.iterdir():
            if _OLD_FILES.match(path.name):  # a module left from other batch sizes would be loaded too
                path.unlink()
        for size, source in modules.items():
            module = directory / (f"model.b{size}.mlir" if batch_axis else "model.mlir")
            if isinstance(source, bytes):
                module.write_bytes(source)
            else:
                module.write_text(source)
        manifest: dict[str, Any] = {
            "format_version": "2.0",
            "name": directory.name,
            "description": description,
            "executable_inputs": [
                _spec_tensor(InputSpec(i.name, i.shape, arg.dtype.numpy, i.letters, i.format), batch_axis)
                for i, arg in zip(inputs, signature.inputs, strict=False)
            ],
            "executable_outputs": [
                _tensor(o.name, dtype, shape, _letters(o.letters, len(shape), o.name), batch_axis)
                for o, (shape, dtype) in zip(out_specs, traced_outputs, strict=True)
            ],
        }
        if client_inputs is not None:
            manifest["client_inputs"] = [_spec_tensor(t) for t in client_inputs]
        if client_outputs is not None:
            manifest["client_outputs"] = [_spec_tensor(t) for t in client_outputs]
        if batch_axis:
            manifest["batching"] = {"compiled_batch_sizes": sizes}
        if tuning is not None and tuning.chosen:
            manifest["xla_options"] = {platform: dict(tuning.chosen)}
        manifest["provenance"] = {
            "exporter": f"hloserve {__version__}",
            "jax_version": jax.__version__,
            "platform": platform,
            "module_format": module_format,
            "source_framework": traceable.framework,
            **traceable.versions,
            "batch_sizes": list(sizes) if batch_axis else [],
            **({"precision": precision} if precision != "fp32" else {}),
            **({"xla_tuning": tuning.provenance()} if tuning is not None else {}),
            "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        (directory / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
        if weights:
            from safetensors.numpy import save_file

            # Cast to what the module takes: the loader checks each weight's dtype against it.
            module_dtypes = [arg.dtype.numpy for arg in signature.inputs[len(inputs) :]]
            save_file(
                {
                    n: np.require(w.astype(d, copy=False), requirements="C")
                    for n, w, d in zip(traceable.weight_names, weights, module_dtypes, strict=True)
                },
                str(directory / WEIGHTS),
                metadata={"argument_order": json.dumps(list(traceable.weight_names))},
            )
            (directory / WEIGHTS).chmod(0o644)
        if model_py is not None and Path(model_py).resolve() != (directory / MODEL_PY).resolve():
            shutil.copyfile(model_py, directory / MODEL_PY)  # (re-exporting beside its own model.py)
        if verify:
            # f32 outputs computed in a narrower type: checked with that type's tolerance
            computed_in = PRECISIONS[precision] if precision != "fp32" else None
            _verify_export(
                directory, reference, inputs, sizes, platform, sample_inputs, rtol, atol, batch_axis,
                computed_in, executables.directory,
            )  # fmt: skip
        return directory


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))


def _in_precision(
    traceable: Traceable, inputs: Sequence[InputSpec], low: np.dtype, batch_axis: bool
) -> Traceable:
    """`traceable` storing and computing in `low` (bf16 or fp16): float weights wider than it cast
    down; in each module, float inputs cast down at the entry and float outputs cast back up to
    the model's own output types at the exit, so that clients see the same dtypes."""
    n_inputs = len(inputs)

    def narrowed(w: np.ndarray) -> np.ndarray:
        return w.astype(low) if _is_float(w.dtype) and w.dtype.itemsize > low.itemsize else w

    wide_specs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in traceable.weights]

    def function_for(size: int) -> Callable[..., Any]:
        function = traceable.function_for(size)
        batch = (size,) if batch_axis else ()
        in_specs = [jax.ShapeDtypeStruct((*batch, *i.shape), np.dtype(i.dtype)) for i in inputs]
        # The model's own output types, from tracing it as it is (no lowering, no compiling).
        wanted = [o.dtype for o in _as_tuple(jax.eval_shape(function, *in_specs, *wide_specs))]

        def cast(*args: Any) -> Any:
            entry = [
                a.astype(low) if _is_float(a.dtype) and a.dtype.itemsize > low.itemsize else a
                for a in args[:n_inputs]
            ]
            result = function(*entry, *args[n_inputs:])
            outputs = [
                o.astype(d) if _is_float(o.dtype) and _is_float(d) else o
                for o, d in zip(_as_tuple(result), wanted, strict=True)
            ]
            return tuple(outputs) if isinstance(result, tuple | list) else outputs[0]

        return cast

    return Traceable(
        traceable.framework,
        traceable.weight_names,
        [narrowed(np.asarray(w)) for w in traceable.weights],
        function_for,
        traceable.reference,
        traceable.versions,
    )


def _verify_export(
    directory: Path,
    traceable: Traceable,
    inputs: Sequence[InputSpec],
    sizes: Sequence[int],
    platform: str,
    sample_inputs: Sequence[np.ndarray] | None,
    rtol: float | None,
    atol: float | None,
    batch_axis: bool,
    computed_in: np.dtype | None = None,
    executables: Path | None = None,
) -> None:
    local = "cpu" if _xla.device().platform == "cpu" else "cuda"
    if platform != local:
        log.warning(
            "bundle not verified: it is lowered for another platform than this machine's",
            bundle=directory.name,
            platform=platform,
            local_platform=local,
        )
        return
    rng = np.random.default_rng(0)
    given = {size: _samples(inputs, sample_inputs, size, rng, batch_axis) for size in sizes}
    expected = {
        size: [np.asarray(o) for o in _as_tuple(traceable.reference(*a))] for size, a in given.items()
    }
    differences = verify_bundle(
        directory, given, expected, rtol=rtol, atol=atol, computed_in=computed_in, executables=executables
    )
    log.info(
        "bundle verified in a fresh process",
        bundle=directory.name,
        max_abs_difference=float(f"{max((d.max_abs for d in differences), default=0.0):.3g}"),
        max_relative_difference=float(f"{max((d.relative for d in differences), default=0.0):.3g}"),
        **{
            f"top1_agreement_{name}": round(d.top1_agreement, 4)
            for name, d in zip(_output_names(directory), differences, strict=False)
            if d.top1_agreement is not None
        },
    )


def _output_names(directory: Path) -> list[str]:
    manifest = yaml.safe_load((directory / "manifest.yaml").read_text())
    return [t["name"] for t in manifest["executable_outputs"]]


def _samples(
    inputs: Sequence[InputSpec],
    given: Sequence[np.ndarray] | None,
    size: int,
    rng: np.random.Generator,
    batch_axis: bool = True,
) -> list[np.ndarray]:
    """One batch of `size` rows per input: the given rows repeated, else seeded random data
    (small integers, so that ids and indices stay in range); without a batch axis, one sample."""
    arrays = []
    for k, spec in enumerate(inputs):
        dtype, shape = np.dtype(spec.dtype), ((size,) if batch_axis else ()) + tuple(spec.shape)
        if given is not None:
            rows = np.asarray(given[k])
            array = (rows[np.arange(size) % len(rows)] if batch_axis else rows).astype(dtype)
        elif dtype.kind in "biu":
            array = rng.integers(0, 2, shape).astype(dtype)
        else:
            array = rng.standard_normal(shape).astype(dtype)
        arrays.append(np.require(array, requirements="C"))
    return arrays
