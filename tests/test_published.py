"""The planner against published runs (``lightning_sp.planner.published``): every row's
prediction pinned (a change to the model shows here, row by row), the FLOP counts the sources
use checked by hand, one published figure converted between the two FLOP conventions by hand,
and the ranking figures (``lightning_sp.planner.ranking``).

The figures are those of docs/planner.md ("Against published runs"): predicted over published
iteration time, minus 1, on the row's own preset and on the other preset of its hardware.
"""

from __future__ import annotations

import pytest

from lightning_sp.memory.flops import (
    causal_half_model_flops_per_iteration,
    model_flops_per_iteration,
)
from lightning_sp.planner.estimate import estimate
from lightning_sp.planner.presets import PRESETS
from lightning_sp.planner.published import (
    MEGATRON_H100_ROWS,
    PublishedRun,
    deviation,
    predict,
    published_runs,
)
from lightning_sp.planner.ranking import ranks, runs_comparison, spearman, table4_comparison
from lightning_sp.planner.report import to_json

RUNS = {run.name: run for run in published_runs()}

PINNED = {  # deviation on the row's preset, on the other preset of its hardware
    "megatron-h100-1.7B": (-0.2507, -0.1583),
    "megatron-h100-7.1B": (-0.2538, -0.1379),
    "megatron-h100-16B": (-0.0617, +0.0382),
    "megatron-h100-32B": (+0.2239, +0.3164),
    "megatron-h100-70B": (-0.0506, +0.0579),
    "megatron-h100-119B": (-0.1093, +0.0251),
    "megatron-h100-177B": (-0.1261, +0.0177),
    "megatron-h100-314B": (-0.0909, +0.0714),
    "megatron-h100-462B": (-0.1191, +0.0480),
    "mcore-mixtral-8x7b": (-0.2397, -0.1081),
    "paper-22B-full": (-0.0256, -0.1468),
    "paper-22B-sp-selective": (-0.0535, -0.1732),
    "paper-175B-full": (+0.0224, -0.1297),
    "paper-175B-sp-selective": (-0.0049, -0.1555),
    "paper-530B-full": (+0.0619, -0.1068),
    "paper-530B-sp-selective": (+0.0326, -0.1348),
    "paper-1T-full": (+0.0952, -0.0852),
    "paper-1T-sp-selective": (+0.0887, -0.0933),
    "paper-530B-full-d=8": (+0.0461, -0.1177),
    "paper-530B-sp-selective-d=8": (+0.0150, -0.1466),
}
"""Predicted / published - 1: H100 rows on h100-80gb and h100-realised, A100 rows on
selene and a100-80gb."""

OTHER = {"h100-80gb": "h100-realised", "selene": "a100-80gb"}
"""The other preset of each row's hardware."""

WITHIN_10 = {
    "h100-realised": {
        "megatron-h100-16B", "megatron-h100-70B", "megatron-h100-119B", "megatron-h100-177B",
        "megatron-h100-314B", "megatron-h100-462B",
    },
    "selene": {name for name in PINNED if name.startswith("paper-")},
}  # fmt: skip
"""The rows within +-10% on the presets that carry a realised GEMM rate; every other row on
those presets is outside (docs/planner.md says why): the test fails when either set changes."""


def test_rows_cover_dense_moe_pipelined_and_not() -> None:
    """At least 12 rows, dense and MoE, pipelined and not; each names its source, its role
    (only the 22B rows, whose layer is Table 4's, are fit rows) and its published figure."""
    runs = list(RUNS.values())
    assert len(runs) >= 12 and set(RUNS) == set(PINNED)
    assert any(r.moe for r in runs) and any(not r.moe for r in runs)
    assert any(r.pipelined for r in runs) and any(not r.pipelined for r in runs)
    for run in runs:
        assert run.source and run.role in ("fit", "check"), run.name
        assert run.preset in PRESETS, run.name
        figures = (run.seconds, run.tflops_per_gpu, run.mfu)
        assert sum(x is not None for x in figures) == 1, f"{run.name}: one published figure"
    assert {r.name for r in runs if r.role == "fit"} == {
        "paper-22B-full",
        "paper-22B-sp-selective",
    }


