"""The MoE layer's saved bytes per rank equal its part's formula to the byte (bf16, forced
balanced routing, saved-tensor hooks), at t = 1 and t = 2 with SP, e = 1, 2, 4: expert
parallelism moves rows but, balanced, does not divide them."""

from __future__ import annotations

import pytest
import torch

from lightning_sp.memory.saved import SavedTensorTracker
from lightning_sp.model.moe import MoE
from lightning_sp.model.moe_config import MoEConfig
from lightning_sp.model.parts.base import INSIDE
from lightning_sp.model.parts.moe import MoEFeedForward
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing.spawn import run_distributed

S, B, H = 32, 2, 64
CONFIG = MoEConfig(num_experts=8, top_k=2, expert_ffn_size=32, num_shared_experts=1,
                   aux_loss_coef=0.01, z_loss_coef=0.001, force_balanced=True)  # fmt: skip


def _formula(t: int, e: int, sp: bool) -> float:
    """Bytes one rank saves: the part's terms split by region, plus the aux loss's counts."""
    shape = ActivationShape(s=S, b=B, h=H, a=4, t=t, sequence_parallel=sp)
    terms = MoEFeedForward(CONFIG, e).saved_terms(shape)
    per_rank = sum(b / (t if (region == INSIDE or sp) else 1) for b, region in terms.values())
    return per_rank + 4 * CONFIG.num_experts  # fp32 counts of the load-balancing loss


def _measure(state: ParallelState, sp: bool) -> int:
    moe = MoE(H, CONFIG, state, sequence_parallel=sp, dtype=torch.bfloat16)
    moe.reset_parameters(3)
    s = S // state.tensor_parallel_size if sp else S
    x = torch.randn(s, B, H, dtype=torch.bfloat16, requires_grad=True)
    tracker = SavedTensorTracker(exclude=[*moe.parameters(), *moe.buffers()])
    with tracker:
        out = moe(x)
    out.float().square().sum().backward()  # the graph is sound
    return tracker.report.total_bytes


def _worker(rank: int, world_size: int) -> list[tuple[str, int, float]]:
    results = []
    for t, e in ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2)):
        state = ParallelState.from_process_group(tensor_parallel_size=t, expert_parallel_size=e)
        sp = t > 1
        measured, expected = _measure(state, sp), _formula(t, e, sp)
        assert measured == expected, f"t={t} e={e}: measured {measured} vs formula {expected}"
        results.append((f"t={t} e={e}", measured, expected))
    return results


def test_moe_saved_bytes_equal_formula_one_process() -> None:
    assert _measure(ParallelState.single(), False) == _formula(1, 1, False)


@pytest.mark.slow
def test_moe_saved_bytes_equal_formula_every_layout() -> None:
    run_distributed(_worker, 4)


@pytest.mark.parametrize("t", [1, 2])
def test_fake_measurement_of_an_moe_model_equals_its_formula(t: int) -> None:
    """The planner's measurement (one layer of rank 0's shard under fake tensors, which route
    force-balanced: ``GPTConfig.for_measurement``) equals the layer formula plus the norms'
    statistics and the load-balancing counts (4E bytes), to the byte."""
    import dataclasses

    from lightning_sp import GPTConfig
    from lightning_sp.memory.fake import measure_activations
    from lightning_sp.memory.formulas import (
        activation_bytes_per_layer,
        layernorm_stats_bytes_per_layer,
    )

    config = GPTConfig.of(
        "llama", vocab_size=257, seq_length=256, hidden_size=128, num_layers=2, num_heads=8,
        num_query_groups=2, feed_forward="moe", recompute="none", sequence_parallel=t > 1,
        moe=dataclasses.replace(CONFIG, num_shared_experts=0, force_balanced=False),
    )  # fmt: skip
    measured = measure_activations(config, tensor_parallel_size=t, micro_batch_size=2, layers=1)
    shape = config.activation_shape(t, 2)
    expected = activation_bytes_per_layer(shape, "none") + layernorm_stats_bytes_per_layer(
        shape, "none"
    )
    assert measured.bytes_per_layer == expected + 4 * CONFIG.num_experts


def test_mixtral_8x7b_parameters_total_active_and_per_rank() -> None:
    """configs/mixtral_8x7b.yaml's model: 46.7B parameters, 12.9B active (Mistral's published
    figures), and 1.64B on a rank of t=2, p=4, e=8 (each rank 1 of the 8 experts)."""
    from pathlib import Path

    import yaml

    from lightning_sp import GPTConfig
    from lightning_sp.memory.formulas import (
        model_active_parameter_count,
        model_parameter_count,
        parameters_per_rank,
    )

    path = Path(__file__).parent.parent / "configs" / "mixtral_8x7b.yaml"
    fields = yaml.safe_load(path.read_text())["model"]["config"]
    config = GPTConfig(**{**fields, "moe": MoEConfig(**fields["moe"])})
    assert model_parameter_count(config) == 46_702_792_704
    assert model_active_parameter_count(config) == 12_879_925_248
    assert parameters_per_rank(config, 2, 4, 8) == 1_642_926_080
    assert parameters_per_rank(config, 2, 4, 1) > 7 * parameters_per_rank(config, 2, 4, 8)
