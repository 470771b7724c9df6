"""What a training stack overlaps (``lightning_sp.planner.execution``) and the step-time terms
it changes, against hand calculations: data-parallel rings through a node's adapters, TP
collectives pipelined with their GEMMs, the parameter all-gather beside the first forward,
pipeline transfers beside the next chunk, an imbalanced router's busiest rank; the cross
entropy's bytes, the causal-half FLOP count and what ``estimate`` and ``--search`` print of
them."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from lightning_sp import ConfigError, GPTConfig
from lightning_sp.memory.flops import (
    attention_core_flops_per_iteration,
    causal_half_model_flops_per_iteration,
    model_flops_per_iteration,
)
from lightning_sp.memory.model_state import parameters_per_rank
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.planner.execution import MEGATRON_CORE_OVERLAPS, Execution
from lightning_sp.planner.kernels import gather_seconds, gemm_seconds, spread_gather_seconds
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.ops import head_memory_ops, layer_gemms, layer_memory_ops
from lightning_sp.planner.presets import A100_80GB, H100_80GB, H100_REALISED, SELENE, load_cluster
from lightning_sp.planner.steptime import layer_time, step_time

from models import layout_at, shape_at

NVLINK = H100_80GB.nvlink_bandwidth * H100_80GB.nvlink_efficiency
NETWORK = H100_80GB.network_bandwidth * H100_80GB.network_efficiency
GPT = GPTConfig(
    vocab_size=1000, seq_length=1024, hidden_size=1024, num_layers=8, num_heads=16,
    attention="sdpa", recompute="none", sequence_parallel=True,
)  # fmt: skip
OVERLAPPED = dataclasses.replace(H100_80GB, execution=MEGATRON_CORE_OVERLAPS)


def test_data_parallel_ring_through_the_nodes_adapters_by_hand() -> None:
    """A ring over 48 ranks, 8 in each of 6 nodes: every member passes 47/48 of the tensor
    along the ring; the ring's hops between nodes run on the node's 8 adapters side by side
    (NCCL's channels striped over them), so the ring runs at the slower of NVLink (365.6
    GB/s) and 8 x 40 GB/s. One member per node is the plain ring over the network; one node,
    NVLink alone; 2 members per node, 80 GB/s."""
    n = 1e9
    assert spread_gather_seconds(H100_80GB, n, 48, 8) == pytest.approx(
        47 / 48 * n / min(NVLINK, 8 * NETWORK), rel=1e-12
    )
    assert spread_gather_seconds(H100_80GB, n, 48, 8) == pytest.approx(
        47 / 48 * n / 320e9, rel=1e-12
    )
    assert spread_gather_seconds(H100_80GB, n, 16, 2) == pytest.approx(
        15 / 16 * n / 80e9, rel=1e-12
    )
    assert spread_gather_seconds(H100_80GB, n, 48, 1) == pytest.approx(
        gather_seconds(H100_80GB, n, 48, False), rel=1e-12
    )
    assert spread_gather_seconds(H100_80GB, n, 8, 8) == pytest.approx(
        gather_seconds(H100_80GB, n, 8, True), rel=1e-12
    )
    assert spread_gather_seconds(H100_80GB, n, 1, 1) == 0.0


def test_distributed_optimizer_reduction_by_hand() -> None:
    """t = 2, d = 16 (4 ranks of each DP group per node): the distributed optimizer's fp32
    reduce-scatter through 4 adapters, overlapped with the last micro-batch's backward, and
    its bf16 all-gather: exposed after the step by default, beside the next iteration's first
    forward with ``param_gather_overlap``."""
    layout = Layout(config=GPT, tensor_parallel_size=2, data_parallel_size=16,
                    accumulate_grad_batches=4, distributed_optimizer=True)  # fmt: skip
    params = parameters_per_rank(GPT, layout_at(2))
    reduce = spread_gather_seconds(H100_80GB, 4 * params, 16, 4)
    gather = spread_gather_seconds(H100_80GB, 2 * params, 16, 4)
    plain = step_time(layout, H100_80GB)
    backward = GPT.num_layers * sum(plain.layer.backward.values())
    assert plain.parts["dp_exposed"] == pytest.approx(max(0.0, reduce - backward) + gather)
    run = dataclasses.replace(H100_80GB, execution=Execution(param_gather_overlap=True))
    over = step_time(layout, run)
    forward = GPT.num_layers * sum(over.layer.forward.values())
    assert over.parts["dp_exposed"] == pytest.approx(
        max(0.0, reduce - backward) + max(0.0, gather - forward)
    )
    assert over.iteration_seconds < plain.iteration_seconds


def test_tensor_parallel_overlap_by_hand() -> None:
    """With SP at t = 4: each forward all-gather (before qkv, fc1) and reduce-scatter (after
    projection, fc2), and backward's gathers of the gradient entering projection and fc2, sit
    beside their GEMM: ``max(0, C - G) + min(C, G)/t`` each; the backward's bulk overlaps
    (re-gather beside dgrad, reduce-scatter beside wgrad) stay as they were."""
    t, b = 4, 2
    unit = gather_seconds(H100_80GB, 2 * 1024 * b * 1024, t, True)
    gemms = {g.name: g for g in layer_gemms(shape_at(GPT, t, b))}
    fwd = {n: gemm_seconds(H100_80GB, g) for n, g in gemms.items()}
    from lightning_sp.planner.ops import backward_gemms

    dgrad = {n: gemm_seconds(H100_80GB, backward_gemms(g)[0]) for n, g in gemms.items()}
    wgrad = {n: gemm_seconds(H100_80GB, backward_gemms(g)[1]) for n, g in gemms.items()}

    def beside(g: float) -> float:
        return max(0.0, unit - g) + min(unit, g) / t

    plain, over = (layer_time(shape_at(GPT, t, b), c) for c in (H100_80GB, OVERLAPPED))
    assert plain.forward["tp"] == pytest.approx(4 * unit)
    assert over.forward["tp"] == pytest.approx(
        sum(beside(fwd[n]) for n in ("qkv", "projection", "fc1", "fc2"))
    )
    bulk = sum(max(0, unit - dgrad[n]) + max(0, unit - wgrad[n]) for n in ("qkv", "fc1"))
    assert plain.backward["tp"] == pytest.approx(2 * unit + bulk)
    assert over.backward["tp"] == pytest.approx(
        beside(dgrad["projection"]) + beside(dgrad["fc2"]) + bulk
    )
    assert over.forward["gemm"] == plain.forward["gemm"]  # the overlap moves no GEMM time
    assert MEGATRON_CORE_OVERLAPS.overlapped(1.0, 3.0, 4) == pytest.approx(0.25)
    assert MEGATRON_CORE_OVERLAPS.overlapped(3.0, 1.0, 4) == pytest.approx(2.25)
    assert Execution().overlapped(3.0, 1.0, 4) == 3.0


def test_pipeline_transfers_beside_the_next_chunk() -> None:
    """Interleaved (m = 2): with ``pipeline_overlap`` each transfer hides behind a chunk's
    forward (here longer than the transfer, so none is exposed); non-interleaved (m = 1) the
    transfers stay exposed, as Megatron's 1F1B batches them."""
    base = Layout(config=GPT, tensor_parallel_size=2, pipeline_parallel_size=2,
                  num_microbatches=4, data_parallel_size=4)  # fmt: skip
    inter = dataclasses.replace(base, virtual_pipeline_size=2)
    run = dataclasses.replace(H100_80GB, execution=Execution(pipeline_overlap=True))
    assert step_time(inter, H100_80GB).parts["p2p"] > 0
    assert step_time(inter, run).parts["p2p"] == 0.0
    assert step_time(base, run).parts["p2p"] == step_time(base, H100_80GB).parts["p2p"] > 0


