"""The planner prices FP8 (:mod:`lightning_sp.planner.fp8`): the layers' linear GEMMs at the
cluster's dense FP8 peak (the H100 datasheet's 1,979 TFLOP/s, inherited by ``h200``) with
their operands' casts, the attention core as BF16; the activation bytes the FP8 formulas state;
``estimate`` says so in its report, and refuses FP8 on a cluster without FP8 GEMMs (an A100)
in one line, before any work."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_sp import ConfigError, GPTConfig
from lightning_sp.memory.formulas import activation_bytes_per_layer
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.fp8 import FP8Config
from lightning_sp.planner.estimate import estimate
from lightning_sp.planner.fp8 import CAST_BYTES, fp8_gemm_seconds
from lightning_sp.planner.kernels import gemm_seconds, wave_efficiency
from lightning_sp.planner.layertime import layer_time
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.ops import layer_gemms
from lightning_sp.planner.presets import PRESETS, cluster_from_dict
from lightning_sp.planner.report import format_table

from models import layout_at

H100 = PRESETS["h100-80gb"]


def _llama(fp8: FP8Config | None) -> GPTConfig:
    """Llama 3 8B's layer at s = 8192, t = 4 + SP."""
    return GPTConfig.of(
        "llama", vocab_size=128256, seq_length=8192, hidden_size=4096, num_layers=32,
        num_heads=32, num_query_groups=8, ffn_hidden_size=14336, sequence_parallel=True,
        attention="sdpa", recompute="none", fp8=fp8,
    )  # fmt: skip


def test_fp8_presets_are_the_datasheets() -> None:
    assert H100.fp8_peak_flops == 1979e12, "H100 SXM dense FP8 (datasheet, no sparsity)"
    assert PRESETS["h200"].fp8_peak_flops == H100.fp8_peak_flops, "the H200 is the H100's chip"
    assert PRESETS["a100-80gb"].fp8_peak_flops is None, "an A100 has no FP8 tensor cores"
    with pytest.raises(ConfigError, match=r"^cluster x: fp8_peak_flops=-1.0 must be a positive"):
        cluster_from_dict({"base": "h100-80gb", "fp8_peak_flops": -1.0}, "x").validate()


def test_layer_time_prices_the_linears_at_the_fp8_peak_and_the_core_as_bf16() -> None:
    bf16 = _llama(None).activation_shape(layout_at(4), 1)
    fp8 = _llama(FP8Config("tensorwise")).activation_shape(layout_at(4), 1)
    slow, fast = layer_time(bf16, H100), layer_time(fp8, H100)
    linears = [g for g in layer_gemms(fp8) if not g.tag]
    assert {g.name for g in linears} == {"qkv", "projection", "gate", "up", "fc2"}, linears
    assert fast.forward["gemm"] == pytest.approx(sum(fp8_gemm_seconds(H100, g) for g in linears))
    assert slow.forward["gemm"] == pytest.approx(sum(gemm_seconds(H100, g) for g in linears))
    assert fast.forward["attention"] == slow.forward["attention"], "the core is not FP8"
    # the largest GEMM: compute at twice BF16's peak, plus 5 B per operand element of casts
    fc2 = next(g for g in linears if g.name == "fc2")
    operands = fc2.m * fc2.k + fc2.k * fc2.n
    waves = wave_efficiency(H100, fc2.m, fc2.n)
    compute = fc2.flops / (1979e12 * H100.gemm_efficiency * waves)
    casts = CAST_BYTES * operands / H100.memory_rate
    assert fp8_gemm_seconds(H100, fc2) == pytest.approx(compute + casts, rel=1e-12)
    ratio = slow.seconds("none", "sdpa") / fast.seconds("none", "sdpa")
    assert 1.05 < ratio < 2.0, f"an FP8 layer should be faster, not 2x (ratio {ratio:.3f})"


def test_fp8_prices_both_backward_gemms_in_float8() -> None:
    """The backward of an FP8 layer runs each linear's data-gradient and weight-gradient GEMMs
    in float8 (the core's stay bf16): the backward GEMM time differs from BF16's by exactly
    those GEMMs' float8 less their bf16 seconds."""
    from lightning_sp.planner.ops import backward_gemms

    bf16 = _llama(None).activation_shape(layout_at(4), 1)
    fp8 = _llama(FP8Config("tensorwise")).activation_shape(layout_at(4), 1)
    slow, fast = layer_time(bf16, H100), layer_time(fp8, H100)
    expected = 0.0
    for g in (g for g in layer_gemms(fp8) if not g.tag):
        for grad in backward_gemms(g):
            expected += fp8_gemm_seconds(H100, grad) - gemm_seconds(H100, grad)
    got = fast.backward["gemm"] - slow.backward["gemm"]
    assert got == pytest.approx(expected, rel=1e-9), (
        f"FP8 backward GEMMs: {got:.4e} s from BF16's, expected {expected:.4e} s (both the "
        "data- and the weight-gradient GEMMs of every linear in float8)"
    )


