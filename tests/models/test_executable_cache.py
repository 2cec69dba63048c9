"""Compiled executables survive a restart, and a corrupt entry is recompiled.

One process: the executable cache is the engine's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import structlog
from support.bundles import PARAMS, affine, write_affine
from support.numerics import assert_close
from support.servers import make_config, start_worker

from hloserve.models import _xla
from hloserve.models.bundle import load_bundle, read_weights
from hloserve.models.executable_cache import ExecutableCache, default_directory


def test_a_second_cache_loads_what_the_first_compiled(tmp_path: Path) -> None:
    bundle = load_bundle(write_affine(tmp_path / "affine"))
    source = bundle.module_for(2).source
    first = ExecutableCache(tmp_path / "cache")
    first.compile(source)
    assert (first.hits, first.misses) == (0, 1)
    assert len(list((tmp_path / "cache").glob("*.xla"))) == 1

    restarted = ExecutableCache(tmp_path / "cache")  # as after a restart
    executable = restarted.compile(source)
    assert (restarted.hits, restarted.misses) == (1, 0)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    weights = [_xla.put(w) for w in read_weights(bundle)]
    (y,) = _xla.to_numpy(_xla.run(executable, [_xla.put(x), *weights]))
    assert_close(y, affine(PARAMS, x))


def test_the_key_covers_the_module_and_the_runtime(tmp_path: Path) -> None:
    cache = ExecutableCache(tmp_path)
    assert cache.key("module a") != cache.key("module b")
    assert cache.key("module a") == cache.key(b"module a")
    assert "jaxlib" in _xla.runtime_identity() and "cpu" in _xla.runtime_identity()


def test_the_key_covers_xla_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An executable compiled under other XLA_FLAGS is other code: never a hit."""
    cache = ExecutableCache(tmp_path)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    before = cache.key("module a")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert cache.key("module a") != before


def test_a_corrupt_entry_is_recompiled_and_replaced(tmp_path: Path) -> None:
    source = load_bundle(write_affine(tmp_path / "affine")).module_for(1).source
    cache = ExecutableCache(tmp_path / "cache")
    cache.compile(source)
    (entry,) = (tmp_path / "cache").glob("*.xla")
    entry.write_bytes(b"not an executable")
    with structlog.testing.capture_logs() as logs:
        again = ExecutableCache(tmp_path / "cache")
        again.compile(source)
    assert (again.hits, again.misses) == (0, 1)
    assert any(e["event"] == "executable cache entry unreadable; recompiling" for e in logs)
    assert entry.read_bytes() != b"not an executable"
    assert ExecutableCache(tmp_path / "cache").compile(source) is not None


def test_the_worker_uses_the_cache_across_restarts(tmp_path: Path) -> None:
    write_affine(tmp_path / "repo" / "affine")
    config = make_config(tmp_path / "repo", executable_cache=tmp_path / "cache")
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            start_worker(config).stop()
    starts = [e for e in logs if e["event"] == "executable cache"]
    assert [(e["hits"], e["compiled"]) for e in starts] == [(0, 2), (2, 0)]


def test_default_directory_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_directory() == tmp_path / "hloserve" / "executables"
