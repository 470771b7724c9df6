"""The non-finite guard decides identically on every rank: a gradient that is infinite on one
rank only (one tensor-parallel shard, one distributed-optimizer shard) stops every rank under
``stop`` and skips the step on every rank under ``skip``. Deciding per rank would let one rank
raise while the others block in the next collective, or let replicas silently diverge."""

from __future__ import annotations

import pytest
import torch

from lightning_sp.parallel.buffer import GradBuffer
from lightning_sp.parallel.grads import flat_grads
from lightning_sp.parallel.state import ParallelState
from lightning_sp.runtime.guard import NonFiniteError, NonFiniteGuard
from lightning_sp.testing.spawn import run_distributed

POISONED_RANK = 1


def _guard_worker(rank: int, world_size: int, policy: str) -> tuple[str, str, bool]:
    """One guarded step per rank; rank 1's gradient holds an Inf (its loss is finite).
    Returns (outcome, message, whether this rank's gradients were zeroed)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    layer(torch.randn(2, 4)).sum().backward()
    if rank == POISONED_RANK:
        assert layer.weight.grad is not None
        layer.weight.grad[0, 0] = float("inf")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    guard = NonFiniteGuard(policy, max_skipped_steps=3)
    loss = torch.tensor(1.0)
    try:
        outcome = "stepped" if guard.check(loss, layer, optimizer, step=5) else "skipped"
        message = ""
    except NonFiniteError as error:
        outcome, message = "stopped", str(error)
    return outcome, message, layer.weight.grad is None


@pytest.mark.slow
def test_ranks_agree_on_a_gradient_infinite_on_one_rank_only() -> None:
    runs = {policy: run_distributed(_guard_worker, 2, policy) for policy in ("stop", "skip")}
    outcomes = {
        policy: {rank: outcome for rank, (outcome, _, _) in enumerate(results)}
        for policy, results in runs.items()
    }
    disagree = {policy: o for policy, o in outcomes.items() if len(set(o.values())) > 1}
    assert not disagree, f"ranks disagree on the non-finite guard: {disagree}"
    assert outcomes["stop"][0] == "stopped" and outcomes["skip"][0] == "skipped", outcomes
    for _, message, _ in runs["stop"]:  # every rank names the poisoned one
        assert f"non-finite gradient norm (rank {POISONED_RANK}) at step 5" in message, message
    assert all(zeroed for _, _, zeroed in runs["skip"]), "a skipped step kept its gradients"


def test_the_guard_reads_a_gradient_buffer_whole() -> None:
    """Given the gradient buffer's flat storage (as the strategy passes it), the guard reads
    it instead of the parameters: a finite step passes, an Inf in the storage stops the run
    naming the gradient norm."""
    layer = torch.nn.Linear(4, 4)
    buffer = GradBuffer(layer.parameters(), ParallelState.single())
    layer(torch.randn(2, 4)).sum().backward()
    flat = flat_grads(layer.parameters(), buffer)
    assert flat is not None, "the buffer holds every gradient of the layer"
    guard, optimizer, loss = (
        NonFiniteGuard("stop"),
        torch.optim.SGD(layer.parameters()),
        torch.ones(()),
    )
    assert guard.check(loss, layer, optimizer, step=3, grads=flat), "a finite step was refused"
    layer.bias.main_grad[1] = float("inf")  # type: ignore[index]
    del layer.bias.main_grad  # the parameters alone no longer show it: only the storage does
    with pytest.raises(NonFiniteError, match=r"non-finite gradient norm .* at step 3"):
        guard.check(loss, layer, optimizer, step=3, grads=flat)


def test_state_moved_after_the_step_is_checked_before_the_next_update() -> None:
    """Issue 40, item 3: the MoE routers' expert biases move after the optimizer step, outside
    the gradients; a non-finite bias (an infinite ``bias_update_rate`` once saved
    ``[nan, inf, ...]`` in last.ckpt) stops the run at the next step, in the same one read,
    naming it; the walk finds the biases through the generic hook, not the MoE module."""
    import dataclasses

    from lightning_sp import GPT, GPTConfig
    from lightning_sp.model.hooks import stepped_modules, stepped_state
    from lightning_sp.model.moe.config import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=16, expert_bias=True)
    config = GPTConfig.of("llama", vocab_size=64, seq_length=8, hidden_size=16, num_layers=2,
                          num_heads=2, feed_forward="moe", moe=moe)  # fmt: skip
    model = GPT(config, ParallelState.single(), dtype=torch.float32)
    state = stepped_state(stepped_modules(model))
    assert len(state) == 2, f"expected the 2 layers' expert biases, found {len(state)} tensors"
    dense = GPT(dataclasses.replace(config, feed_forward="dense", moe=None), ParallelState.single())
    assert stepped_state(stepped_modules(dense)) == [], "a dense model moves no state per step"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NonFiniteGuard("stop")
    assert guard.check(torch.tensor(1.0), model, optimizer, step=3, state=state), "finite: steps"
    state[1][2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"state moved after the last optimizer step \(rank "
                       r"0\) at step 4") as stopped:  # fmt: skip
        guard.check(torch.tensor(1.0), model, optimizer, step=4, state=state)
    assert "\n" not in str(stopped.value), "the stop is one line"


def test_skip_counts_skips_in_a_row_and_stops_after_max_skipped_steps() -> None:
    """``skip`` with max_skipped_steps = 2, one process: NaN, NaN (two skips), a finite step
    (steps; the count of skips in a row starts again), NaN, NaN (two skips), NaN: the third
    in a row stops. Every skipped step's gradients are zeroed."""
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    guard = NonFiniteGuard("skip", max_skipped_steps=2)
    nan = float("nan")
    outcomes = []
    for step, loss in enumerate([nan, nan, 1.0, nan, nan, nan]):
        layer(torch.ones(1, 2)).sum().backward()
        try:
            stepped = guard.check(torch.tensor(loss), layer, optimizer, step=step)
        except NonFiniteError as error:
            outcomes.append(f"stopped: {error}")
            break
        outcomes.append("stepped" if stepped else "skipped")
        if not stepped:
            assert layer.weight.grad is None, f"step {step} skipped without zeroing the gradients"
        optimizer.zero_grad()
    want = ["skipped", "skipped", "stepped", "skipped", "skipped",
            "stopped: non-finite loss (rank 0) at step 5, after 2 skipped steps in a row "
            "(max_skipped_steps=2); the run stops"]  # fmt: skip
    assert outcomes == want, (
        f"skip policy with max_skipped_steps=2 over NaN, NaN, 1, NaN, NaN, NaN: {outcomes}, "
        f"expected {want} (a finite step starts the count of skips in a row again)"
    )
    assert guard.total_skipped == 4, f"{guard.total_skipped} skipped steps in all, expected 4"
