"""The GPU benchmark's command: refuses cleanly without CUDA, and its pieces run (on CPU, at a
tiny shape, as a plumbing check whose timings mean nothing and are never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu
from lightning_sp.model.config import RECOMPUTE_POLICIES

from cli_runs import ROOT


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_in_one_line_without_cuda() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA device" in lines[0], run.stderr


@pytest.mark.slow
def test_cpu_smoke_runs_every_piece(tmp_path: Path) -> None:
    args = ["--device", "cpu", "--smoke", "--no-compile", "--warmup", "1", "--steps", "1"]
    args += ["--dropout", "0"]  # CPU SDPA with dropout leaves the fused kernel (DESIGN.md)
    assert gpu.main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert "Plumbing check on CPU" in (tmp_path / "gpu.md").read_text()
    ours = [row for row in result["models"] if row["model"] == "lightning-sp"]
    expected = {(b, p) for b in gpu.attention_backends() for p in RECOMPUTE_POLICIES}
    assert {(row["attention"], row["recompute"]) for row in ours} == expected
    for row in ours:
        assert "error" not in row, row
        # LayerNorm's fp32 mean/rstd (16sb bytes per layer) are what the formula leaves out
        assert row["held_sbh_per_layer"] == pytest.approx(row["formula_sbh_per_layer"], rel=0.01)
        assert row["tokens_per_sec"] > 0 and row["mfu"] > 0
    plain = {
        (r["attention"], r["compiled"]) for r in result["models"] if r["model"] != "lightning-sp"
    }
    assert plain == {("sdpa", False), ("math", False)}
    assert result["fit"]["fit_tokens_per_sec"] > 0 and result["fit"]["loop_tokens_per_sec"] > 0
