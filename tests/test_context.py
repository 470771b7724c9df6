"""Context parallelism's primitives (lightning_sp.parallel.context, .context_attention) against
one process attending the whole sequence, in float64 on real gloo ranks.

Every check takes the CP group (``None``: c = 1, run in this process) and builds the whole
sequence's Q, K, V identically on every rank; each rank keeps its two load-balanced chunks,
runs the CP attention, and compares its output and dQ/dK/dV with its chunks of the
one-process result (<= 1e-10). With dropout, the ``math`` core's masks are recorded where they
are drawn (``lightning_sp.parallel.random``), scattered into one whole-sequence mask, and the
one-process attention with that mask must give the same output and gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sp.memory.saved import SavedTensorTracker
from lightning_sp.parallel import random as random_module
from lightning_sp.parallel.comm import Group, group_rank, group_size
from lightning_sp.parallel.context import (
    check_context_split,
    context_token_mean,
    gather_context_sequence,
    gather_from_context_parallel,
    load_balanced_positions,
    rank_order_chunks,
    reduce_scatter_context_sequence,
    scatter_to_context_parallel,
    shard_for_context_parallel,
)
from lightning_sp.parallel.context_attention import (
    CONTEXT_ATTENTION_CORES,
    context_attention_saved_bytes,
    context_parallel_attention,
)
from lightning_sp.parallel.random import derive_seed, drawing_from
from lightning_sp.testing.spawn import run_distributed

from models import relative_error

TOLERANCE = 1e-10
HEADS = ((4, 4), (4, 2), (4, 1))  # (hq, hkv): MHA, GQA, one KV head
BATCH, HEAD_DIM = 2, 4


def _sequence(cp_size: int) -> int:
    return 8 * cp_size  # chunks of 4 tokens


def _whole(hq: int, hkv: int, s: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The whole sequence's q, k, v and an output gradient, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, hq, s, HEAD_DIM), (BATCH, hkv, s, HEAD_DIM), (BATCH, hkv, s, HEAD_DIM)]
    shapes.append(shapes[0])
    q, k, v, grad = (torch.randn(x, generator=gen, dtype=torch.float64) for x in shapes)
    return q, k, v, grad


def _one_process(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None, p: float = 0.0
) -> Tensor:
    """Plain causal attention over the whole sequence, K/V expanded to the query heads; with
    ``keep`` ([b, hq, s, s] bool) the dropout mask applied to the probabilities."""
    s, group = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / HEAD_DIM**0.5
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    if keep is not None:
        probs = probs * keep / (1.0 - p)
    return probs @ v


def _mine(x: Tensor, group: Group) -> Tensor:
    return shard_for_context_parallel(x, 2, group_size(group), group_rank(group))


def _leaves(tensors: tuple[Tensor, ...], group: Group) -> list[Tensor]:
    return [_mine(x, group).requires_grad_() for x in tensors]


def _assert_matches(
    got: tuple[Tensor, ...], reference: tuple[Tensor, ...], group: Group, what: str
) -> None:
    """``got`` (this rank's output, dq, dk, dv) equals this rank's chunks of ``reference``."""
    for name, mine, whole in zip(("output", "dq", "dk", "dv"), got, reference, strict=True):
        error = relative_error(mine, _mine(whole, group))
        assert error <= TOLERANCE, f"{what}: {name} differs from one process by {error:.2e}"


def _sum_over(x: Tensor, group: Group) -> Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


@contextmanager
def _recorded_masks(into: list[Tensor]) -> Iterator[None]:
    """Append the kept elements (``out != 0``) of every ``random.dropout`` mask drawn."""
    real = random_module._Dropout

    class Recording(real):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx, x: Tensor, p: float, generator: torch.Generator) -> Tensor:
            out = real.forward(ctx, x, p, generator)
            into.append(out.detach() != 0)
            return out

    random_module._Dropout = Recording
    try:
        yield
    finally:
        random_module._Dropout = real


def _rank_generator(group: Group) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed("context test", group_rank(group)))


# --- the checks, each run on one process (group None) and on gloo ranks ----------------------


def check_parity(group: Group, core: str, hq: int, hkv: int) -> None:
    """Dropout off: output and dQ/dK/dV equal one process's."""
    s = _sequence(group_size(group))
    q, k, v, grad = _whole(hq, hkv, s)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    out = _one_process(*whole)
    reference = (out, *torch.autograd.grad(out, whole, grad))
    local = _leaves((q, k, v), group)
    mine = context_parallel_attention(*local, group, core=core)
    got = (mine, *torch.autograd.grad(mine, local, _mine(grad, group)))
    _assert_matches(got, reference, group, f"core={core} hq={hq} hkv={hkv}")


def check_math_dropout(group: Group, hq: int, hkv: int, p: float = 0.3) -> None:
    """The masks each rank draws, scattered into one whole-sequence mask, reproduce one
    process's attention with that mask; backward (twice) replays the forward's masks."""
    s = _sequence(group_size(group))
    q, k, v, grad = _whole(hq, hkv, s, seed=1)
    local = _leaves((q, k, v), group)
    generator = _rank_generator(group)
    start = generator.get_state()
    draws: list[Tensor] = []
    with _recorded_masks(draws):
        mine = context_parallel_attention(
            *local, group, core="math", dropout_p=p, generator=generator
        )
        forward = list(draws)
        first = torch.autograd.grad(mine, local, _mine(grad, group), retain_graph=True)
        second = torch.autograd.grad(mine, local, _mine(grad, group))
    assert len(forward) == 2, f"{len(forward)} masks drawn in forward, expected one per chunk"
    assert not torch.equal(generator.get_state(), start), "the generator did not advance"
    assert len(draws) == 6, f"{len(draws) - 2} masks drawn in two backwards, expected 4"
    for replay, original in zip(draws[2:], forward * 2, strict=True):
        assert torch.equal(replay, original), "backward redrew a mask the forward did not draw"
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), "a second backward gave other gradients"
    # scatter every rank's masks into the whole [b, hq, s, s] mask (rows: its query positions)
    keep = torch.zeros(BATCH, hq, s, s, dtype=torch.float64)
    positions = load_balanced_positions(s, group_size(group), group_rank(group))
    chunk = s // (2 * group_size(group))
    for slot, kept in enumerate(forward):
        rows = positions[slot * chunk : (slot + 1) * chunk]
        keep[:, :, rows, : kept.shape[-1]] = kept.double()
    keep = _sum_over(keep, group)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    dropped = 1.0 - keep[..., causal].mean().item()
    assert 0.15 < dropped < 0.45, f"{dropped:.2f} of the attended elements dropped, p = {p}"
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    out = _one_process(*whole, keep=keep, p=p)
    reference = (out, *torch.autograd.grad(out, whole, grad))
    _assert_matches((mine, *first), reference, group, f"math dropout hq={hq} hkv={hkv}")


