"""Llama blocks (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, untied output) in
every tensor/sequence-parallel layout, recompute preset and attention backend equal one float64
process; key/value groups 1, 2 and 8 under t = 1, 2, 4 cover t dividing g and g dividing t
(each rank then holds its one group, shared with t/g - 1 other ranks, its gradient summed
over them)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from lightning_sp import GPT, ParallelState
from lightning_sp.errors import ConfigError
from lightning_sp.model.config_checks import check_model_layout
from lightning_sp.parallel.config import ParallelConfig
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

RTOL = 1e-10
GROUPS = (1, 2, 8)
PRESETS = (("none", None), ("selective", None), ("lean", None), ("full", None), ("full", 1))


def _config(groups: int, **fields: object):
    return tiny_config("llama", num_heads=8, num_query_groups=groups, **fields)


def _parity_worker(rank: int, world_size: int) -> None:
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    for groups in GROUPS:
        config = _config(groups)
        ids, labels = batch(config)
        reference = reference_model(config)
        ref_loss = loss_and_grads(reference, ids, labels)
        for sp, attention, (recompute, layers) in itertools.product(
            (False, True), ("math", "sdpa"), PRESETS
        ):
            case = f"llama g={groups} t={world_size} sp={sp} {attention} {recompute}/{layers}"
            cfg = _config(
                groups, sequence_parallel=sp, attention=attention, recompute=recompute,
                recompute_num_layers=layers, recompute_rest="lean",
            )  # fmt: skip
            model = GPT(cfg, state, dtype=torch.float64)
            loss = loss_and_grads(model, ids, labels)
            assert relative_error(loss, ref_loss) <= RTOL, f"{case}: loss {loss} vs {ref_loss}"
            compared = assert_matches_reference(model, reference, RTOL, case)
            assert compared.parameters == len(list(model.parameters())) > 0


def _dropout_worker(rank: int, world_size: int) -> None:
    """With dropout on, every preset draws and replays the same masks: same loss, same
    gradients as ``none`` (both dropouts from the streams, SwiGLU / RMSNorm recomputed)."""
    warnings.filterwarnings("ignore", message="attention='sdpa' with attention_dropout")
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    for sp in (False, True):
        results = []
        for recompute, layers in PRESETS:
            cfg = _config(
                2, sequence_parallel=sp, recompute=recompute, recompute_num_layers=layers,
                recompute_rest="lean", hidden_dropout=0.2, attention_dropout=0.3,
            )  # fmt: skip
            model = GPT(cfg, state, dtype=torch.float64)
            results.append(two_steps(model, f"{recompute}/{layers}"))
        assert_policies_agree(results, f"llama t={world_size} sp={sp} dropout")


def _worker(rank: int, world_size: int) -> None:
    _parity_worker(rank, world_size)
    _dropout_worker(rank, world_size)


def test_llama_one_process_matches_float64_reference() -> None:
    """The quick tier's case: t = 1 in this process (groups 1, 2, 8; every preset)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        _parity_worker(0, 1)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_llama_layouts_match_single_process_float64(world_size: int) -> None:
    run_distributed(_worker, world_size)


def test_kv_groups_and_tensor_parallel_size_must_divide_one_another() -> None:
    # past the head checks (t = 6 divides a = 12, h = 48); g = 4 and t divide neither way
    with pytest.raises(ConfigError, match=r"num_query_groups=4 and tensor_parallel_size=6"):
        check_model_layout(
            tiny_config("llama", num_heads=12, hidden_size=48, num_query_groups=4),
            ParallelConfig(tensor_parallel_size=6),
        )
    with pytest.raises(ConfigError, match=r"num_query_groups=3 does not divide num_heads=8"):
        _config(3)
    # fewer groups than ranks: replicated, allowed
    check_model_layout(_config(2), ParallelConfig(tensor_parallel_size=4))
    check_model_layout(_config(8), ParallelConfig(tensor_parallel_size=4))
