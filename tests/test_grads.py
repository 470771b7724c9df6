"""Gradient finishing and clipping equal one float64 process on the whole batch.

t=2 x dp=2 on four gloo ranks: each data-parallel replica sees half of the batch; after
``finalize_grads`` (SP sums over TP, averaging over DP) every shard equals its slice of the
reference gradient, the global norm equals the reference's norm, and clipping scales to it.
"""

from __future__ import annotations

import pytest
import torch

from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.parallel.buffer import GradBuffer
from lightning_sp.parallel.grads import (
    clip_grad_norm_,
    counted_flat_grads,
    finalize_grads,
    flat_grads,
    global_grad_norm,
    grad_of,
)
from lightning_sp.testing.spawn import run_distributed

from models import assert_matches_reference, batch, reference_model, tiny_config


def _worker(rank: int, world_size: int) -> None:
    state = ParallelState.from_process_group(tensor_parallel_size=2)
    config = tiny_config(sequence_parallel=True, recompute="selective")
    ids, labels = batch(config, batch_size=4)
    reference = reference_model(config)
    reference(ids, labels).backward()
    ref_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in reference.parameters()])
    )

    model = GPT(config, state, dtype=torch.float64)
    half = slice(2 * state.data_parallel_rank, 2 * state.data_parallel_rank + 2)
    model(ids[half], labels[half]).backward()
    finalize_grads(model, state)
    assert_matches_reference(model, reference, 1e-10, "dp-averaged")

    norm = global_grad_norm(model.parameters(), state)
    torch.testing.assert_close(
        norm.double(), ref_norm, rtol=1e-6, atol=0,
        msg=lambda m: f"global gradient norm differs from the reference's: {m}",
    )  # fmt: skip

    # a bound above the norm changes nothing
    clip_grad_norm_(model.parameters(), 2 * ref_norm.item(), state)
    assert_matches_reference(model, reference, 1e-10, "clip above the norm")
    # half the norm: every gradient halves (clipping keeps the direction), the norm is the bound
    max_norm = 0.5 * ref_norm.item()
    clip_grad_norm_(model.parameters(), max_norm, state)
    for p in reference.parameters():
        p.grad.mul_(0.5)
    assert_matches_reference(model, reference, 1e-5, "clipped to half the norm")
    clipped = global_grad_norm(model.parameters(), state)
    torch.testing.assert_close(
        clipped.double(), torch.tensor(max_norm, dtype=torch.float64), rtol=1e-5, atol=0
    )


@pytest.mark.slow
def test_dp_tp_gradients_norm_and_clipping_match_single_process() -> None:
    run_distributed(_worker, 4)


def _buffered(config: GPTConfig) -> tuple[GPT, GradBuffer]:
    """A float64 GPT on one process whose gradients live in a :class:`GradBuffer`, after one
    backward."""
    model = GPT(config, ParallelState.single(), dtype=torch.float64)
    buffer = GradBuffer(model.parameters(), model.state)
    model(*batch(config, batch_size=2)).backward()
    return model, buffer


def test_the_buffer_read_whole_norms_and_clips_as_its_parameters_do() -> None:
    """Clipping reads the gradient buffer's flat storage (a kernel per dtype) instead of the
    parameters one by one: the same norm and the same clipped gradients; and it is offered
    only where it holds every gradient and the norm counts each once."""
    config = tiny_config()
    (whole, flat_buffer), (each, _) = _buffered(config), _buffered(config)
    state = whole.state
    flat = counted_flat_grads(whole.parameters(), flat_buffer, state)
    assert flat == list(flat_buffer.buffers.values()), "t = 1: the storage is read whole"
    norm = global_grad_norm(each.parameters(), state)
    assert abs(global_grad_norm([], state, flat=flat) - norm) <= 1e-12 * norm, (
        "the norm of the flat storage differs from the parameters' global norm"
    )
    max_norm = 0.5 * norm.item()
    clipped = clip_grad_norm_(whole.parameters(), max_norm, state, flat=flat)
    clip_grad_norm_(each.parameters(), max_norm, state)
    assert abs(clipped - norm) <= 1e-12 * norm, "clipping returned another norm"
    for (name, a), b in zip(whole.named_parameters(), each.parameters(), strict=True):
        torch.testing.assert_close(grad_of(a), grad_of(b), rtol=1e-12, atol=0, msg=name)
    outside = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    assert flat_grads([*whole.parameters(), outside], flat_buffer) is None, (
        "a trainable parameter outside the buffer must send clipping back to the parameters"
    )
    next(whole.parameters()).pipeline_copy = True  # type: ignore[attr-defined]
    assert counted_flat_grads(whole.parameters(), flat_buffer, state) is None, (
        "a gradient the norm does not count (a tied copy) must not be read whole"
    )