def check_sdpa_dropout(group: Group, hq: int, hkv: int, p: float = 0.3) -> None:
    """SDPA draws its masks inside the kernel, so they are compared through what they do: the
    CP op's output and gradients equal autograd through SDPA on this rank's query chunks
    against the whole K/V, drawing from the same generator state; replaying the state
    replays the output; torch's global RNG is left alone."""
    cp_size, cp_rank = group_size(group), group_rank(group)
    s = _sequence(cp_size)
    q, k, v, grad = _whole(hq, hkv, s, seed=2)
    local = _leaves((q, k, v), group)
    generator = _rank_generator(group)
    start, global_state = generator.get_state(), torch.get_rng_state()
    mine = context_parallel_attention(*local, group, core="sdpa", dropout_p=p, generator=generator)
    first = torch.autograd.grad(mine, local, _mine(grad, group), retain_graph=True)
    second = torch.autograd.grad(mine, local, _mine(grad, group))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), "a second backward gave other gradients"
    assert torch.equal(torch.get_rng_state(), global_state), "torch's global RNG moved"
    generator.set_state(start)
    replay = context_parallel_attention(
        *local, group, core="sdpa", dropout_p=p, generator=generator
    )
    assert torch.equal(replay.detach(), mine.detach()), "the same generator state drew other masks"
    # reference: chunk r then 2c-1-r of this rank, each against its causal prefix of the whole K/V
    whole_kv = [x.clone().requires_grad_() for x in (k, v)]
    q_local = _mine(q, group).requires_grad_()
    positions, chunk = load_balanced_positions(s, cp_size, cp_rank), s // (2 * cp_size)
    draw = torch.Generator().manual_seed(0)
    draw.set_state(start)
    outs = []
    for slot in range(2):
        rows = positions[slot * chunk : (slot + 1) * chunk]
        keys = int(rows[-1]) + 1
        allowed = torch.arange(keys) <= rows.unsqueeze(1)
        with drawing_from(draw):
            outs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    q_local[:, :, slot * chunk : (slot + 1) * chunk],
                    whole_kv[0][:, :, :keys].repeat_interleave(hq // hkv, dim=1),
                    whole_kv[1][:, :, :keys].repeat_interleave(hq // hkv, dim=1),
                    attn_mask=allowed,
                    dropout_p=p,
                )
            )
    out = torch.cat(outs, dim=2)
    dq, dk, dv = torch.autograd.grad(out, [q_local, *whole_kv], _mine(grad, group))
    dk, dv = _mine(_sum_over(dk, group), group), _mine(_sum_over(dv, group), group)
    for name, got, expected in zip(
        ("output", "dq", "dk", "dv"), (mine, *first), (out, dq, dk, dv), strict=True
    ):
        error = relative_error(got, expected)
        assert error <= TOLERANCE, f"sdpa dropout hq={hq} hkv={hkv}: {name} off by {error:.2e}"


