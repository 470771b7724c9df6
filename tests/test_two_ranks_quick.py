"""Quick checks on two gloo ranks, in one spawn, of what issue 32's planted bugs broke unseen by
the quick tier:

* **grouped-query attention with fewer KV groups than t** (g = 1, t = 2: each KV head is held
  by both TP ranks): after :func:`finalize_grads` every shard equals one float64 process's
  gradient (the replicated KV heads summed over the ranks that share them), the global norm is
  the one-process norm (each replicated head counted once) and clipping scales to it;
* **dropout under context parallelism** (c = 2, hidden and attention dropout on, both
  attention backends): the gradient is the derivative of the loss the forward computed, checked
  against a central difference along a random direction of the same masks (each forward
  rebuilds the model from the same seed, so it draws the same masks): a backward that redraws
  its masks computes another function's gradient;
* **the CP token mean with unequal token counts per rank**: the mean over every token of the
  group, not a mean of the ranks' means;
* **a checkpoint save that fails where only rank 0 acts** (its publishing rename, the fault
  point ``publish``): every rank raises the same one-line ``CheckpointSaveError`` naming rank
  0, and ``last.ckpt`` still holds the previous save;
* **the expert-tensor-parallel row exchange with unequal row counts per TP rank** (hand-written
  rows): :func:`gather_rows` gives the TP group's rows expert-major, :func:`scatter_rows` gives
  each rank the sums of its own rows (5 on one rank, 3 on the other), and the gather's backward
  sums the gradient of each rank's rows over the group.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from lightning_sp import GPT, ParallelState
from lightning_sp.checkpoint import Checkpointer, CheckpointSaveError, Meta, read_full, rng_key
from lightning_sp.checkpoint.commit import FAULT_ENV
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.context import context_token_mean
from lightning_sp.parallel.expert_rows import gather_rows, plan_rows, scatter_rows
from lightning_sp.parallel.grads import clip_grad_norm_, finalize_grads, global_grad_norm
from lightning_sp.testing.spawn import run_distributed

from models import assert_matches_reference, batch, context_shards, reference_model, tiny_config


def _replicated_kv_heads(state: ParallelState) -> str:
    config = tiny_config("llama", num_query_groups=1)  # 4 query heads, 1 KV head, t = 2
    what = f"g=1 t=2 rank {state.tensor_parallel_rank}"
    ids, labels = batch(config, batch_size=2)
    reference = reference_model(config)
    reference(ids, labels).backward()
    finalize_grads(reference, ParallelState.single())
    ref_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in reference.parameters()])
    )
    model = GPT(config, state, dtype=torch.float64)
    assert any(getattr(p, "shard", None) and p.shard.replicas == 2 for p in model.parameters()), (
        f"{what}: no key/value shard is replicated over the two TP ranks"
    )
    model(ids, labels).backward()
    finalize_grads(model, state)
    assert_matches_reference(model, reference, 1e-10, f"{what} finalize_grads")
    norm = global_grad_norm(model.parameters(), state)
    torch.testing.assert_close(
        norm, ref_norm, rtol=1e-12, atol=0,
        msg=lambda m: f"{what}: global gradient norm differs from one process's: {m}",
    )  # fmt: skip
    max_norm = 0.5 * ref_norm.item()
    clipped = clip_grad_norm_(model.parameters(), max_norm, state)
    torch.testing.assert_close(clipped, ref_norm, rtol=1e-12, atol=0)
    for p in reference.parameters():
        p.grad.mul_(max_norm / (ref_norm.item() + 1e-6))
    assert_matches_reference(model, reference, 1e-10, f"{what} clipped to half the norm")
    return what


def _context_dropout_derivative(state: ParallelState, attention: str) -> str:
    config = tiny_config(attention=attention, hidden_dropout=0.1, attention_dropout=0.2)
    what = f"c=2 {attention} dropout rank {state.context_parallel_rank}"
    ids, labels = context_shards(state, *batch(config))
    generator = torch.Generator().manual_seed(11)  # the same direction on every rank

    def loss_at(step: float, directions: list[torch.Tensor] | None) -> GPT | torch.Tensor:
        model = GPT(config, state, dtype=torch.float64)  # same seed: same weights and masks
        if directions is None:
            return model
        with torch.no_grad():
            for p, v in zip(model.parameters(), directions, strict=True):
                p.add_(step * v)
            return model(ids, labels)

    model = loss_at(0.0, None)
    assert isinstance(model, GPT)
    loss = model(ids, labels)
    loss.backward()
    finalize_grads(model, state)  # CP: the sum of the ranks' shares of the gradient
    directions = [
        torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in model.parameters()
    ]
    analytic = sum((p.grad * v).sum() for p, v in zip(model.parameters(), directions, strict=True))
    eps = 1e-5
    plus, minus = loss_at(eps, directions), loss_at(-eps, directions)
    assert isinstance(plus, torch.Tensor) and isinstance(minus, torch.Tensor)
    numeric = (plus - minus) / (2 * eps)
    err = abs((analytic - numeric) / numeric).item()
    assert err <= 1e-6, (
        f"{what}: gradient along a direction {analytic.item():.10e}, central difference of the "
        f"loss {numeric.item():.10e} (relative {err:.2e}): backward does not differentiate "
        "the forward's masks"
    )
    return what


def _context_token_mean(state: ParallelState) -> str:
    """Rank r sums a loss of ``(1, 4)[r]`` over ``(3, 5)[r]`` tokens: the mean over all tokens
    is 5/8 on both ranks, each rank's gradient 1/8 (a mean of the ranks' means would be
    (1/3 + 4/5) / 2)."""
    rank = state.context_parallel_rank
    what = f"c=2 token mean rank {rank}"
    loss_sum = torch.tensor((1.0, 4.0)[rank], dtype=torch.float64, requires_grad=True)
    mean = context_token_mean(loss_sum, (3, 5)[rank], state.cp_group)
    (grad,) = torch.autograd.grad(mean, loss_sum)
    assert abs(mean.item() - 5 / 8) <= 1e-15 and abs(grad.item() - 1 / 8) <= 1e-15, (
        f"{what}: mean {mean.item():.6f}, gradient {grad.item():.6f}; the mean over every token "
        "of unequal counts is 0.625, its gradient 0.125 on each rank"
    )
    return what


def _publish_fails_on_rank_zero(state: ParallelState, directory: str) -> str:
    config = tiny_config()
    model = GPT(config, state)
    optimizer = build_adamw(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    final = Path(directory) / "last.ckpt"
    key = rng_key(0, state.data_parallel_rank, 0)
    layout = ParallelConfig(data_parallel_size=2)

    def save(step: int) -> None:
        Checkpointer().save(final, model, [optimizer],
                            meta=Meta(step, layout, dataclasses.asdict(config)),
                            lightning_state={"global_step": step}, rng=(key, None))  # fmt: skip

    save(1)
    os.environ[FAULT_ENV] = "publish:0:2"
    try:
        save(2)
    except CheckpointSaveError as error:
        message = str(error)
    else:
        raise AssertionError(
            f"rank {state.data_parallel_rank}: a save whose publishing failed on rank 0 "
            "returned normally (the outcome was not agreed across ranks)"
        )
    finally:
        del os.environ[FAULT_ENV]
    assert "\n" not in message and message.startswith(f"saving checkpoint {final} failed on "
                                                      "rank 0: OSError:"), message  # fmt: skip
    assert message.endswith("last.ckpt still holds the previous save"), message
    assert read_full(final)["lightning"]["global_step"] == 1
    return message


def _expert_rows_uneven(state: ParallelState) -> str:
    """TP rank 0 holds 1 and 2 rows of its two local experts, rank 1 holds 2 and 3; row ``i``
    of rank ``r`` is ``10r + i + 1``. Gathered expert-major: 1 | 11 12 | 2 3 | 13 14 15. Each
    rank's partial output is the gathered rows times ``r + 1``: scattered back, rank 0's rows
    are 3·(1, 2, 3), rank 1's 3·(11, ..., 15); the gather's backward of a gradient ``r + 1``
    gives each row 1 + 2 = 3."""
    rank = state.tensor_parallel_rank
    what = f"expert TP rows rank {rank}"
    counts = ([1, 2], [2, 3])[rank]
    mine = torch.arange(1.0, sum(counts) + 1, dtype=torch.float64) + 10 * rank
    x = mine.unsqueeze(1).repeat(1, 2).requires_grad_()  # [n_r, h = 2]
    plan = plan_rows(counts, state.tp_group, False, x.device)
    gathered = gather_rows(x, plan)
    expected = [1.0, 11, 12, 2, 3, 13, 14, 15]
    assert plan.counts == [3, 5] and gathered[:, 0].tolist() == expected, (
        f"{what}: gather_rows gave {gathered[:, 0].tolist()} ({plan.counts} per local expert); "
        f"the TP group's rows expert-major are {expected}"
    )
    back = scatter_rows(gathered * (rank + 1), plan)
    assert back[:, 0].tolist() == (3 * mine).tolist(), (
        f"{what}: scatter_rows gave {back[:, 0].tolist()}; this rank's own {len(mine)} rows "
        f"summed over the TP group are {(3 * mine).tolist()}"
    )
    gathered.backward(torch.full_like(gathered, rank + 1.0))
    assert x.grad is not None and bool((x.grad == 3).all()), (
        f"{what}: gather_rows' backward gave {x.grad}; each row's gradient summed over the two "
        "ranks is 3"
    )
    return what


def _worker(rank: int, world_size: int, directory: str) -> list[str]:
    checked = [_replicated_kv_heads(ParallelState.from_process_group(tensor_parallel_size=2))]
    cp = ParallelState.from_process_group(context_parallel_size=2)
    checked += [_context_dropout_derivative(cp, attention) for attention in ("math", "sdpa")]
    checked.append(_context_token_mean(cp))
    tp = ParallelState.from_process_group(tensor_parallel_size=2, expert_tensor_parallel_size=2)
    checked.append(_expert_rows_uneven(tp))
    checked.append(_publish_fails_on_rank_zero(ParallelState.from_process_group(), directory))
    return checked


def test_two_ranks_quick(tmp_path: Path) -> None:
    """The checks above on two ranks; the save's failure line is the same on both."""
    results = run_distributed(_worker, 2, str(tmp_path))
    assert [len(r) for r in results] == [6, 6]
    assert results[0][-1] == results[1][-1]
