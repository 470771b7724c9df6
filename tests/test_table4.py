"""The ``selene`` preset: the GEMM efficiency the paper's Table 4 implies
(``lightning_sp.planner.table4``). Table 5 on it is checked in tests/test_steptime.py."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_sp.planner.presets import A100_80GB, PRESETS, SELENE
from lightning_sp.planner.table4 import (
    TABLE4,
    fit_gemm_efficiency,
    main,
    predicted_ms,
    table4_error,
)


def test_selene_preset_is_the_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """The preset's GEMM efficiency is what the fit finds today; every other figure is the
    a100-80gb preset's; ``python -m lightning_sp.planner.table4`` prints both."""
    fitted = fit_gemm_efficiency()
    assert SELENE.gemm_efficiency == fitted and PRESETS["selene"] is SELENE
    as_a100 = dataclasses.replace(
        SELENE, name=A100_80GB.name, gemm_efficiency=A100_80GB.gemm_efficiency
    )
    assert as_a100 == A100_80GB
    main([])
    assert (
        f"fitted gemm_efficiency {fitted} (the selene preset has {fitted})"
        in capsys.readouterr().out
    )


def test_fit_is_the_least_error() -> None:
    """The fitted efficiency is a minimum of the Table 4 error: a step either way is worse,
    and it lies below the best-GEMM figure (the paper's layers ran slower than that)."""
    error = table4_error(SELENE)
    for step in (-0.01, 0.01):
        other = dataclasses.replace(SELENE, gemm_efficiency=SELENE.gemm_efficiency + step)
        assert table4_error(other) > error
    assert 0.5 < SELENE.gemm_efficiency < A100_80GB.gemm_efficiency


def test_selene_reproduces_table4() -> None:
    """Each of Table 4's ten times within 5% on selene; on a100-80gb every one is shorter."""
    for row in TABLE4:
        forward, backward = predicted_ms(SELENE, row)
        assert forward == pytest.approx(row.forward_ms, rel=0.05), row
        assert backward == pytest.approx(row.backward_ms, rel=0.05), row
        fast_forward, fast_backward = predicted_ms(A100_80GB, row)
        assert fast_forward < forward and fast_backward < backward