def check_saved_bytes(group: Group) -> None:
    """What a rank stores is q, k, v of its chunks (+ the generator state with dropout), as
    :func:`context_attention_saved_bytes` states; views of one QKV storage count once."""
    cp_size = group_size(group)
    s, (hq, hkv) = _sequence(cp_size), HEADS[1]
    for core in CONTEXT_ATTENTION_CORES:
        for p in (0.0, 0.3):
            generator = _rank_generator(group)
            state_bytes = generator.get_state().numel() if p else 0
            expected = context_attention_saved_bytes(
                BATCH, s, cp_size, hq, hkv, HEAD_DIM, 8, state_bytes
            )
            local = _leaves(_whole(hq, hkv, s)[:3], group)
            with SavedTensorTracker() as tracker:
                out = context_parallel_attention(
                    *local, group, core=core, dropout_p=p, generator=generator
                )
            assert tracker.report.total_bytes == expected, (core, p, tracker.report, expected)
            assert tracker.report.count == 3 + (p > 0)
            out.sum().backward()  # the saved tensors suffice for backward
    # q, k, v as views of one [b, hq + 2hkv, s/c, d] projection output
    qkv = torch.randn(
        BATCH, hq + 2 * hkv, s // cp_size, HEAD_DIM, dtype=torch.float64, requires_grad=True
    )
    with SavedTensorTracker() as tracker:
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)
        context_parallel_attention(q, k, v, group, core="sdpa")
    assert (
        tracker.report.total_bytes
        == context_attention_saved_bytes(BATCH, s, cp_size, hq, hkv, HEAD_DIM, 8)
        == qkv.untyped_storage().nbytes()
    )


def _randn(shape: tuple[int, ...] | list[int] | torch.Size, seed: int) -> Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _inner(a: Tensor, b: Tensor, replicated: bool, group: Group) -> Tensor:
    """<a, b> over the group: a replicated tensor counts once, per-rank ones are summed."""
    value = (a * b).sum()
    return value if replicated or group is None else _sum_over(value, group)


