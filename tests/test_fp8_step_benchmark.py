"""``benchmarks.fp8_step`` (the GPU row of ``gpu_session.sh``'s ``fp8`` part): without CUDA it
refuses in one line; ``--device cpu --smoke`` runs every variant (emulated) and each keeps the
bytes its formula states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fp8_step


def test_fp8_step_refuses_without_cuda_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert fp8_step.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err, err


def test_gpu_session_has_the_fp8_step_row() -> None:
    script = (Path(__file__).parent.parent / "benchmarks" / "gpu_session.sh").read_text()
    assert 'fp8) step 150 "fp8 GPT step" python -m benchmarks.fp8_step --out "$OUT"' in script


@pytest.mark.slow
def test_fp8_step_plumbing_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    assert fp8_step.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "fp8_step.json").read_text())["rows"]}
    assert set(rows) == {"bf16", "tensorwise", "rowwise"}, rows
    for name, row in rows.items():
        assert row["held_bytes_per_layer"] == row["formula_bytes_per_layer"], (name, row)
        assert abs(row["loss"] - rows["bf16"]["loss"]) < 0.01 * rows["bf16"]["loss"], (name, row)
    assert rows["tensorwise"]["held_bytes_per_layer"] < rows["bf16"]["held_bytes_per_layer"]
