"""The model-state formulas (:mod:`lightning_sp.memory.model_state`): bytes per parameter with
and without the distributed optimizer, and parameter counts per rank, by hand for GPT-3 175B and
against the shards a real ``GPT`` builds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.memory.fake import fake_world
from lightning_sp.memory.model_state import (
    MIXED_PRECISION_ADAM,
    ModelStatePrecision,
    distributed_optimizer_elements,
    layer_parameter_count,
    model_parameter_count,
    model_state_bytes,
    parameters_per_rank,
    stage_parameter_count,
)

from models import layout_at, small_config


def test_model_state_bytes_per_parameter() -> None:
    assert MIXED_PRECISION_ADAM.bytes_per_parameter == 18
    assert model_state_bytes(1_000_000) == 18_000_000
    fp32_adam = ModelStatePrecision(param_bytes=4, grad_bytes=4, master_bytes=0)
    assert model_state_bytes(10, fp32_adam) == 160
    # the distributed optimizer: 2 + 4 + 12/d bytes; without it d changes nothing
    zero = model_state_bytes(1_000_000, data_parallel_size=8, distributed_optimizer=True)
    assert zero == 7_500_000
    assert model_state_bytes(1_000_000, data_parallel_size=8) == 18_000_000
    assert distributed_optimizer_elements([10, 7], 4, 0) == 3 + 2
    assert sum(distributed_optimizer_elements([10, 7], 4, r) for r in range(4)) == 17


def test_parameter_count_of_gpt3_175b() -> None:
    config = GPTConfig(
        vocab_size=51200, seq_length=2048, hidden_size=12288, num_layers=96, num_heads=96
    )
    h, L = 12288, 96
    assert layer_parameter_count(h) == 12 * h * h + 13 * h
    assert model_parameter_count(config) == L * (12 * h * h + 13 * h) + (51200 + 2048) * h + 2 * h
    assert model_parameter_count(config) == pytest.approx(175e9, rel=0.01)
    # t=8, p=8: the first stage holds 12 layers' shards, the embedding shard and the positions
    first = 12 * layer_parameter_count(h, layout_at(8)) + 51200 // 8 * h + 2048 * h
    assert parameters_per_rank(config, layout_at(8, p=8)) == first


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_parameter_count_matches_real_gpt_shards() -> None:
    # one process, a real model with real weights
    config = small_config(ffn_hidden_size=96)
    model = GPT(config, ParallelState.single())
    assert _count(model) == model_parameter_count(config)
    # t=2, p=2: each stage's shard as the model builds it (meta: shapes only)
    with fake_world(4):
        state = ParallelState.from_process_group(2, 2, device="cpu")
        for stage, layers in ((0, range(0, 2)), (1, range(2, 4))):
            shard = GPT(config, state, layer_range=layers, device="meta")
            assert _count(shard) == stage_parameter_count(config, layout_at(2, p=2), stage), stage
        assert parameters_per_rank(config, layout_at(2, p=2)) == stage_parameter_count(
            config, layout_at(2, p=2), 0
        )
    assert not dist.is_initialized()


def test_expert_parameters_per_rank_by_hand() -> None:
    """A SwiGLU mixture of experts (E = 4 experts of width f_e = 32, h = 64, L = 4, no
    biases): each expert holds 3·h·f_e = 6144 parameters; a rank of pipeline stage p = 2 at
    expert-parallel size e = 2 holds L/p = 2 layers' E/e = 2 experts: 4 · 6144 = 24576; at
    p = 1, e = 1 all 16 of them."""
    from lightning_sp.memory.model_state import expert_parameters_per_rank
    from lightning_sp.model.moe.config import MoEConfig

    config = GPTConfig.of(
        "mistral", vocab_size=1000, seq_length=256, hidden_size=64, num_layers=4, num_heads=4,
        feed_forward="moe", moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_size=32),
    )  # fmt: skip
    for (p, e), want in (((1, 1), 16 * 6144), ((2, 2), 4 * 6144), ((2, 1), 8 * 6144)):
        got = expert_parameters_per_rank(config, layout_at(p=p, e=e))
        assert got == want, f"routed experts per rank at p = {p}, e = {e}: {got}, by hand {want}"