def check_adjoint(group: Group) -> None:
    """Each op's backward is the adjoint of its forward (the measure of tests/test_comm.py),
    along dims 0 and 2; gather(scatter(x)) == x; gathering the ranks' positions in global
    order gives 0 .. s-1."""
    cp_size, seed = group_size(group), 1000 * group_rank(group)
    s = _sequence(cp_size)
    ops = (  # op, input replicated, output replicated, input rows along dim
        (scatter_to_context_parallel, True, False, s),
        (gather_from_context_parallel, False, True, s // cp_size),
    )
    for dim in (0, 2):
        for op, in_replicated, out_replicated, rows in ops:
            shape = [3, 2, 3]
            shape[dim] = rows
            x = _randn(shape, 0 if in_replicated else 1 + seed).requires_grad_()
            out = op(x, group, dim=dim)
            y = _randn(out.shape, 7 if out_replicated else 8 + seed)
            (grad,) = torch.autograd.grad(out, x, y)
            lhs = _inner(out.detach(), y, out_replicated, group)
            rhs = _inner(x.detach(), grad, in_replicated, group)
            torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=0, msg=f"{op.__name__} dim {dim}")
    x = _randn((3, s), 5)
    round_trip = gather_from_context_parallel(scatter_to_context_parallel(x, group, 1), group, 1)
    assert torch.equal(round_trip, x)
    # the plain pair: reduce-scatter is the adjoint of the gather, both per-rank measures
    mine, theirs = _randn((3, s // cp_size), 9 + seed), _randn((3, s), 10 + seed)
    lhs = _inner(gather_context_sequence(mine, 1, group), theirs, False, group)
    rhs = _inner(mine, reduce_scatter_context_sequence(theirs, 1, group), False, group)
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=0)
    positions = load_balanced_positions(s, cp_size, group_rank(group))
    assert torch.equal(gather_context_sequence(positions, 0, group), torch.arange(s))


def check_token_mean(group: Group) -> None:
    """The mean over every token of the group (ranks counting different numbers of tokens);
    each rank's gradient is 1 / all tokens."""
    rank, cp_size = group_rank(group), group_size(group)
    loss_sum = torch.tensor(1.5 + rank, dtype=torch.float64, requires_grad=True)
    count = 3 + 2 * rank
    mean = context_token_mean(loss_sum, count, group)
    sums = [1.5 + r for r in range(cp_size)]
    counts = [3 + 2 * r for r in range(cp_size)]
    assert abs(mean.item() - sum(sums) / sum(counts)) <= 1e-15
    (grad,) = torch.autograd.grad(mean, loss_sum)
    assert abs(grad.item() - 1.0 / sum(counts)) <= 1e-15


def _worker(rank: int, world_size: int, full: bool) -> None:
    group = dist.group.WORLD
    if not full:  # the quick check
        check_parity(group, "math", *HEADS[1])
        check_adjoint(group)
        check_token_mean(group)  # ranks counting different numbers of tokens
        return
    for core in CONTEXT_ATTENTION_CORES:
        for hq, hkv in HEADS:
            check_parity(group, core, hq, hkv)
    for hq, hkv in HEADS[1:]:
        check_math_dropout(group, hq, hkv)
        check_sdpa_dropout(group, hq, hkv)
    check_saved_bytes(group)
    check_adjoint(group)
    check_token_mean(group)


def test_context_parallel_attention_on_two_ranks_quick() -> None:
    """c=2: GQA math attention equals one process; the split / gather ops are adjoint; the
    token mean over ranks with unequal token counts."""
    run_distributed(_worker, 2, False)


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_context_parallel_equals_one_process(cp_size: int) -> None:
    """c in {2, 4}: math and sdpa, MHA / GQA / one KV head, dropout off and on (recorded
    masks), saved bytes, adjointness, the token mean."""
    run_distributed(_worker, cp_size, True)


# --- one process (c = 1) and the layout itself ------------------------------------------------


@pytest.mark.parametrize("core", list(CONTEXT_ATTENTION_CORES))
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_one_rank_is_plain_causal_attention(core: str, hq: int, hkv: int) -> None:
    check_parity(None, core, hq, hkv)


def test_one_rank_dropout_saved_bytes_adjoint_and_token_mean() -> None:
    check_math_dropout(None, *HEADS[1])
    check_sdpa_dropout(None, *HEADS[1])
    check_saved_bytes(None)
    check_adjoint(None)
    check_token_mean(None)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_load_balanced_layout(cp_size: int) -> None:
    """Rank r holds chunks r and 2c-1-r; together the ranks hold every position once; every
    rank's queries see the same number of keys under the causal mask."""
    s = 4 * cp_size * 3
    chunk = s // (2 * cp_size)
    held, work = [], set()
    for rank in range(cp_size):
        positions = load_balanced_positions(s, cp_size, rank)
        assert positions.tolist() == [
            *range(rank * chunk, (rank + 1) * chunk),
            *range((2 * cp_size - 1 - rank) * chunk, (2 * cp_size - rank) * chunk),
        ]
        x = torch.arange(s).repeat(2, 1)
        assert torch.equal(shard_for_context_parallel(x, 1, cp_size, rank), positions.repeat(2, 1))
        held.append(positions)
        work.add(int((positions + 1).sum()))  # keys seen by this rank's queries
    assert torch.equal(torch.cat(held).sort().values, torch.arange(s))
    assert torch.equal(
        torch.cat(held),
        torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in rank_order_chunks(cp_size)]),
    )
    assert len(work) == 1, f"ranks see {sorted(work)} keys: not balanced"


def test_errors_name_the_value() -> None:
    q = torch.zeros(1, 4, 6, 2)
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2 \* "):
        check_context_split(6, 2)
    with pytest.raises(ValueError, match="hkv=3 must divide hq=4"):
        context_parallel_attention(q, torch.zeros(1, 3, 6, 2), torch.zeros(1, 3, 6, 2), None)
    with pytest.raises(ValueError, match="core='flash' is not one of math, sdpa"):
        context_parallel_attention(q, q, q, None, core="flash")
    with pytest.raises(ValueError, match="needs a generator"):
        context_parallel_attention(q, q, q, None, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p=1.0 must be in \[0, 1\)"):
        context_parallel_attention(q, q, q, None, dropout_p=1.0)
    odd = torch.zeros(1, 4, 5, 2)
    with pytest.raises(ValueError, match="sequence length 5 is not divisible by 2"):
        context_parallel_attention(odd, odd, odd, None)
    # eval: no dropout, nothing drawn
    generator = torch.Generator().manual_seed(0)
    before = generator.get_state()
    context_parallel_attention(q, q, q, None, dropout_p=0.5, generator=generator, training=False)
    assert torch.equal(generator.get_state(), before)
