"""Causal self-attention across a context-parallel group: all-gather K/V, keep only the local
chunks for backward.

Each CP rank holds the queries, keys and values of its two chunks of the sequence (causal load
balancing, :mod:`lightning_sp.parallel.context`): ``q: [b, hq, s/c, d]``, ``k, v: [b, hkv, s/c,
d]``. Forward all-gathers K and V (one collective, the ``hkv`` KV heads only: under GQA the
expanded heads are never exchanged) into global order and attends each local query chunk ``i``
to the keys it may see, the prefix ``0 .. (i+1)L - 1``, under the causal mask of the true global
positions (query at position ``p`` sees keys at positions ``<= p``). Backward all-gathers K/V
again, recomputes the attention core (the dropout masks replayed from the generator state saved
before the forward's draws), and reduce-scatters dK/dV to the ranks that own those chunks, as
the sequence-parallel column linear keeps only its input shard.

**Stored for backward, per rank and per call** (``e`` bytes per element):

* ``q``: ``e·b·hq·(s/c)·d``; ``k`` and ``v``: ``2·e·b·hkv·(s/c)·d`` (this rank's chunks only);
  the tensors as given, so views of one QKV storage count that storage once;
* with dropout (training, ``dropout_p > 0``): the generator's state before the draws, a uint8
  tensor of ``generator.get_state().numel()`` bytes (5056 for CPU's Mersenne Twister, 16 for
  CUDA's Philox), whatever ``s``.

In total ``e·b·(s/c)·d·(hq + 2·hkv)`` bytes (+ the generator state): nothing of size ``s`` or
``s²``; :func:`context_attention_saved_bytes`. The output is not stored (the caller's output
projection keeps it, as without CP).

**Transient** (freed before the call returns): the gathered K/V, ``2·e·b·hkv·s·d`` (forward and
backward; twice that for a moment while it is put into global order), and dK/dV before the
reduce-scatter, the same size; the core's intermediates (``math``: scores and probabilities
``[b, hq, L, (i+1)L]`` per local chunk, and in backward their autograd graph).

Why an all-gather and not a ring of send/recv: with GQA, K and V together are ``2·hkv/hq`` of
the queries' size (1/4 for Llama 3 70B's 64 query and 8 KV heads); one collective per direction
replaces ``c - 1`` dependent steps; and each query chunk attends one contiguous key prefix, so
the causal mask needs no per-step bookkeeping. The price is the transient ``2·e·b·hkv·s·d``
above where a ring holds two chunks.

**Communication per call and rank**: forward one all-gather of ``2·b·hkv·(s/c)·d`` elements per
rank; backward one all-gather and one reduce-scatter of the same size. **Compute**: each rank's
two chunks attend ``(2c+1)·L²`` query-key pairs per head (``L = s/(2c)``), equal on every rank;
backward redoes the forward core once (for ``sdpa`` that is one more attention forward than
without CP; for ``math`` it is what ``core_attn`` recomputation does anyway).

Dropout: the mask of chunk ``i`` (``[b, hq, L, (i+1)L]``, local chunk 0 then 1) is drawn from
``generator``, which advances by both draws. Give every CP rank a generator of its own stream
(seeded with its CP rank) so that different query rows get independent masks; replaying the
generator's state (recompute) redraws identical masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sp.parallel.comm import Group, group_rank, group_size
from lightning_sp.parallel.context import (
    check_context_split,
    gather_context_sequence,
    load_balanced_positions,
    rank_chunks,
    reduce_scatter_context_sequence,
)
from lightning_sp.parallel.random import drawing_from, dropout

ChunkCore = Callable[[Tensor, Tensor, Tensor, Tensor, float, torch.Generator | None], Tensor]

# ``enable_gqa`` arrived in torch 2.5; older SDPA gets K/V expanded locally (after the exchange)
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _math_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    dropout_p: float,
    generator: torch.Generator | None,
) -> Tensor:
    """``softmax(QKᵀ/√d + mask) -> dropout -> ·V`` for one query chunk.

    ``q: [b, hq, Lq, d]``, ``k, v: [b, hkv, Lk, d]``, ``allowed: [Lq, Lk]`` or ``[b, Lq,
    Lk]`` (True: attend).
    Query head ``j`` uses KV head ``j // (hq/hkv)``; the ``hq/hkv`` query heads of one KV head
    are stacked along the rows, so K and V are never expanded. Returns ``[b, hq, Lq, d]``.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    if allowed.dim() == 3:
        allowed = allowed[:, None, None]  # [b, 1, 1, Lq, Lk]
    rows = q.reshape(b, hkv, group * lq, d)
    scores = torch.matmul(rows, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(d))
    scores = scores.view(b, hkv, group, lq, lk).masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(scores.view(b, hq, lq, lk), dim=-1)
    if dropout_p > 0.0:
        assert generator is not None
        probs = dropout(probs, dropout_p, generator, True)
    return torch.matmul(probs.view(b, hkv, group * lq, lk), v).view(b, hq, lq, d)