MOE = GPTConfig.of(
    "mistral", vocab_size=1000, seq_length=1024, hidden_size=256, num_layers=4, num_heads=4,
    num_query_groups=2, feed_forward="moe", sequence_parallel=False, recompute="none",
    moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_size=512),
)  # fmt: skip


def test_imbalanced_router_slows_the_busiest_rank() -> None:
    """``expert_load_imbalance`` 1.5 at e = 8: the routed GEMMs get 1.5x the rows, the routed
    kernels move 1.5x the bytes and the all-to-all 1.5x as long; attention, the router and
    the norms are untouched; model FLOPs (MFU's numerator) do not change."""
    skew = dataclasses.replace(H100_80GB, execution=Execution(expert_load_imbalance=1.5))
    even, busy = (layer_time(shape_at(MOE, 1, 1, e=8), c) for c in (H100_80GB, skew))
    gemms = {g.name: g for g in layer_gemms(shape_at(MOE, 1, 1, e=8))}
    routed = [g for g in gemms.values() if g.routed]
    assert {g.name for g in routed} == {"expert_gate_up", "expert_down"}
    extra = sum(
        gemm_seconds(H100_80GB, dataclasses.replace(g, m=math.ceil(1.5 * g.m)))
        - gemm_seconds(H100_80GB, g)
        for g in routed
    )
    assert busy.forward["gemm"] - even.forward["gemm"] == pytest.approx(extra, rel=1e-9)
    ops = layer_memory_ops(shape_at(MOE, 1, 1, e=8))  # the shape layer_time priced
    routed_bytes = sum(op.forward_bytes for op in ops if op.routed)
    assert {op.name for op in ops if op.routed} == {
        "expert_act", "expert_dispatch", "expert_combine",
    }  # fmt: skip
    assert busy.forward["memory"] - even.forward["memory"] == pytest.approx(
        0.5 * routed_bytes / H100_80GB.memory_rate, rel=1e-9
    )
    assert busy.forward["ep"] == pytest.approx(1.5 * even.forward["ep"], rel=1e-12)
    assert busy.forward["attention"] == even.forward["attention"]
    layout = Layout(config=MOE, data_parallel_size=8, expert_parallel_size=8)
    assert (
        step_time(layout, skew).model_tflops_per_gpu
        < step_time(layout, H100_80GB).model_tflops_per_gpu
    )


