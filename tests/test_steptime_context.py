"""Context parallelism in the planner: the step-time terms of CP (local GEMMs, the CP core's
pairs and replay, its K/V all-gather / reduce-scatter) against hand calculations, the
hardware FLOPs it adds, the estimate's checks and the search over c."""

from __future__ import annotations

import dataclasses
import os

import pytest

from lightning_sp import ConfigError, GPTConfig
from lightning_sp.cli.estimate import read_estimate_args
from lightning_sp.memory.flops import hardware_flops_per_iteration, model_flops_per_iteration
from lightning_sp.planner.estimate import estimate
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.ops import (
    CP_CORE,
    attention_pairs,
    cp_key_lengths,
    layer_gemms,
    layer_memory_ops,
)
from lightning_sp.planner.presets import A100_80GB, H100_80GB
from lightning_sp.planner.search import search
from lightning_sp.planner.steptime import layer_time, step_time

from cli_runs import ROOT
from models import layout_at, shape_at

# a small Llama-like block: GQA (8 query heads, 2 KV groups), SwiGLU, s = 4096
LLAMA = GPTConfig.of(
    "llama", vocab_size=1000, seq_length=4096, hidden_size=1024, num_layers=8, num_heads=8,
    num_query_groups=2, ffn_hidden_size=2816, sequence_parallel=True,
)  # fmt: skip
GPT = GPTConfig(
    vocab_size=1000, seq_length=2048, hidden_size=1024, num_layers=8, num_heads=16,
    sequence_parallel=True,
)  # fmt: skip


