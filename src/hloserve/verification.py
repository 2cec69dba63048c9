"""A written bundle checked as the server will run it: loaded in a fresh process by the server's
own loader, run at each batch size, and compared with the model it came from.

A fresh process sees only the files, so nothing of the exporting process (a traced function, a
cached executable) can hide a fault in them. Arrays cross to it in an .npz, with dtype tokens
(npz reads bf16 and fp8 back as void).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

import hloserve
from hloserve import _xla, dtypes
from hloserve.bundle import load_bundle, read_weights
from hloserve.compiled import compile_bundle

__all__ = ["DEFAULT_ATOL", "DEFAULT_RTOL", "VerificationError", "verify_bundle"]

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-5


class VerificationError(Exception):
    """A written bundle, run by the server's loader in a fresh process, does not reproduce its model.

    Raised after the files are written (they stay, for inspection); a model that cannot be
    exported at all raises ValueError before anything is written.
    """


def verify_bundle(
    directory: Path,
    inputs: Mapping[int, Sequence[np.ndarray]],
    expected: Mapping[int, Sequence[np.ndarray]],
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
) -> list[float]:
    """Run a bundle as the server would, in a fresh process, and compare it with `expected`.

    `inputs` and `expected` map a batch size to its input and output arrays. A fresh process
    sees only the files, so nothing of the exporting process (a traced function, a cached
    executable) can hide a fault in them. Returns the largest absolute difference per output.

    Raises:
        VerificationError: naming the output, the batch size and the largest absolute
            difference; or saying why the bundle does not load and run.
    """
    directory = Path(directory)
    with tempfile.TemporaryDirectory(prefix="hloserve-verify-") as scratch:
        sent, received = Path(scratch) / "inputs.npz", Path(scratch) / "outputs.npz"
        _save_arrays(sent, inputs)
        env = dict(os.environ)
        source = str(Path(hloserve.__file__).resolve().parents[1])  # importable whatever the cwd
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(directory), str(sent), str(received)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if child.returncode != 0:
            lines = child.stderr.strip().splitlines()
            raise VerificationError(
                f"bundle {directory.name!r} does not run with the server's loader: "
                f"{lines[-1] if lines else f'exit status {child.returncode}'}"
            )
        got = _load_arrays(received)
    names = [t.name for t in load_bundle(directory).manifest.executable_outputs]
    worst = [0.0] * len(names)
    for size, want in expected.items():
        for k, (name, w, g) in enumerate(zip(names, want, got[size], strict=True)):
            where = f"bundle {directory.name!r}, output {name!r}, batch size {size}"
            if g.dtype != w.dtype or g.shape != w.shape:
                raise VerificationError(
                    f"{where}: the bundle gives {g.dtype}{list(g.shape)}, the model {w.dtype}{list(w.shape)}"
                )
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            both_nan = np.isnan(g64) & np.isnan(w64)
            difference = float(np.max(np.where(both_nan, 0.0, np.abs(g64 - w64)), initial=0.0))
            worst[k] = max(worst[k], difference)
            if not np.allclose(g64, w64, rtol=rtol, atol=atol, equal_nan=True):
                raise VerificationError(
                    f"{where}: differs from the model by up to {difference:.3g} (rtol={rtol}, atol={atol})"
                )
    return worst


_CHILD = "import sys; from hloserve.verification import _run_bundle; _run_bundle(*sys.argv[1:])"


def _run_bundle(directory: str, inputs_path: str, outputs_path: str) -> None:
    """The fresh process's half of `verify_bundle`: load, compile and run as the server does."""
    _xla.warm_up()
    bundle = load_bundle(Path(directory))
    compiled = compile_bundle(bundle)
    weights = [_xla.put(w) for w in read_weights(bundle)]
    outputs = {
        size: compiled.execute(size, arrays, weights).outputs
        for size, arrays in _load_arrays(Path(inputs_path)).items()
    }
    _save_arrays(Path(outputs_path), outputs)


def _save_arrays(path: Path, arrays: Mapping[int, Sequence[np.ndarray]]) -> None:
    """Arrays per batch size as an .npz, with dtype tokens: npz reads bf16 and fp8 back as void."""
    entries: dict[str, np.ndarray] = {}
    for size, batch in arrays.items():
        entries[f"b{size}_dtypes"] = np.array([dtypes.by_numpy(a.dtype).token for a in batch])
        entries.update({f"b{size}_{k}": np.asarray(a) for k, a in enumerate(batch)})
    np.savez(path, **entries)  # type: ignore[arg-type]  # numpy's stub types **kwds as one array-like


def _load_arrays(path: Path) -> dict[int, list[np.ndarray]]:
    with np.load(path) as saved:
        sizes = sorted(int(key[1:].split("_")[0]) for key in saved.files if key.endswith("_dtypes"))
        return {
            size: [
                saved[f"b{size}_{k}"].view(dtypes.by_token(str(token)).numpy)
                for k, token in enumerate(saved[f"b{size}_dtypes"])
            ]
            for size in sizes
        }
