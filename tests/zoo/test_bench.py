"""The zoo's benches produce their rows on their quick paths: `benches zoo --quick` (one small zoo
model, exported or taken from the zoo's cache, served by a real `hloserve serve`, timed beside
torch eager), `benches anchors --quick` and `benches imports --quick`. Here rather than in
tests/test_benches.py: they need the zoo's torchvision, which only `tox -e zoo` installs."""

from __future__ import annotations

import pytest

from benches import zoo


@pytest.mark.slow
@pytest.mark.timeout(1200)  # exports the model unless the zoo's cache has it
def test_the_zoo_bench_quick_path_measures_one_model() -> None:
    rows = zoo.run(quick=True, threads=1)
    assert [(r.model, r.batch) for r in rows] == [(name, 1) for name in zoo.QUICK_MODELS]
    for row in rows:
        assert row.hloserve_ms > 0 and row.torch_ms > 0 and row.grpc_ms >= row.hloserve_ms
        assert row.ratio == pytest.approx(row.hloserve_ms / row.torch_ms, abs=0.02)
    assert "median ratio" in zoo.table(rows)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # exports the model (and to ONNX) unless cached; torch.compile's first compile
def test_the_anchors_quick_path_measures_one_model_beside_three_runtimes() -> None:
    from benches import anchors

    # the zoo's cache as its own baseline: the same export, timed a second time in the same rounds
    rows = anchors.run(quick=True, threads=1, baseline=anchors._zoo()._cache_root())
    assert [(r.model, r.batch, r.threads) for r in rows] == [(name, 1, 1) for name in anchors.QUICK_MODELS]
    for row in rows:
        assert set(row.ms) == set(anchors.RUNTIMES) and all(ms > 0 for ms in row.ms.values())
        for anchor in ("eager", "compile", "ort"):
            assert row.ratios[anchor] == pytest.approx(row.ms["hloserve"] / row.ms[anchor], rel=0.01)
        assert row.export_s is not None and row.export_s > 0 and row.onnx_export_s > 0
        assert row.compile_s > 0 and row.torch_compile_s > 0
        # the module with XLA's defaults is timed exactly where the export kept options of its own
        assert (row.defaults_ms is not None and row.defaults_ms > 0) == bool(row.xla_options)
        assert row.baseline_ms is not None and row.baseline_ms > 0
    assert "1 thread(s), hloserve / ort: median" in anchors.table(rows) and "base ms" in anchors.table(rows)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # makes the ONNX zoo's Triton repository and its import unless cached
def test_the_imports_quick_path_times_an_imported_model_beside_onnx_runtime_on_its_file() -> None:
    from benches import imports

    rows = imports.run(quick=True, threads=1)
    expected = [(name, "import triton", 1) for name in imports.QUICK_MODELS]
    assert [(r.model, r.via, r.threads) for r in rows] == expected
    for row in rows:
        assert set(row.ms) == set(imports.RUNTIMES) and all(ms > 0 for ms in row.ms.values())
        assert row.ratio == pytest.approx(row.ms["hloserve"] / row.ms["ort"], rel=0.01)
        assert row.import_s > 0 and row.compile_s > 0
    assert "1 thread(s), imported hloserve / ONNX Runtime on the original: median" in imports.table(rows)