def layout(config: GPTConfig, t: int, c: int, d: int = 1, **kw: object) -> Layout:
    return Layout(
        config=config, tensor_parallel_size=t, context_parallel_size=c, data_parallel_size=d,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_cp_gemms_and_kernels_are_the_local_tokens() -> None:
    """Under c every token GEMM has s·b/c rows; the core is rank 0's two chunks (L and s
    keys), (2c+1)·L² pairs per head; the memory-bound kernels shrink by c."""
    s, b, t = GPT.seq_length, 2, 2
    one = {g.name: g for g in layer_gemms(shape_at(GPT, t, b))}
    for c in (2, 4):
        chunk = s // (2 * c)
        assert cp_key_lengths(s, c) == (chunk, s)
        assert attention_pairs(s, c) == (2 * c + 1) * chunk * chunk
        gemms = {g.name: g for g in layer_gemms(shape_at(GPT, t, b, c=c))}
        for name in ("qkv", "projection", "fc1", "fc2"):
            assert gemms[name].m * c == one[name].m and gemms[name].flops * c == one[name].flops
        core = [g for g in gemms.values() if g.tag == CP_CORE]
        assert len(core) == 4 and all(g.m == chunk for g in core)
        d, heads = GPT.head_dim, b * GPT.num_heads // t
        assert sum(g.flops for g in core) == 4 * attention_pairs(s, c) * d * heads
        plain = {
            op.name: op for op in layer_memory_ops(shape_at(GPT, t, b, sequence_parallel=True))
        }
        local = {
            op.name: op for op in layer_memory_ops(shape_at(GPT, t, b, c=c, sequence_parallel=True))
        }
        assert local["layernorm"].forward_bytes * c == plain["layernorm"].forward_bytes
        pairs = attention_pairs(s, c) / (s * s)
        assert local["softmax"].forward_bytes == pytest.approx(
            plain["softmax"].forward_bytes * pairs
        )
    assert attention_pairs(s, 1) == s * s


def test_cp_exchange_by_hand() -> None:
    """Forward one all-gather of this TP rank's K and V (the KV groups only), backward an
    all-gather and a reduce-scatter of the same size; over NVLink while t·c fits a node."""
    s, b, d = LLAMA.seq_length, 2, LLAMA.head_dim
    for t, c, within in ((2, 2, True), (2, 4, True), (4, 4, False), (8, 2, False)):
        kv_heads = max(LLAMA.groups, t) // t
        gathered = 2 * 2 * b * kv_heads * s * d  # bytes: K and V, bf16, the whole sequence
        one = (c - 1) / c * gathered / A100_80GB.link_rate(within)
        layer = layer_time(shape_at(LLAMA, t, b, c=c), A100_80GB)
        assert layer.forward["cp"] == pytest.approx(one)
        assert layer.backward["cp"] == pytest.approx(2 * one)
    assert layer_time(shape_at(LLAMA, 2, b), A100_80GB).forward["cp"] == 0.0


def test_cp_core_replays_itself_whatever_the_policy() -> None:
    """``core_attn`` replays nothing under CP (the model leaves the CP core alone), and the
    core's backward holds its own forward: sdpa 1 + 2.5 forwards, math the forward GEMMs and
    softmax / dropout again on top of their gradients."""
    b, t, c = 1, 2, 2
    for attention in ("math", "sdpa"):
        config = dataclasses.replace(GPT, attention=attention)
        layer = layer_time(shape_at(config, t, b, c=c), A100_80GB)
        assert layer.replays["core_attn"] == 0.0
        assert layer.recompute_seconds("selective", attention) == 0.0
        assert layer.recompute_seconds("full", attention) == sum(layer.forward.values())
    sdpa = layer_time(shape_at(dataclasses.replace(GPT, attention="sdpa"), t, b, c=c), H100_80GB)
    assert sdpa.backward["attention"] == pytest.approx(3.5 * sdpa.forward["attention"])
    math_cp = layer_time(shape_at(GPT, t, b, c=c), A100_80GB)
    assert math_cp.backward["attention"] > math_cp.forward["attention"] * 2


def test_hardware_flops_add_the_cp_core_replay() -> None:
    """Under CP every layer redoes its core forward (4·B·s²·h, the paper's count) whatever the
    policy; ``core_attn`` adds nothing on top (math), ``full`` adds the layer besides."""
    batch, s, h, layers = 4, GPT.seq_length, GPT.hidden_size, GPT.num_layers
    model = model_flops_per_iteration(GPT, batch)
    core = 4.0 * batch * s * s * h * layers
    for policy in ("none", "selective"):
        config = dataclasses.replace(GPT, recompute=policy)
        assert hardware_flops_per_iteration(config, batch, context_parallel_size=2) == (
            pytest.approx(model + core)
        )
    full = dataclasses.replace(GPT, recompute="full")
    assert hardware_flops_per_iteration(full, batch, context_parallel_size=4) == pytest.approx(
        hardware_flops_per_iteration(full, batch) + core
    )


def test_step_time_under_cp() -> None:
    """The iteration's ``cp`` part is the layers' exchanges; tokens per second count whole
    sequences; the gradient reduction runs over dp x cp."""
    cluster = H100_80GB
    base = dataclasses.replace(LLAMA, attention="sdpa")
    two = layout(base, t=2, c=2, d=2, num_microbatches=2)
    timed = step_time(two, cluster)
    layer = timed.layer
    assert timed.parts["cp"] == pytest.approx(
        2 * base.num_layers * (layer.forward["cp"] + layer.backward["cp"])
    )
    assert timed.tokens_per_second == pytest.approx(
        two.global_batch_size * base.seq_length / timed.iteration_seconds
    )
    one = step_time(layout(base, t=2, c=1, d=4, num_microbatches=1), cluster)
    assert one.parts["cp"] == 0.0
    # same GPUs and global batch: each CP rank runs half of every sequence's layer GEMMs
    assert layer.forward["gemm"] < one.layer.forward["gemm"]


def test_estimate_checks_and_divides_by_c() -> None:
    """2c must divide the sequence (one line naming the field); the per-layer bytes divide
    by c (sdpa: all of them; the logsumexp goes too)."""
    with pytest.raises(ConfigError, match=r"context_parallel_size=3: seq_length=4096 .* 2c = 6"):
        estimate(layout(LLAMA, t=1, c=3), measure=False)
    rows = {}
    for c in (1, 4):
        result = estimate(layout(LLAMA, t=2, c=c), measure=False)
        rows[c] = {(r.sequence_parallel, r.recompute): r for r in result.rows}
    for key, row in rows[4].items():
        assert row.formula_bytes_per_layer <= rows[1][key].formula_bytes_per_layer / 4 + 1
        assert row.model_state_bytes == rows[1][key].model_state_bytes  # CP shards no weight


def test_search_ranks_context_parallel_layouts() -> None:
    """c is a searched dimension: c > 1 layouts are ranked, each with 2c dividing s and
    t·c·p·d the GPUs (s = 24600 = 8·3075: c = 8 would need 16 | s)."""
    config = dataclasses.replace(LLAMA, seq_length=24600, attention="sdpa", num_layers=4)
    base = Layout(config=config, data_parallel_size=16, num_microbatches=1)
    found = search(base, H100_80GB, 20e9, max_micro_batch=1)
    sizes = {x.layout.context_parallel_size for x in found.ranked}
    assert {2, 4} <= sizes and 8 not in sizes
    for x in found.ranked:
        lay = x.layout
        assert lay.world_size == 16 and x.context_parallel_size == lay.context_parallel_size
        assert config.seq_length % (2 * lay.context_parallel_size) == 0


def test_estimate_command_at_128k_with_c8(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 23's command (on 256 GPUs: t·p·c = 8·4·8): a layout line with c = 8 and some
    row that fits 80 GB."""
    from lightning_sp.cli.estimate import main

    args = [
        "--config", os.path.join(ROOT, "configs", "llama3_70b.yaml"),
        "--model.config.seq_length", "131072",
        "--trainer.strategy.init_args.context_parallel_size", "8",
        "--trainer.num_nodes", "32", "--cluster", "h100-80gb", "--formula_only", "true",
    ]  # fmt: skip
    assert main(read_estimate_args, args) == 0
    out = capsys.readouterr().out
    assert "layout: t=8 p=4 m=5 c=8 d=1 on 256 GPUs" in out
    assert " yes " in out and "34sbh/(t*c)" in out


def test_auto_considers_c() -> None:
    """``recompute: auto`` resolves against the layout's c: at a long sequence on a small
    device c = 1 needs ``full`` on some layers while c = 4 fits without recomputation."""
    from lightning_sp.parallel.config import ParallelConfig
    from lightning_sp.planner.estimate import resolve_recompute

    config = dataclasses.replace(LLAMA, seq_length=32768, attention="sdpa")
    one, four = (
        resolve_recompute(
            config,
            ParallelConfig(tensor_parallel_size=2, context_parallel_size=c),
            device_bytes=2.5e9,
            measure=False,
            cluster=H100_80GB,
        )
        for c in (1, 4)
    )
    assert one.fits and one.recompute == "full"
    assert four.fits and (four.recompute, four.recompute_num_layers) == ("none", None)


def test_gradient_reduction_and_optimizer_shards_run_over_d_times_c() -> None:
    """t = 2, c = 2, d = 4 on 16 GPUs (two nodes): the step's gradient all-reduce runs over the
    d·c = 8 ranks of dp x cp, 4 in each node (t apart), across the network through the 4
    members' adapters (:func:`~lightning_sp.planner.kernels.spread_gather_seconds`: a
    reduce-scatter and an all-gather), all of it exposed without ``overlap_grad_reduce``; the
    distributed optimizer shards its state over d·c (memory and optimizer time)."""
    from lightning_sp.memory.model_state import (
        MIXED_PRECISION_ADAM,
        model_state_bytes,
        parameters_per_rank,
    )
    from lightning_sp.planner.kernels import memory_seconds, spread_gather_seconds

    config = dataclasses.replace(LLAMA, attention="sdpa", recompute="none")
    lay = layout(config, t=2, c=2, d=4)
    # overlapped, the 4 adapters per node take the reduction under the last backward; the
    # whole of it is priced when nothing overlaps it
    timed = step_time(dataclasses.replace(lay, overlap_grad_reduce=False), H100_80GB)
    params = parameters_per_rank(config, layout_at(2))
    reduce = 2 * spread_gather_seconds(H100_80GB, 4 * params, 8, members_in_node=4)
    assert timed.parts["dp_exposed"] == pytest.approx(reduce, rel=1e-12), (
        f"gradient all-reduce: {timed.parts['dp_exposed']:.6f} s exposed, over d·c = 8 ranks it "
        f"is {reduce:.6f} s"
    )
    zero = dataclasses.replace(lay, distributed_optimizer=True)
    state = estimate(zero, measure=False).rows[0].model_state_bytes
    want = round(model_state_bytes(params, MIXED_PRECISION_ADAM, 8, distributed_optimizer=True))
    assert state == want, (
        f"distributed optimizer at d=4, c=2: {state} B of model state per rank, sharded over "
        f"d·c = 8 ranks it is {want} B"
    )
    optimizer = step_time(zero, H100_80GB).parts["optimizer"]
    assert optimizer == pytest.approx(memory_seconds(H100_80GB, 8 * params + 30 * params / 8)), (
        "the distributed optimizer's step must cover a 1/(d·c) shard"
    )