def test_memory_bound_fp8_gemm_writes_a_two_byte_output() -> None:
    """A thin GEMM (k = 16: 4096 x 4096 outputs from 16-wide operands) is memory bound in
    float8: it streams its 1-byte operands and writes its bf16 output, 2 bytes an element,
    then pays its operands' casts (5 B an element)."""
    from lightning_sp.model.parts.base import Gemm

    thin = Gemm("thin", 4096, 4096, 16)
    operands = 4096 * 16 + 16 * 4096
    streamed = (operands + 2 * 4096 * 4096) / H100.memory_rate
    compute = thin.flops / (1979e12 * H100.gemm_efficiency * wave_efficiency(H100, 4096, 4096))
    assert compute < streamed / 2, "the case needs a memory-bound GEMM"
    expected = streamed + CAST_BYTES * operands / H100.memory_rate
    got = fp8_gemm_seconds(H100, thin)
    assert got == pytest.approx(expected, rel=1e-12), (
        f"memory-bound float8 GEMM: {got:.4e} s, expected {expected:.4e} s (1-byte operands, "
        "a 2-byte output, 5 B an operand element of casts)"
    )


def test_estimate_prices_fp8_and_says_so() -> None:
    config = dataclasses.replace(_llama(FP8Config("tensorwise")), num_layers=2)
    layout = Layout(tensor_parallel_size=4, config=config, source="fp8")
    result = estimate(layout, measure=False, cluster="h100-80gb")
    shape = config.activation_shape(layout_at(4), 1)
    row = result.row(True, "none")
    assert row.formula_bytes_per_layer == activation_bytes_per_layer(shape, "none")
    bf16 = estimate(dataclasses.replace(layout, config=_llama(None)), measure=False,
                    cluster="h100-80gb")  # fmt: skip
    assert row.iteration_seconds < bf16.row(True, "none").iteration_seconds
    assert "FP8 tensorwise: the layers' linear GEMMs at 1979 TFLOP/s" in format_table(result)
    with pytest.raises(ConfigError, match=r"^fp8.recipe='tensorwise' on cluster a100-80gb: it "
                       r"has no FP8 GEMMs"):  # fmt: skip
        estimate(layout, measure=False, cluster="a100-80gb")


def test_layer_time_prices_the_experts_in_fp8_and_keeps_the_router_bf16() -> None:
    """A mixture of experts under ``fp8``: the experts' grouped GEMMs (a batch of ``E/e``,
    each expert its own float8 linear) at the FP8 peak with their casts, the router at BF16."""
    from lightning_sp.model.moe.config import MoEConfig

    moe = MoEConfig(num_experts=8, top_k=2, expert_ffn_size=14336)

    def shape(fp8: FP8Config | None) -> ActivationShape:
        config = dataclasses.replace(_llama(fp8), feed_forward="moe", moe=moe)
        return config.activation_shape(layout_at(4, e=2, etp=4), 1)

    cluster = dataclasses.replace(
        H100, execution=dataclasses.replace(H100.execution, expert_load_imbalance=1.0)
    )
    slow, fast = layer_time(shape(None), cluster), layer_time(shape(FP8Config("rowwise")), cluster)
    gemms = [g for g in layer_gemms(shape(FP8Config("rowwise"))) if not g.tag]
    router = next(g for g in gemms if g.name == "router")
    experts = [g for g in gemms if g.name.startswith("expert_")]
    assert router.high_precision and all(not g.high_precision for g in experts), gemms
    assert all(g.batch == 4 for g in experts), "E/e = 4 experts on a rank: a batch of 4 GEMMs"
    expected = gemm_seconds(cluster, router) + sum(
        fp8_gemm_seconds(cluster, g) for g in gemms if g is not router
    )
    assert fast.forward["gemm"] == pytest.approx(expected), "router BF16, the rest FP8"
    assert slow.forward["gemm"] == pytest.approx(sum(gemm_seconds(cluster, g) for g in gemms))
    assert fast.forward["gemm"] < slow.forward["gemm"], "the experts' GEMMs got no faster"