def _sdpa_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    dropout_p: float,
    generator: torch.Generator | None,
) -> Tensor:
    """One query chunk through ``F.scaled_dot_product_attention`` with the boolean mask
    ``allowed`` (True: attend); dropout drawn from ``generator`` (swapped in as the device's
    default generator, :func:`~lightning_sp.parallel.random.drawing_from`). On CUDA an explicit
    mask selects the memory-efficient kernel, not flash (``allowed`` is the lower-right causal
    mask of ``torch.nn.attention.bias.causal_lower_right``, which would keep flash: not yet
    measured on a GPU)."""
    kwargs: dict[str, Any] = {}
    if allowed.dim() == 3:
        allowed = allowed.unsqueeze(1)  # [b, 1, Lq, Lk]
    if q.shape[1] != k.shape[1]:
        if _SDPA_GQA:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    attend = nn.functional.scaled_dot_product_attention
    if dropout_p == 0.0:
        return attend(q, k, v, attn_mask=allowed, **kwargs)
    assert generator is not None
    with drawing_from(generator):
        return attend(q, k, v, attn_mask=allowed, dropout_p=dropout_p, **kwargs)


CONTEXT_ATTENTION_CORES: dict[str, ChunkCore] = {"math": _math_chunk, "sdpa": _sdpa_chunk}
"""The attention cores :func:`context_parallel_attention` runs, by the model's backend names."""


def _attend(
    q: Tensor,
    kv: Tensor,
    group: Group,
    core: str,
    p: float,
    generator: torch.Generator | None,
    documents: Tensor | None = None,
) -> Tensor:
    """This rank's queries ``[b, hq, 2L, d]`` against the whole sequence's stacked K and V
    ``[2, b, hkv, s, d]`` (global order): each local chunk against the keys it may see, and
    with ``documents`` (``[b', s]`` ids of the whole sequence, ``b = b'·n``) only those of the
    query's own document."""
    cp_size, cp_rank = group_size(group), group_rank(group)
    chunk = q.shape[2] // 2
    positions = load_balanced_positions(2 * chunk * cp_size, cp_size, cp_rank, device=q.device)
    outs = []
    for slot, index in enumerate(rank_chunks(cp_size, cp_rank)):
        keys = (index + 1) * chunk  # every later key is masked for the whole chunk
        query_positions = positions[slot * chunk : (slot + 1) * chunk]
        allowed = torch.arange(keys, device=q.device) <= query_positions.unsqueeze(1)
        if documents is not None:  # [b, L, keys]: causal and within one document
            same = documents[:, query_positions, None] == documents[:, None, :keys]
            repeat = q.shape[0] // documents.shape[0]
            allowed = allowed & (same.repeat_interleave(repeat, 0) if repeat > 1 else same)
        outs.append(
            CONTEXT_ATTENTION_CORES[core](
                q.narrow(2, slot * chunk, chunk),
                kv[0].narrow(2, 0, keys),
                kv[1].narrow(2, 0, keys),
                allowed,
                p,
                generator,
            )
        )
    return torch.cat(outs, dim=2)


