"""``estimate`` of a DPO run's reference (lightning_sp.planner.dpo): a frozen copy holds the
built model's weights, each live reference costs one forward (a third of the step's model
FLOPs), precomputed costs nothing per step, and the command prints the line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_planner_lora import _layout

from lightning_sp.cli.estimate import main as report_main
from lightning_sp.cli.estimate import read_estimate_args
from lightning_sp.memory.flops import model_flops_per_iteration
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.state import ParallelState
from lightning_sp.planner.dpo import reference_cost
from lightning_sp.planner.presets import load_cluster
from lightning_sp.planner.steptime import step_time


def test_reference_kinds_priced(tmp_path) -> None:
    cli = read_estimate_args(_layout(tmp_path, "--model.dpo.beta=0.1"))
    layout = cli.layout
    assert cli.reference == "copy", f"auto without LoRA resolves to copy: {cli.reference}"
    copy = reference_cost(layout, "copy", "a100-80gb")
    adapters = reference_cost(layout, "adapters", "a100-80gb")
    stored = reference_cost(layout, "precomputed", "a100-80gb")
    one = GPT(layout.config, ParallelState.single(), dtype=torch.bfloat16, device="meta")
    full = sum(p.numel() for p in one.parameters())
    # t = 2: the embedding, head and layer matrices split in two; the norms are replicated
    assert full / 2 <= copy.weight_bytes / 2 < full, f"copy weights {copy.weight_bytes} vs {full}"
    assert adapters.weight_bytes == 0.0, "adapters off: no second copy of the weights"
    step = model_flops_per_iteration(layout.config, layout.global_batch_size)
    assert copy.forward_flops == pytest.approx(step / 3), "one forward = a third of the step"
    assert adapters.forward_flops == copy.forward_flops and adapters.seconds == copy.seconds
    whole = step_time(layout, load_cluster("a100-80gb")).iteration_seconds
    assert 0 < copy.seconds < whole / 2, f"a forward {copy.seconds} s of a step {whole} s"
    assert (stored.forward_flops, stored.weight_bytes, stored.seconds) == (0.0, 0.0, 0.0)


def test_estimate_prints_the_reference(tmp_path, capsys) -> None:
    args = _layout(tmp_path, "--model.dpo.beta=0.1", "--cluster=a100-80gb")
    assert report_main(read_estimate_args, args) == 0
    out = capsys.readouterr().out
    assert "DPO reference copy: forward" in out and "GB per GPU" in out, out[-400:]


def test_reference_forward_prices_the_heads_log_probabilities(tmp_path) -> None:
    """The reference's per-token log-probabilities are the vocab-parallel cross entropy's
    forward (sequence_logps): its passes over the ``s·b·v/t`` logits (38 bytes a logit), the
    final norm, the embedding and one TP collective at each end are priced per micro-batch
    beside the layers and the logits GEMM."""
    from lightning_sp.planner.kernels import gather_seconds, gemm_seconds, memory_seconds
    from lightning_sp.planner.layertime import layer_time
    from lightning_sp.planner.ops import ACT, embedding_memory_ops, head_gemms, head_memory_ops

    layout = read_estimate_args(_layout(tmp_path, "--model.dpo.beta=0.1")).layout
    cluster = load_cluster("a100-80gb")
    config, t, b = layout.config, layout.tensor_parallel_size, layout.micro_batch_size
    assert layout.pipeline_parallel_size == 1 and config.sequence_parallel
    n, s, h = layout.microbatches_per_step, config.seq_length, config.hidden_size
    logits = s * b * config.padded_vocab_size(t) // t
    ops = [*head_memory_ops(config, t, b, True), *embedding_memory_ops(config, t, b, True)]
    assert next(op for op in ops if op.name == "cross_entropy").forward_bytes == 38 * logits
    layers = config.num_layers * sum(layer_time(layout.shape_of(config), cluster).forward.values())
    ends = (
        gemm_seconds(cluster, head_gemms(config, t, b)[0])
        + sum(memory_seconds(cluster, op.forward_bytes) for op in ops)
        + 2 * gather_seconds(cluster, ACT * s * b * h, t, True)
    )
    got = reference_cost(layout, "copy", cluster).seconds
    assert got == pytest.approx(n * (layers + ends), rel=1e-12), (
        f"reference forward {got} s, by hand {n * (layers + ends)} s (layers {n * layers} s)"
    )


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (2, 2)])
def test_reference_forward_through_a_pipeline_by_hand(tmp_path, p: int, m: int) -> None:
    """p stages (m chunks), n = 4, t = 2 without SP: the layers' forward runs on each stage's
    L/p layers for the n micro-batches and the forward schedule's (p-1)/m bubble; the
    embedding (with its forward all-reduce over TP: two ring passes) and the head (no
    collective without SP) run one after the other at p = 1; at p = 2 they are on different
    stages, so only the slower of the two is on the steady state's path, n times."""
    from lightning_sp.planner.kernels import gather_seconds, gemm_seconds, memory_seconds
    from lightning_sp.planner.layertime import layer_time
    from lightning_sp.planner.layout import Layout
    from lightning_sp.planner.ops import ACT, embedding_memory_ops, head_gemms, head_memory_ops

    base = read_estimate_args(_layout(tmp_path, "--model.dpo.beta=0.1")).layout
    config = dataclasses.replace(base.config, sequence_parallel=False)
    split = {"num_microbatches": 4} if p > 1 else {"accumulate_grad_batches": 4}
    layout = Layout(config=config, tensor_parallel_size=2, pipeline_parallel_size=p,
                    virtual_pipeline_size=m, **split)  # fmt: skip
    cluster = load_cluster("a100-80gb")
    t, b, s, h, n, L = 2, 1, config.seq_length, config.hidden_size, 4, config.num_layers
    layer = sum(layer_time(layout.shape_of(config), cluster).forward.values())
    head = gemm_seconds(cluster, head_gemms(config, t, b)[0]) + sum(
        memory_seconds(cluster, op.forward_bytes) for op in head_memory_ops(config, t, b, False)
    )
    embedding = sum(
        memory_seconds(cluster, op.forward_bytes)
        for op in embedding_memory_ops(config, t, b, False)
    ) + 2 * gather_seconds(cluster, ACT * s * b * h, t, True)
    ends = head + embedding if p == 1 else max(head, embedding)
    expected = (n + (p - 1) / m) * L / p * layer + n * ends
    got = reference_cost(layout, "copy", cluster).seconds
    assert got == pytest.approx(expected, rel=1e-12), (
        f"DPO reference forward at p = {p}, m = {m}, SP off: {got:.4e} s, by hand "
        f"{expected:.4e} s (bubble (p-1)/m, the slower end per micro-batch, the embedding's "
        "all-reduce)"
    )
