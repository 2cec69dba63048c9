"""Native CPU kernels that compiled programs call through XLA's FFI, where XLA:CPU's own code is
slow: a depthwise convolution ran about three times faster in `depthwise.cc` than as XLA's fusion
of strided slices on MobileNet's shapes.

A bundle stays portable StableHLO: the lowering wraps each such operation in a
`stablehlo.composite` whose decomposition is the plain form, which every platform compiles.
On CPU, where the kernels built, the server turns those composites into FFI calls before it
compiles (`hloserve.models._xla`). The kernels are built on first use with the machine's C++
compiler against the installed jaxlib's FFI headers, into the cache folder, keyed by their
source, jaxlib's version and the compiler; a machine without a compiler runs the decomposition.
`HLOSERVE_NATIVE_KERNELS=0` turns them off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog

__all__ = ["DEPTHWISE_CONV2D", "OPTION", "TARGETS", "Kernels", "build_directory", "load"]

log = structlog.get_logger("hloserve.kernels")

OPTION = "hloserve_native_kernels"
"""The key among a bundle's `xla_options` for a platform that turns the kernels on (true)."""

DEPTHWISE_CONV2D = "hloserve.depthwise_conv2d"
"""The composite's name in a bundle, and the FFI target it becomes: NHWC float32 `x` and
(KH, KW, C) taps to NHWC; attributes stride_h/w, pad_h/w (both sides), dilation_h/w."""

_SOURCES = {DEPTHWISE_CONV2D: ("depthwise.cc", "HloserveDepthwiseConv2d")}
"""Per FFI target: its source file beside this module and its handler's symbol."""

TARGETS = frozenset(_SOURCES)
"""The composites' names that a native kernel runs, each its FFI target's name."""

BUILD_TIMEOUT_S = 300.0
"""A compiler that runs longer than this is given up on (the decomposition runs instead)."""


@dataclass(frozen=True, slots=True)
class Kernels:
    """The library loaded and its `TARGETS` registered with XLA for the CPU."""

    path: Path
    digest: str
    """What the compiled code depends on; part of the cache key of an executable that calls it."""


def build_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hloserve" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _digest(compiler: str) -> str:
    import jaxlib.version  # here, not at import: hloserve.models._xla sets up jax's logging first

    digest = hashlib.sha256(f"jaxlib {jaxlib.version.__version__}; {compiler}".encode())
    for source, _ in sorted(_SOURCES.values()):
        digest.update((Path(__file__).parent / source).read_bytes())
    return digest.hexdigest()[:16]


def _build(compiler: str, target: Path) -> None:
    """Compile every source into one shared library at `target`, written whole or not at all
    (servers and their frontends may build at once)."""
    import jax.ffi

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [
            compiler,
            "-O3",
            "-std=c++17",
            "-fPIC",
            "-shared",
            f"-I{jax.ffi.include_dir()}",
            *(str(Path(__file__).parent / source) for source, _ in _SOURCES.values()),
            "-o",
            str(built),
        ]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(built, target)


@functools.cache
def load() -> Kernels | None:
    """The kernels, built if this machine has not built them yet, and registered with XLA; None
    where they are turned off or cannot be built (logged once, with the compiler's words)."""
    if os.environ.get("HLOSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("native kernels off: no C++ compiler", looked_for=os.environ.get("CXX", "c++"))
        return None
    digest = _digest(compiler)
    path = build_directory() / f"kernels-{digest}.so"
    try:
        if not path.is_file():
            _build(compiler, path)
            log.info("native kernels built", path=str(path))
        library = ctypes.cdll.LoadLibrary(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        words = getattr(e, "stderr", None) or str(e)
        log.warning("native kernels off: build or load failed", path=str(path), error=words[-2000:])
        return None
    import jax.ffi

    for target, (_, symbol) in _SOURCES.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return Kernels(path, digest)
