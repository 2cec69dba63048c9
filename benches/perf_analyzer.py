"""Triton's perf_analyzer, made runnable here: `python benches/perf_analyzer.py --install`.

PyPI's `perf-analyzer` is an empty placeholder, and the binaries in tritonclient >= 2.52 need
glibc 2.38. The one in the `tritonclient==2.51.0` manylinux1 wheel runs on Debian 12 once given
two libraries: `libb64.so.0d` (Debian's libb64-0d, downloaded and unpacked, not installed) and
`libcudart.so.12` (PyPI's nvidia-cuda-runtime-cu12; it loads without a GPU). Everything goes
under `.tools/perf_analyzer/` in the repository (git-ignored). Installing twice does nothing.
2.51.0 rather than 2.50.0 (both work) because it matches PyTriton's server, our peer in benches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / ".tools" / "perf_analyzer"
BINARY = HOME / "perf_analyzer"
LIB = HOME / "lib"
TRITONCLIENT = "tritonclient==2.51.0"
CUDA_RUNTIME = "nvidia-cuda-runtime-cu12==12.9.79"

__all__ = ["install", "perf_analyzer_path", "run_perf_analyzer"]


def perf_analyzer_path() -> Path | None:
    """The installed binary, or None."""
    return (
        BINARY
        if BINARY.exists() and (LIB / "libb64.so.0d").exists() and (LIB / "libcudart.so.12").exists()
        else None
    )


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(LIB), os.environ.get("LD_LIBRARY_PATH")])),
    }


def run_perf_analyzer(
    args: list[str], timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run perf_analyzer with its libraries (and `env` added to its environment); output
    captured as text."""
    path = perf_analyzer_path()
    if path is None:
        raise FileNotFoundError(
            "perf_analyzer is not installed: run `python benches/perf_analyzer.py --install`"
        )
    return subprocess.run(
        [str(path), *args], env={**_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def _pip_download(requirement: str, into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--platform", "manylinux1_x86_64", "--platform", "manylinux2014_x86_64",
         "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_27_x86_64",
         "--python-version", "3.11", "-d", str(into), requirement],
        check=True,
    )  # fmt: skip
    (wheel,) = into.glob(requirement.split("==")[0].replace("-", "_") + "-*.whl")
    return wheel


def _libb64(into: Path) -> None:
    """Unpack Debian's libb64-0d without installing it (no root needed but apt's cache)."""
    work = into / "deb"
    work.mkdir()
    download = ["apt-get", "download", "libb64-0d"]
    if subprocess.run(download, cwd=work, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(download, cwd=work, check=True, capture_output=True)
    (deb,) = work.glob("libb64-0d_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
    (library,) = (work / "root").rglob("libb64.so.0d*")
    shutil.copy2(library.resolve(), LIB / "libb64.so.0d")


def install() -> Path:
    """Fetch and unpack perf_analyzer and its two libraries; returns the binary's path."""
    found = perf_analyzer_path()
    if found is not None:
        return found
    LIB.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with zipfile.ZipFile(_pip_download(TRITONCLIENT, work)) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith("/bin/perf_analyzer"))
            BINARY.write_bytes(wheel.read(member))
        BINARY.chmod(0o755)
        with zipfile.ZipFile(_pip_download(CUDA_RUNTIME, work)) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith("/libcudart.so.12"))
            (LIB / "libcudart.so.12").write_bytes(wheel.read(member))
        _libb64(work)
    path = perf_analyzer_path()
    assert path is not None
    check = subprocess.run([str(path), "--version"], env=_env(), capture_output=True, text=True)
    if check.returncode != 0 or "Perf Analyzer Version" not in check.stdout + check.stderr:
        raise RuntimeError(f"perf_analyzer does not run: {(check.stderr or check.stdout).strip()[:500]}")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--install", action="store_true", help="fetch perf_analyzer into .tools/perf_analyzer"
    )
    if parser.parse_args().install:
        print(install())
    else:
        print(perf_analyzer_path() or "not installed")
