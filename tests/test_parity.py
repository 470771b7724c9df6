"""Every tensor/sequence-parallel layout, recompute policy (presets and single modules) and
attention backend equals one float64 process.

Real gloo ranks; each rank compares its own shard with the matching slice of a reference it
builds itself from the same seed (nothing is pickled between processes).
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.testing.spawn import run_distributed

from models import (
    assert_matches_reference,
    assert_policies_agree,
    batch,
    loss_and_grads,
    reference_model,
    relative_error,
    tiny_config,
    two_steps,
)

# (recompute, recompute_num_layers, recompute_rest): full on layer 0 only and lean on layer 1
# is the mix that recompute: auto picks when full on every layer is more than needed (and
# selective / none on layer 1 the other rests); then lean and each recompute module on its own
POLICIES = (
    ("none", None, None), ("selective", None, None), ("full", None, None),
    ("full", 1, "selective"), ("full", 1, "lean"), ("full", 1, "none"), ("lean", None, None),
    (["layernorm"], None, None), (["mlp_act"], None, None), (["residual_mask"], None, None),
)  # fmt: skip
SDPA_POLICIES = (
    ("none", None, None), ("selective", None, None), ("full", 1, "lean"), ("lean", None, None),
)  # fmt: skip
CASES = [("math", p) for p in POLICIES] + [("sdpa", p) for p in SDPA_POLICIES]
"""(attention, (recompute, recompute_num_layers, recompute_rest)) cases run in every layout."""


def _case_config(
    recompute: object, layers: int | None, rest: str | None, **fields: object
) -> GPTConfig:
    """``tiny_config`` with one recompute case (``rest`` None: the default)."""
    if rest is not None:
        fields["recompute_rest"] = rest
    return tiny_config(recompute=recompute, recompute_num_layers=layers, **fields)


RTOL = 1e-10


def _parity_worker(rank: int, world_size: int) -> None:
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    config = tiny_config()
    ids, labels = batch(config)
    reference = reference_model(config)
    ref_loss = loss_and_grads(reference, ids, labels)
    for sequence_parallel, (attention, (recompute, layers, rest)) in itertools.product(
        (False, True), CASES
    ):
        case = (
            f"t={world_size} sp={sequence_parallel} {attention} recompute={recompute}/{layers}"
            f"/{rest}"
        )
        cfg = _case_config(
            recompute, layers, rest, sequence_parallel=sequence_parallel, attention=attention
        )
        assert layers is None or cfg.layer_recompute(1).name == (rest or "selective"), case
        model = GPT(cfg, state, dtype=torch.float64)
        loss = loss_and_grads(model, ids, labels)
        assert relative_error(loss, ref_loss) <= RTOL, f"{case}: loss {loss} vs {ref_loss}"
        compared = assert_matches_reference(model, reference, RTOL, case)
        assert compared.parameters == len(list(model.parameters())) > 0


@pytest.mark.parametrize(  # 2 ranks in the quick tier
    "world_size",
    [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)],
)
def test_layouts_match_single_process_float64(world_size: int) -> None:
    run_distributed(_parity_worker, world_size)


def _assert_replicated_grads_agree(model: GPT, grads: dict, state: ParallelState) -> None:
    """Parameters replicated over the TP group (LayerNorms, row-parallel biases, positions)
    must get identical gradients on every TP rank, or the replicas drift apart."""
    for name, param in model.named_parameters():
        if param.shard.dim is not None:
            continue
        grad = grads[name]
        gathered = [torch.empty_like(grad) for _ in range(state.tensor_parallel_size)]
        dist.all_gather(gathered, grad, group=state.tp_group)
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{name}: replicas diverged"


def _dropout_worker(rank: int, world_size: int) -> None:
    """With dropout, every policy of one attention backend draws and replays identical masks
    (``sdpa`` on CPU runs torch's math fallback, seeded from our stream; it warns)."""
    warnings.filterwarnings("ignore", message="attention='sdpa' with attention_dropout")
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    for sequence_parallel, attention in itertools.product((False, True), ("math", "sdpa")):
        results = []
        for recompute, layers, rest in POLICIES if attention == "math" else SDPA_POLICIES:
            cfg = _case_config(
                recompute, layers, rest, sequence_parallel=sequence_parallel,
                attention=attention, hidden_dropout=0.2, attention_dropout=0.3,
            )  # fmt: skip
            model = GPT(cfg, state, dtype=torch.float64)
            results.append(two_steps(model, f"{recompute}/{layers}/{rest}"))
        assert_policies_agree(results, f"t={world_size} sp={sequence_parallel} {attention}")
        base_grads = results[0][2]
        if world_size > 1:
            _assert_replicated_grads_agree(model, base_grads, state)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_recompute_policies_replay_identical_dropout(world_size: int) -> None:
    run_distributed(_dropout_worker, world_size)