def test_execution_is_checked_and_read_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(
        "base: h100-80gb\nexecution:\n  tensor_parallel_overlap: true\n"
        "  param_gather_overlap: true\n  expert_load_imbalance: 1.2\n"
    )
    cluster = load_cluster(str(path))
    assert cluster.execution == Execution(True, True, False, 1.2)
    for text, fragment in (
        ("execution:\n  tp_overlap: true\n", "unknown key execution.tp_overlap"),
        ("execution:\n  expert_load_imbalance: 0.5\n", "expert_load_imbalance=0.5"),
        ("execution:\n  expert_load_imbalance: .nan\n", "expert_load_imbalance=nan"),
        ("execution:\n  param_gather_overlap: 1\n", "param_gather_overlap=1"),
        ("execution: [1]\n", "execution must be a mapping"),
    ):
        path.write_text("base: h100-80gb\n" + text)
        with pytest.raises(ConfigError) as info:
            load_cluster(str(path))
        assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_realised_h100_is_table4s_ratio_carried_over() -> None:
    """``h100-realised``: the H100's best-shape GEMM rate times what the paper's Table 4
    realised of A100's (selene's 0.703 of a100-80gb's 0.859); every other figure the H100's."""
    ratio = SELENE.gemm_efficiency / A100_80GB.gemm_efficiency
    assert H100_REALISED.gemm_efficiency == pytest.approx(H100_80GB.gemm_efficiency * ratio)
    assert H100_REALISED.gemm_efficiency == pytest.approx(0.656, abs=0.001)
    assert (
        dataclasses.replace(
            H100_REALISED, name="h100-80gb", gemm_efficiency=H100_80GB.gemm_efficiency
        )
        == H100_80GB
    )


def test_cross_entropy_bytes_by_hand() -> None:
    """The vocab-parallel cross entropy's passes over the ``s·b·v/t`` fp32 logits: forward
    cast 6 + max 4 + shift 8 + exp 8 + sum 4 + normalise 8 = 38 bytes, backward clone 8 +
    scale 8 + cast back 6 = 22."""
    t, b = 2, 2
    logits = 1024 * b * GPT.padded_vocab_size(t) / t
    ce = {op.name: op for op in head_memory_ops(GPT, t, b, True)}["cross_entropy"]
    assert (ce.forward_bytes, ce.backward_bytes) == (38 * logits, 22 * logits)


def test_causal_half_flops_by_hand() -> None:
    """GPT (f = 4h): ``72BsLh²(1 + s/(12h) + v/(12hL))`` counted with causal attention at half,
    against ``72BsLh²(1 + s/(6h) + v/(12hL))`` whole; the cores are ``12·B·s²·h·L``."""
    config = dataclasses.replace(GPT, vocab_size=51200, seq_length=2048, hidden_size=2048)
    B, s, L, h, v = 8, 2048, 8, 2048, 51200
    base = 72 * B * s * L * h * h
    assert model_flops_per_iteration(config, B) == pytest.approx(
        base * (1 + s / (6 * h) + v / (12 * h * L)), rel=1e-12
    )
    assert causal_half_model_flops_per_iteration(config, B) == pytest.approx(
        base * (1 + s / (12 * h) + v / (12 * h * L)), rel=1e-12
    )
    assert attention_core_flops_per_iteration(config, B) == pytest.approx(12 * B * s * s * h * L)


