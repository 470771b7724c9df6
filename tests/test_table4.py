"""The ``selene`` cluster: the GEMM efficiency the paper's Table 4 implies
(``lightning_sp.planner.table4``). Table 5 on it is checked in tests/test_steptime.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lightning_sp.planner.cluster import A100_80GB, load_cluster
from lightning_sp.planner.table4 import (
    TABLE4,
    fit_gemm_efficiency,
    main,
    predicted_ms,
    selene,
    table4_error,
)

from cli_runs import ROOT

SELENE_YAML = ROOT / "configs" / "clusters" / "selene.yaml"


def test_committed_selene_is_the_fit(tmp_path: Path) -> None:
    """``configs/clusters/selene.yaml`` is what ``python -m lightning_sp.planner.table4``
    writes today: the fitted efficiency, every other figure the a100-80gb preset's."""
    out = tmp_path / "selene.yaml"
    main(["--out", str(out)])
    written, committed = load_cluster(str(out)), load_cluster(str(SELENE_YAML))
    assert committed.gemm_efficiency == written.gemm_efficiency == fit_gemm_efficiency()
    as_preset = dataclasses.replace(
        committed, name=A100_80GB.name, gemm_efficiency=A100_80GB.gemm_efficiency
    )
    assert as_preset == A100_80GB


def test_fit_is_the_least_error() -> None:
    """The fitted efficiency is a minimum of the Table 4 error: a step either way is worse,
    and it lies below the best-GEMM figure (the paper's layers ran slower than that)."""
    fitted = fit_gemm_efficiency()
    error = table4_error(selene())
    for step in (-0.01, 0.01):
        other = dataclasses.replace(A100_80GB, gemm_efficiency=fitted + step)
        assert table4_error(other) > error
    assert 0.5 < fitted < A100_80GB.gemm_efficiency


def test_selene_reproduces_table4() -> None:
    """Each of Table 4's ten times within 5% on selene; on a100-80gb the layer is short."""
    cluster = selene()
    for row in TABLE4:
        forward, backward = predicted_ms(cluster, row)
        assert forward == pytest.approx(row.forward_ms, rel=0.05), row
        assert backward == pytest.approx(row.backward_ms, rel=0.05), row
        fast_forward, fast_backward = predicted_ms(A100_80GB, row)
        assert fast_forward < forward and fast_backward < backward
