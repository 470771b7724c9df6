"""The memory formulas at hand-computed values, and the fake-tensor measurement against them
and against a real run.

Table 2 values are written out by hand for GPT-3 175B (s=2048, b=1, h=12288, a=96, t=8,
sbh = 25,165,824, as/h = 16). The measurement traces one rank's shard of the real ``GPT`` under
``FakeTensorMode`` and a fake process group; it must count exactly what a real run counts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from lightning_sp import GPT, GPTConfig, ParallelState, SavedTensorTracker
from lightning_sp.memory.fake import measure_activations
from lightning_sp.memory.formulas import (
    CONTEXT_GENERATOR_STATE_BYTES,
    TABLE2_ROWS,
    activation_bytes_per_layer,
    chunk_forwards_in_flight,
    dropped_bytes_per_layer,
    embedding_activation_bytes,
    extra_activation_bytes,
    figure7_percentages,
    first_stage_activation_bytes,
    interleave_factor,
    layer_saved_terms,
    layernorm_stats_bytes_per_layer,
    layers_in_flight,
    output_activation_bytes,
    table2_bytes_per_layer,
    table2_row,
)
from lightning_sp.model.recompute import PRESETS, RECOMPUTE_MODULES
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.config import ParallelConfig

from models import feed_forward_terms, layout_at, small_config

S, B, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * B * H

# Table 2 for GPT-3 175B at t=8, in units of sbh, computed by hand: 5as/h = 80, 5as/(ht) = 10
TABLE2_175B = {
    "no_parallelism": 34 + 80,  # sbh(34 + 5as/h)
    "tensor_parallel": 10 + 3 + 10,  # sbh(10 + 24/t + 5as/(ht))
    "tensor_sequence_parallel": 4.25 + 10,  # sbh(34/t + 5as/(ht))
    "tensor_parallel_selective": 10 + 3,  # sbh(10 + 24/t)
    "tensor_sequence_parallel_selective": 4.25,  # 34sbh/t
    "full_recompute": 2,  # 2sbh
}


@pytest.mark.parametrize("row", TABLE2_ROWS)
def test_table2_rows_at_hand_computed_values(row: str) -> None:
    assert table2_bytes_per_layer(row, S, B, H, A, T) == TABLE2_175B[row] * SBH


def test_table2_row_names_and_shape_record() -> None:
    assert table2_row(False, "none", 1) == "no_parallelism"
    assert table2_row(False, "none", 8) == "tensor_parallel"
    assert table2_row(True, "selective", 8) == "tensor_sequence_parallel_selective"
    assert table2_row(True, "full", 8) == "full_recompute"
    shape = ActivationShape(S, B, H, A, T, sequence_parallel=True)
    assert activation_bytes_per_layer(shape, "none") == 14.25 * SBH
    assert activation_bytes_per_layer(shape, "full") == 2 * SBH / T
    # the record from a GPTConfig carries every field the formulas read
    config = GPTConfig(vocab_size=51200, seq_length=S, hidden_size=H, num_layers=96,
                       num_heads=A, sequence_parallel=True)  # fmt: skip
    assert config.activation_shape(layout_at(T), B) == shape


def test_generalised_to_dtype_mask_size_and_ffn_width() -> None:
    s, b, h, a = 128, 2, 64, 4
    sbh, as2b = s * b * h, a * s * s * b
    x = ActivationShape(s, b, h, a)
    # fp32 activations (e = 4): outside 4e + 2 masks = 18, inside 4e + 2e·4 = 48, scores 2e+1 = 9
    got = activation_bytes_per_layer(dataclasses.replace(x, activation_bytes=4))
    assert got == 66 * sbh + 9 * as2b
    # bit-packed masks (1/8 byte): 8 + 2/8 outside, scores 4 + 1/8
    got = activation_bytes_per_layer(dataclasses.replace(x, mask_bytes=0.125))
    assert got == 8.25 * sbh + 24 * sbh + 4.125 * as2b
    # MLP width 2h: GeLU and fc2 inputs 2·2·2 = 8 instead of 16
    assert activation_bytes_per_layer(dataclasses.replace(x, f=2 * h)) == (10 + 16) * sbh + (
        5 * as2b
    )
    # no dropout: no masks, and the softmax output is what multiplies V (2as²b)
    no_dropout = dataclasses.replace(x, hidden_dropout=False, attention_dropout=False)
    assert activation_bytes_per_layer(no_dropout) == (8 + 24) * sbh + 2 * as2b
    # t and sequence parallelism apply to the generalised terms as in Table 2
    fp32_sp4 = dataclasses.replace(x, t=4, sequence_parallel=True, activation_bytes=4)
    assert activation_bytes_per_layer(fp32_sp4, "selective") == (18 + 48) * sbh / 4
    assert activation_bytes_per_layer(dataclasses.replace(x, activation_bytes=4), "full") == (
        4 * sbh
    )


def test_recompute_modules_drop_their_terms() -> None:
    """lean = 34 - 4 (LayerNorm outputs) - 8 (GeLU output) - 2 (masks) = 20 sbh/t with TP+SP;
    each module's drop is its descriptor's terms; a module list equals the matching preset."""
    sp = ActivationShape(S, B, H, A, T, sequence_parallel=True)
    assert activation_bytes_per_layer(sp, "lean") == 20 * SBH / T
    assert dropped_bytes_per_layer(sp, "layernorm") == 4 * SBH / T
    assert dropped_bytes_per_layer(sp, "mlp_act") == 8 * SBH / T
    assert dropped_bytes_per_layer(sp, "residual_mask") == 2 * SBH / T
    assert dropped_bytes_per_layer(sp, "core_attn") == 80 * SBH / T  # 5as²b/t = 5as/h sbh/t
    assert activation_bytes_per_layer(
        sp, ["core_attn", "layernorm", "mlp_act", "residual_mask"]
    ) == (activation_bytes_per_layer(sp, "lean"))
    assert activation_bytes_per_layer(sp, "layernorm+mlp_act") == (34 + 80 - 12) * SBH / T
    # without SP, the LayerNorm outputs and masks are replicated: lean = 4 + 16/t... + 0 scores
    tp = dataclasses.replace(sp, sequence_parallel=False)
    assert activation_bytes_per_layer(tp, "lean") == (4 + 16 / T) * SBH
    for name in PRESETS["lean"]:  # (mlp_act also names the MoE part's down-projection inputs)
        terms = set(layer_saved_terms(sp)) | feed_forward_terms()
        assert set(RECOMPUTE_MODULES[name].drops) <= terms, name
    # the LayerNorm statistics: 2 LayerNorms x (mean, rstd) per row, none once recomputed
    assert layernorm_stats_bytes_per_layer(sp, "selective") == 2 * 2 * 2 * S * B / T
    assert layernorm_stats_bytes_per_layer(sp, "lean") == 0


def test_sdpa_bytes_and_core_attn_buys_nothing() -> None:
    """sdpa: Q, K, V 6sbh, its output (the projection's input) 2sbh, fp32 logsumexp 4asb — no
    s x s term; core_attn drops nothing, so selective == none."""
    x = ActivationShape(S, B, H, A, T, sequence_parallel=True, attention="sdpa")
    lse = 4 * A * S * B
    assert activation_bytes_per_layer(x, "none") == 34 * SBH / T + lse / T
    assert activation_bytes_per_layer(x, "selective") == activation_bytes_per_layer(x, "none")
    assert dropped_bytes_per_layer(x, "core_attn") == 0
    assert activation_bytes_per_layer(x, "lean") == 20 * SBH / T + lse / T
    assert activation_bytes_per_layer(x, "full") == 2 * SBH / T


def test_unknown_policy_is_a_config_error() -> None:
    from lightning_sp import ConfigError

    shape = ActivationShape(S, B, H, A)
    with pytest.raises(ConfigError, match="recompute='partial'"):
        activation_bytes_per_layer(shape, "partial")
    with pytest.raises(ConfigError, match="'attn' is not a recompute module"):
        activation_bytes_per_layer(shape, ["attn"])


def test_figure7_formula_percentages() -> None:
    got = figure7_percentages(S, B, H, A, T)
    assert got["tensor_sequence_parallel"] == pytest.approx(100 * 14.25 / 23)
    assert got["tensor_parallel_selective"] == pytest.approx(100 * 13 / 23)
    assert got["tensor_sequence_parallel_selective"] == pytest.approx(100 * 4.25 / 23)
    assert got["full_recompute"] == pytest.approx(100 * 2 / 23)


def test_eq5_and_interleaving() -> None:
    per_layer = 34 * SBH / T
    # eq. 5: whatever p, the first stage holds L layers' worth (p micro-batches of L/p layers)
    for p in (1, 2, 8):
        assert layers_in_flight(96, p, 1, num_microbatches=64) == 96
        assert first_stage_activation_bytes(per_layer, 96, p, 1, 64) == 96 * per_layer
    # interleaved: × (1 + (p-1)/(p·m)); 175B: 96 × (1 + 7/24) = 124, 530B: 105 × (1 + 34/105)
    assert interleave_factor(8, 3) == pytest.approx(1 + 7 / 24)
    assert interleave_factor(8, 1) == 1.0
    assert layers_in_flight(96, 8, 3, num_microbatches=64) == pytest.approx(124)
    assert layers_in_flight(105, 35, 3, num_microbatches=280) == pytest.approx(139)
    # by hand, L = 128: × (1 + 7/24), × (1 + 34/105), × (1 + 3/8), × 1
    for p, m, expected in (
        (8, 3, 128 * 31 / 24),
        (35, 3, 128 * 139 / 105),
        (4, 2, 176),
        (64, 1, 128),
    ):
        assert layers_in_flight(128, p, m, 1024) == pytest.approx(expected)
    # Megatron's interleaved warm-up: 2(p-1) + (m-1)p forwards, plus the one in flight
    assert chunk_forwards_in_flight(8, 3, 64) == 2 * 7 + 2 * 8 + 1
    # fewer micro-batches than stages: only those are in flight
    assert layers_in_flight(96, 8, 1, num_microbatches=2) == 24


def test_section_4_5_extras() -> None:
    v = 51200
    sp = ActivationShape(S, B, H, A, T, sequence_parallel=True)
    # sbhL/t (p/L + δ_{p=1} 4/L (1 + v/h))
    assert extra_activation_bytes(sp, v, 8) == SBH * 8 / T
    assert extra_activation_bytes(sp, v, 1) == pytest.approx(SBH / T + 4 * SBH / T * (1 + v / H))
    tp = dataclasses.replace(sp, sequence_parallel=False)
    assert embedding_activation_bytes(tp) == SBH
    assert output_activation_bytes(tp, v) == 4 * SBH + 4 * S * B * v / T


@pytest.mark.parametrize("attention", ["math", "sdpa"])
@pytest.mark.parametrize("recompute", ["none", "selective", "lean", "full"])
def test_fake_measurement_equals_a_real_run(attention: str, recompute: str) -> None:
    """At t=1 a real forward can run here: the fake trace counts exactly the same bytes
    (sdpa without attention dropout, as the fake measurement traces it)."""
    config = small_config(recompute=recompute, attention=attention)
    if attention == "sdpa":
        config.attention_dropout = 0.0
    b = 2
    model = GPT(config, ParallelState.single(), dtype=torch.bfloat16)
    model.train()
    ids = torch.randint(0, config.vocab_size, (b, config.seq_length))
    with SavedTensorTracker.for_model(model) as tracker:
        out = model.forward_layers(model.embed(ids))
    real = [tracker.report.bytes_of(f"layers.{i}") for i in range(2)]
    del out
    fake = measure_activations(config, micro_batch_size=b, layers=2)
    assert fake.per_layer_bytes == real
    assert fake.embedding_bytes == tracker.report.bytes_of("<untracked>")
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("sequence_parallel", "recompute", "attention"),
    [(sp, rc, "math") for sp in (False, True) for rc in ("none", "selective", "lean", "full")]
    + [(True, "none", "sdpa"), (True, "lean", "sdpa")],
)
def test_fake_measurement_matches_formula_at_t4(
    sequence_parallel: bool, recompute: str, attention: str
) -> None:
    """The fake trace at t=4 is the formula + the LayerNorm statistics, byte for byte."""
    s, b, h, a, t = 256, 2, 256, 8, 4
    config = small_config(
        seq_length=s, hidden_size=h, num_heads=a, num_layers=2, attention=attention
    )
    config = dataclasses.replace(config, sequence_parallel=sequence_parallel, recompute=recompute)
    got = measure_activations(
        config, ParallelConfig(tensor_parallel_size=t), micro_batch_size=b, layers=2
    )
    shape = config.activation_shape(layout_at(t), b)
    if attention == "sdpa":  # traced as the fused kernel, i.e. without the CPU dropout fallback
        shape = dataclasses.replace(shape, attention_dropout=False)
    expected = activation_bytes_per_layer(shape, recompute)
    expected += layernorm_stats_bytes_per_layer(shape, recompute)
    assert got.per_layer_bytes == [expected] * 2
    mask = embedding_activation_bytes(shape)
    # + what the paper neglects: the local token ids (int64) and the out-of-shard mask (bool)
    assert got.embedding_bytes == mask + 9 * s * b


@pytest.mark.parametrize("rest", ["none", "lean"])
def test_fake_measurement_of_a_full_k_model_follows_each_layer(rest: str) -> None:
    """Full on the first layer of the chunk, ``recompute_rest`` on the second: the fake trace
    at t=4 + SP gives each layer its own policy's formula."""
    s, b, h, a, t = 256, 2, 256, 8, 4
    config = small_config(seq_length=s, hidden_size=h, num_heads=a, num_layers=2)
    config = dataclasses.replace(
        config, sequence_parallel=True, recompute="full", recompute_num_layers=1,
        recompute_rest=rest,
    )  # fmt: skip
    got = measure_activations(
        config, ParallelConfig(tensor_parallel_size=t), micro_batch_size=b, layers=2
    )
    shape = config.activation_shape(layout_at(t), b)
    expected = [
        activation_bytes_per_layer(shape, policy) + layernorm_stats_bytes_per_layer(shape, policy)
        for policy in ("full", rest)
    ]
    assert got.per_layer_bytes == expected
    assert expected[0] == 2 * s * b * h / t  # the full layer keeps its input shard only


def test_head_measurement_matches_section_4_5() -> None:
    s, b, h, t = 256, 2, 256, 4
    config = small_config(seq_length=s, hidden_size=h, num_heads=8, num_layers=2, vocab_size=1000)
    for sp in (False, True):
        got = measure_activations(
            dataclasses.replace(config, sequence_parallel=sp),
            ParallelConfig(tensor_parallel_size=t),
            micro_batch_size=b,
            head=True,
        )
        v = config.padded_vocab_size(t)
        shape = ActivationShape(s, b, h, 8, t, sequence_parallel=sp)
        expected = output_activation_bytes(shape, v)
        assert got.head_bytes == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize(
    ("architecture", "c", "t", "recompute", "attention"),
    [("gpt2", 2, 1, "none", "math"), ("gpt2", 4, 2, "selective", "math"),
     ("gpt2", 2, 2, "lean", "math"), ("gpt2", 4, 1, "full", "math"),
     ("gpt2", 2, 2, "selective", "sdpa"), ("llama", 2, 2, "none", "math"),
     ("llama", 4, 1, "selective", "sdpa")],
)  # fmt: skip
def test_fake_measurement_matches_formula_under_cp(
    architecture: str, c: int, t: int, recompute: str, attention: str
) -> None:
    """Context parallelism at c = 2 and 4 (t = 2 with SP): the fake trace of CP rank 0's
    shard, CP core included, is the formula (every term / c, no s x s scores) + the norms'
    statistics + the CP core's generator state with attention dropout, byte for byte (bf16)."""
    s, b, h, a = 128, 2, 64, 4
    extra = {"num_query_groups": 2, "attention_dropout": 0.0} if architecture == "llama" else {}
    config = GPTConfig.of(
        architecture, vocab_size=300, seq_length=s, hidden_size=h, num_heads=a, num_layers=2,
        attention=attention, sequence_parallel=t > 1, recompute=recompute,
        **({"hidden_dropout": 0.1, "attention_dropout": 0.1} | extra),
    )  # fmt: skip
    got = measure_activations(
        config,
        ParallelConfig(tensor_parallel_size=t, context_parallel_size=c),
        micro_batch_size=b,
        layers=2,
    )
    shape = config.activation_shape(layout_at(t, c=c), b)
    if attention == "sdpa":  # traced without attention dropout (see measure_activations)
        shape = dataclasses.replace(shape, attention_dropout=False)
    expected = activation_bytes_per_layer(shape, recompute)
    expected += layernorm_stats_bytes_per_layer(shape, recompute)
    if shape.attention_dropout and recompute != "full":
        expected += CONTEXT_GENERATOR_STATE_BYTES["cpu"]
    assert got.per_layer_bytes == [expected] * 2
    one = activation_bytes_per_layer(config.activation_shape(layout_at(t), b), recompute)
    assert activation_bytes_per_layer(shape, recompute) <= one / c  # the core's scores go


def test_interleaved_in_flight_capped_by_the_steps_chunk_forwards() -> None:
    """Interleaved p = 2, m = 2 with n = p = 2 micro-batches: the warm-up would want
    2(p-1) + (m-1)p + 1 = 5 chunk forwards, but the step has only n·m = 4; L = 8: 4 chunks
    of L/(p·m) = 2 layers, 8 layers' worth (not 10)."""
    got = chunk_forwards_in_flight(2, 2, 2)
    assert got == 4, (
        f"interleaved p = 2, m = 2, n = 2: {got} chunk forwards in flight, the step has 4"
    )
    assert layers_in_flight(8, 2, 2, num_microbatches=2) == 8
    assert chunk_forwards_in_flight(2, 2, 4) == 5, "n = 4: the warm-up's 5"