def test_estimate_prints_both_conventions(capsys: pytest.CaptureFixture[str]) -> None:
    """The table's ½causal columns and the JSON's ``_causal_half`` keys, in the ratio of the
    two counts; an MoE model's header names its active parameters."""
    from lightning_sp.cli.estimate import main as report_main
    from lightning_sp.cli.estimate import read_estimate_args

    from cli_runs import ROOT

    config = str(Path(ROOT) / "configs" / "tiny.yaml")
    assert report_main(read_estimate_args, ["--config", config, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    layout = read_estimate_args(["--config", config]).layout
    ratio = causal_half_model_flops_per_iteration(
        layout.config, layout.global_batch_size
    ) / model_flops_per_iteration(layout.config, layout.global_batch_size)
    for row in rows:
        assert row["mfu_causal_half"] == pytest.approx(row["mfu"] * ratio, rel=1e-12)
        assert row["model_tflops_per_gpu_causal_half"] == pytest.approx(
            row["model_tflops_per_gpu"] * ratio, rel=1e-12
        )
    assert report_main(read_estimate_args, ["--config", config]) == 0
    table = capsys.readouterr().out
    assert "½causal" in table and "Megatron-LM since 2025" in table
    moe = str(Path(ROOT) / "configs" / "moe_tiny.yaml")
    assert report_main(read_estimate_args, ["--config", moe, "--formula_only", "true"]) == 0
    assert "active per token" in capsys.readouterr().out


def test_search_shows_the_margin_to_the_first(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_sp.planner.search import format_search, search

    layout = Layout(config=GPT, tensor_parallel_size=2, data_parallel_size=4)
    found = search(layout, H100_80GB, 80e9, max_micro_batch=1)
    text = format_search(found, 5)
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("rank"))
    assert header.rstrip().endswith("vs 1st")
    first = next(line for line in lines if line.lstrip().startswith("1 "))
    assert first.rstrip().endswith("+0.0%")
    second = found.ranked[1].row.iteration_seconds / found.ranked[0].row.iteration_seconds - 1
    assert f"the first two are {second:.1%} apart" in text


def test_pipeline_overlap_hides_behind_a_whole_chunk_by_hand() -> None:
    """Interleaved over two nodes (t = 1, p = 2, m = 2, d = 8: 16 GPUs), h = 256, b = 8: a
    boundary send of ``2sbh`` bytes over the network outlasts one layer's forward but hides
    behind the next chunk's L/(p·m) = 2 layers: per iteration ``n · 2m · max(0, send - 2 ·
    layer forward)`` exposed, the send by hand from the network's rate."""
    cfg = dataclasses.replace(GPT, hidden_size=256, num_heads=4)
    layout = Layout(config=cfg, pipeline_parallel_size=2, virtual_pipeline_size=2,
                    num_microbatches=4, data_parallel_size=8, micro_batch_size=8)  # fmt: skip
    assert layout.world_size > H100_80GB.gpus_per_node, "the case needs two nodes"
    run = dataclasses.replace(H100_80GB, execution=Execution(pipeline_overlap=True))
    send = 2 * cfg.seq_length * 8 * cfg.hidden_size / NETWORK  # bf16 [s, b, h], between nodes
    forward = sum(step_time(layout, run).layer.forward.values())
    chunk = cfg.num_layers // (2 * 2)
    assert send > forward, "the case needs a send longer than one layer's forward"
    expected = 4 * 2 * 2 * max(0.0, send - chunk * forward)
    got = step_time(layout, run).parts["p2p"]
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), (
        f"interleaved pipeline_overlap: exposed p2p {got:.3e} s, expected {expected:.3e} s "
        f"(each send beside the next chunk's {chunk} layers' forward, not one layer's)"
    )


def test_pipeline_transfers_per_iteration_by_hand() -> None:
    """1F1B over one node (t = 2 with SP, p = 2, d = 2), n = 4 micro-batches: per micro-batch
    one forward and one backward send of the ``2sbh/t``-byte boundary activation over NVLink,
    none hidden: ``parts["p2p"]`` is the iteration's ``n · 2 · send``."""
    layout = Layout(config=GPT, tensor_parallel_size=2, pipeline_parallel_size=2,
                    num_microbatches=4, data_parallel_size=2)  # fmt: skip
    send = 2 * GPT.seq_length * GPT.hidden_size / 2 / NVLINK
    got = step_time(layout, H100_80GB).parts["p2p"]
    assert got == pytest.approx(4 * 2 * send, rel=1e-12), (
        f"pipeline transfers per iteration: {got:.4e} s, by hand n·2·send = {8 * send:.4e} s"
    )