@pytest.mark.parametrize("name", list(PINNED))
def test_prediction_pinned(name: str) -> None:
    """Each row's predicted iteration over the published one, pinned to 0.2 points."""
    run = RUNS[name]
    own, other = PINNED[name]
    got = deviation(run), deviation(run, OTHER[run.preset])
    assert got[0] == pytest.approx(own, abs=0.002), f"{name} on {run.preset}: {got[0]:+.4f}"
    assert got[1] == pytest.approx(other, abs=0.002), (
        f"{name} on {OTHER[run.preset]}: {got[1]:+.4f}"
    )


def test_which_rows_are_within_ten_percent() -> None:
    for preset, expected in WITHIN_10.items():
        names = [n for n, r in RUNS.items() if preset in (r.preset, OTHER[r.preset])]
        within = {n for n in names if abs(deviation(RUNS[n], preset)) <= 0.10}
        assert within == expected, f"on {preset}: within 10% {sorted(within)}"


def test_megatron_flops_are_ours_by_hand() -> None:
    """Megatron-Core r0.8 counts ``12·B·s·L·h²·((1 + g/a + s/h) + f/h + v/(2Lh))`` (attention
    whole; GeLU MLP ``f = 4h``, MHA ``g = a``): for every row of its H100 table that is our
    model FLOPs, so its per-GPU TFLOP/s is an iteration time of FLOPs / (TFLOP/s · GPUs)."""
    for name, h, _a, layers, t, p, tflops in MEGATRON_H100_ROWS:
        run = RUNS[f"megatron-h100-{name}"]
        batch, s, v = 192 * max(1, t * p // 8), 4096, 131072
        assert run.layout.global_batch_size == batch and run.layout.world_size == 48 * t * p
        megatron = 12 * batch * s * layers * h * h * ((2 + s / h) + 4 + v / (2 * layers * h))
        assert run.model_flops() == pytest.approx(megatron, rel=1e-9)
        assert run.published_seconds() == pytest.approx(
            megatron / (tflops * 1e12 * 48 * t * p), rel=1e-9
        )


def test_causal_half_conversion_of_a_published_row_by_hand() -> None:
    """Megatron-LM's 1.7B row, 408.8 TFLOP/s per GPU counted whole, is by hand ``408.8 ·
    (1 + s/(12h) + v/(12Lh)) / (1 + s/(6h) + v/(12Lh))`` = 365.0 TFLOP/s counted the way
    Megatron-LM counts since 2025 (causal attention at half); the planner's two conventions
    (``estimate --format json``) stand in that ratio, and the published time converts both
    ways to the same iteration."""
    run = RUNS["megatron-h100-1.7B"]
    s, h, layers, v = 4096, 2048, 24, 131072
    whole = 1 + s / (6 * h) + v / (12 * h * layers)
    half = 1 + s / (12 * h) + v / (12 * h * layers)
    by_hand = 408.8 * half / whole
    assert by_hand == pytest.approx(365.0, abs=0.05)
    config, batch = run.layout.config, run.layout.global_batch_size
    ratio = causal_half_model_flops_per_iteration(config, batch) / model_flops_per_iteration(
        config, batch
    )
    assert 408.8 * ratio == pytest.approx(by_hand, rel=1e-12)
    row = estimate(run.layout, measure=False, cluster="h100-80gb").row(False, "none")
    out = to_json(row)
    assert out["model_tflops_per_gpu_causal_half"] == pytest.approx(
        out["model_tflops_per_gpu"] * half / whole, rel=1e-12
    )
    assert out["mfu_causal_half"] == pytest.approx(out["mfu"] * half / whole, rel=1e-12)
    halved = PublishedRun(**{**run.__dict__, "tflops_per_gpu": by_hand, "causal_half": True})
    assert halved.published_seconds() == pytest.approx(run.published_seconds(), rel=1e-12)


def test_mixtral_flops_are_megatrons() -> None:
    run = RUNS["mcore-mixtral-8x7b"]
    B, s, L, h, a, g, f, k, v = 256, 4096, 32, 4096, 32, 8, 14336, 2, 32000
    megatron = 12 * B * s * L * h * h * ((1 + g / a + s / h) + f / h * k * 1.5 + v / (2 * L * h))
    assert run.model_flops() == pytest.approx(megatron, rel=1e-3)  # ours adds the router
    assert (run.layout.world_size, run.layout.global_batch_size) == (64, 256)


def test_prediction_uses_the_runs_execution() -> None:
    """The Megatron rows state their overlaps: priced without them, the 119B row is slower."""
    import dataclasses

    from lightning_sp.planner.execution import Execution

    run = RUNS["megatron-h100-119B"]
    plain = dataclasses.replace(run, execution=Execution())
    assert predict(run).iteration_seconds < predict(plain).iteration_seconds


# -- ranking ---------------------------------------------------------------------------------


def test_spearman_by_hand() -> None:
    assert ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # d = rank differences 0, 1, -1 over n = 3: 1 - 6·2/(3·8) = 0.5
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        spearman([1.0], [1.0])


def test_table4_order() -> None:
    """The paper's Table 4 (one 22B layer, five settings on Selene): on a100-80gb (nothing
    fitted to Table 4) the predicted order is the measured one (rho 1), the measured fastest
    (SP, no recompute) is predicted fastest, 2.0% ahead of the next."""
    cmp = table4_comparison(PRESETS["a100-80gb"])
    assert cmp.rho == pytest.approx(1.0)
    assert cmp.published_best == "SP + none" and cmp.best_lands == 1
    assert cmp.top_margin == pytest.approx(0.020, abs=0.002)


def test_megatron_h100_mfu_order() -> None:
    """Megatron-LM's H100 table orders its nine models by achieved TFLOP/s per GPU (16B
    first, 1.7B last); the planner's order agrees only weakly (rho 0.25 on h100-80gb, 16B
    fifth; 0.35 on h100-realised, 16B third): the small non-pipelined rows are predicted too
    fast and 32B too slow (docs/planner.md)."""
    runs = [r for r in RUNS.values() if r.group.startswith("Megatron-LM")]
    for preset, rho, lands in (("h100-80gb", 0.25, 5), ("h100-realised", 0.35, 3)):
        cmp = runs_comparison(runs, preset, per_flop=True)
        assert cmp.rho == pytest.approx(rho, abs=0.01), preset
        assert cmp.published_best == "megatron-h100-16B" and cmp.best_lands == lands, preset


def test_32b_is_out_of_reach_at_micro_batch_one() -> None:
    """Megatron's 32B row (t = 8, p = 1, d = 48) as assumed, four accumulated micro-batches of
    one: its fp32 reduce-scatter (15.7 GB a rank) and bf16 all-gather run over one adapter per
    node and overlap only the last backward and the first forward. Even with every rate at
    its upper bound (best-shape GEMMs, the adapters at their line rate) the step is 9.3%
    longer than the published one, so the row stays outside (docs/planner.md, "The three rows
    still outside"); the exposed reduction is what a larger micro-batch would hide."""
    import dataclasses

    run = RUNS["megatron-h100-32B"]
    assert (run.layout.micro_batch_size, run.layout.microbatches_per_step) == (1, 4)
    ceiling = dataclasses.replace(
        PRESETS["h100-80gb"], execution=run.execution, network_efficiency=1.0
    )
    from lightning_sp.planner.steptime import step_time

    best = step_time(run.layout, ceiling)
    assert best.iteration_seconds / run.published_seconds() - 1 == pytest.approx(0.093, abs=0.002)
    assert best.parts["dp_exposed"] == pytest.approx(0.308, abs=0.002), best.parts["dp_exposed"]
    one = dataclasses.replace(run.layout, micro_batch_size=4, accumulate_grad_batches=1)
    assert step_time(one, ceiling).parts["dp_exposed"] == 0.0, "one micro-batch hides it all"
