"""The speed benchmarks' plumbing at tiny shapes (their numbers mean nothing here; no timing is
asserted): ``benchmarks.fit_overhead`` (its ``fit`` and ``compile`` sections),
``benchmarks.fp8_gpu``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import fit_overhead, fp8_gpu


@pytest.mark.slow
def test_fit_overhead_smoke_counts_one_host_read_per_fit_step(tmp_path: Path) -> None:
    result = fit_overhead.main(["--smoke", "--out", str(tmp_path)])
    measured = result["measured"]
    reads = measured["host_reads_per_step"]
    assert reads["fit"] == 1 and reads["bare"] == 0, f"host reads per step: {reads}"
    for name in ("fit_over_bare", "bare_over_fwd_bwd", "fit_over_fwd_bwd"):
        median, low, high = measured[name]
        assert 0 < low <= median <= high and math.isfinite(high), (name, measured[name])
    assert json.loads((tmp_path / "fit_overhead.json").read_text())["meta"]["smoke"]


@pytest.mark.slow
def test_compile_cpu_smoke(tmp_path: Path) -> None:
    result = fit_overhead.main(["--only", "compile", "--smoke", "--out", str(tmp_path)])
    (case,) = result["cases"]
    median, low, high = case["compiled_over_eager"]
    assert 0 < low <= median <= high, case


@pytest.mark.slow
def test_fp8_gpu_plumbing_on_cpu_agrees_with_torchao(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    assert fp8_gpu.main(["--smoke", "--device", "cpu", "--no-compile", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fp8_gpu.json").read_text())["rows"]
    assert {r["variant"] for r in rows} >= {"bf16", "ours tensorwise", "torchao rowwise"}
    for row in rows:
        if row["variant"].startswith("ours"):
            assert row["max_rel_diff_vs_torchao"] <= 1e-3, row


def test_fp8_gpu_refuses_without_cuda_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert fp8_gpu.main([]) == 2
    assert capsys.readouterr().err.count("\n") == 1