class _ContextParallelAttention(torch.autograd.Function):
    """See the module docstring: saves ``q, k, v`` as given (and the generator state)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        group: Group,
        core: str,
        dropout_p: float,
        generator: torch.Generator | None,
        documents: Tensor | None,
    ) -> Tensor:
        kv = gather_context_sequence(torch.stack((k, v)), 3, group)  # [2, b, hkv, s, d]
        saved = [q, k, v]
        if dropout_p > 0.0:
            assert generator is not None
            saved.append(generator.get_state())
            ctx.generator_device = generator.device
        ctx.group, ctx.core, ctx.dropout_p = group, core, dropout_p
        ctx.documents = documents  # by reference: the micro-batch's one ids tensor
        ctx.save_for_backward(*saved)
        return _attend(q, kv, group, core, dropout_p, generator, documents)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, *rng_state = ctx.saved_tensors
        replay = None
        if rng_state:  # a private generator at the forward's state: the same masks again
            replay = torch.Generator(device=ctx.generator_device)
            replay.set_state(rng_state[0])
        kv = gather_context_sequence(torch.stack((k, v)), 3, ctx.group)
        with torch.enable_grad():
            q_leaf = q.detach().requires_grad_()
            kv_leaf = kv.detach().requires_grad_()
            out = _attend(
                q_leaf, kv_leaf, ctx.group, ctx.core, ctx.dropout_p, replay, ctx.documents
            )
            grad_q, grad_kv = torch.autograd.grad(out, (q_leaf, kv_leaf), grad)
        grad_kv = reduce_scatter_context_sequence(grad_kv, 3, ctx.group)  # [2, b, hkv, s/c, d]
        return grad_q, grad_kv[0], grad_kv[1], None, None, None, None, None


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group,
    *,
    core: str = "math",
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    training: bool = True,
    documents: Tensor | None = None,
) -> Tensor:
    """Causal attention of this CP rank's queries over the whole sequence of the CP group.

    ``q: [b, hq, s/c, d]`` (this rank's two chunks, local order), ``k, v: [b, hkv, s/c, d]``
    with ``hkv`` dividing ``hq`` (query head ``j`` uses KV head ``j // (hq/hkv)``, as
    ``repeat_interleave`` expands them); returns ``[b, hq, s/c, d]``, this rank's rows of
    ``softmax(QKᵀ/√d + causal) -> dropout -> ·V`` over the full sequence. ``core``: ``math``
    or ``sdpa`` (:data:`CONTEXT_ATTENTION_CORES`). Dropout (``dropout_p`` when ``training``)
    draws from ``generator``. ``group``: the CP process group; ``None`` or one rank is
    ``c = 1``, plain causal attention over ``q``'s sequence. Stores and exchanges what the
    module docstring states. ``documents``: ``[b', s]`` ids of the **whole** sequence (global
    order, ``b = b'·n``): block-causal, a query sees only the keys of its own document
    (:mod:`lightning_sp.model.documents`); held by reference, not stored per call.
    """
    _check(q, k, v, group, core, dropout_p)
    p = dropout_p if training else 0.0
    if p > 0.0:
        if generator is None:
            raise ValueError("context_parallel_attention with dropout needs a generator")
        if generator.device.type != q.device.type:
            raise ValueError(
                f"context_parallel_attention on {q.device.type} tensors with a "
                f"{generator.device.type} generator: draw from a generator on {q.device.type}"
            )
    out: Tensor = _ContextParallelAttention.apply(q, k, v, group, core, p, generator, documents)
    return out


def _check(q: Tensor, k: Tensor, v: Tensor, group: Group, core: str, dropout_p: float) -> None:
    if core not in CONTEXT_ATTENTION_CORES:
        raise ValueError(f"core={core!r} is not one of {', '.join(CONTEXT_ATTENTION_CORES)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q "
            "[b, hq, s/c, d] and k, v of one shape [b, hkv, s/c, d]"
        )
    (b, hq, local, d), (bk, hkv, local_k, dk) = q.shape, k.shape
    if (b, local, d) != (bk, local_k, dk) or hq % hkv:
        raise ValueError(
            f"q {tuple(q.shape)} and k, v {tuple(k.shape)}: batch, sequence and head_dim must "
            f"match and hkv={hkv} must divide hq={hq}"
        )
    cp_size = group_size(group)
    check_context_split(local * cp_size, cp_size)


def context_attention_saved_bytes(
    batch: int,
    seq_len: int,
    cp_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    element_size: int,
    generator_state_bytes: int = 0,
) -> int:
    """Bytes one :func:`context_parallel_attention` call stores for backward on each rank:
    ``e·b·(s/c)·d·(hq + 2·hkv)`` plus the generator state (pass its size when dropout is on)."""
    local = seq_len // cp_size
    return (
        element_size * batch * local * head_dim * (q_heads + 2 * kv_heads) + generator_state_bytes
    )
