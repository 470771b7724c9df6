"""Self-attention with query heads and key/value groups split over the tensor-parallel group,
and rotary position embeddings.

Heads: ``a`` query heads in ``g`` key/value groups of ``r = a/g`` (``g = a``: multi-head;
``g < a``: grouped-query). The query, key and value projections are three column-parallel
linears run as one matmul whose output rows are interleaved per group,
``[s, b, group, (q_1 … q_r | k | v), d]`` (for ``g = a`` that is ``[head][q|k|v][d]``), so Q,
K and V are views of one storage. Under tensor parallelism a rank holds ``a/t`` query heads
and either ``g/t`` groups (t divides g) or, with fewer groups than ranks, the one group its
query heads use, held by the ``t/g`` ranks that share it (``replicas``), whose weight
gradients :func:`~lightning_sp.parallel.grads.finalize_grads` sums over them.

The attention core (:mod:`lightning_sp.model.cores`) sees ``q: [b·g_l, r_l, s, d]`` and
``k, v: [b·g_l, 1, s, d]`` (``g_l`` groups and ``r_l`` query heads per group on this rank).

Context parallelism (``c > 1``): the rank's local sequence is its two load-balanced chunks,
``s/c`` tokens (``[s/(c·t), b, h]`` in and out under SP, ``[s/c, b, h]`` without). RoPE rotates
by the chunks' true global positions (:func:`token_positions`). The core is
:func:`~lightning_sp.parallel.context_attention.context_parallel_attention` over the CP group,
which takes the same views unchanged: ``q [B, r, s/c, d]`` as its ``[b, hq, s/c, d]`` with
``b = B`` and ``hq = r``, ``k, v [B, 1, s/c, d]`` as ``[b, hkv = 1, s/c, d]`` (query head ``j``
of a group uses the group's one K/V head, as it requires). It stores ``q, k, v`` (views of the
one QKV storage, already counted) and recomputes its own core in backward, so ``core_attn``
recomputation is off under CP (it would only redo the same work twice); its K/V exchange runs
between the same TP rank of each CP group. Dropout draws from the sharded stream, which is
seeded per CP rank.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from lightning_sp.model.cores import ATTENTION_BACKENDS, CoreFn
from lightning_sp.model.fused import fused_column_linear, heads_row_linear
from lightning_sp.model.ops import rope_inverse_frequencies, rope_tables, rotate_half
from lightning_sp.model.parts.build import BuildContext, LayerConfig
from lightning_sp.model.qk_norm import QKNorm
from lightning_sp.model.recompute import recompute
from lightning_sp.model.spec import NORMS, POSITIONS, NormModule
from lightning_sp.parallel.context import load_balanced_positions
from lightning_sp.parallel.context_attention import context_parallel_attention
from lightning_sp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_sp.parallel.state import ParallelState


def _context(state: ParallelState | None) -> tuple[int, int]:
    """``(c, cp_rank)`` of ``state`` (one process: ``(1, 0)``)."""
    return (1, 0) if state is None else (state.context_parallel_size, state.context_parallel_rank)


def token_positions(
    start: int,
    length: int,
    state: ParallelState | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """The global positions (int64 ``[length]``) of a local sequence of ``length`` tokens on
    the rank ``state`` describes (None: one process): ``start .. start + length - 1`` for
    ``c = 1``; under context parallelism (``c > 1``, ``start`` 0 in training) this CP rank's two
    load-balanced chunks of the ``length·c``-token sequence
    (:func:`~lightning_sp.parallel.context.load_balanced_positions`) plus ``start``."""
    size, rank = _context(state)
    if size == 1:
        return torch.arange(start, start + length, device=device)
    return start + load_balanced_positions(length * size, size, rank, device=device)


class Rotary:
    """The RoPE cos/sin tables of one model (no parameters), cached per (positions, dtype)."""

    def __init__(self, config: LayerConfig) -> None:
        self.config = config
        self._cache: dict[tuple[object, ...], tuple[Tensor, Tensor]] = {}
        self._per_token: tuple[Tensor, int, torch.dtype, tuple[Tensor, Tensor]] | None = None

    def per_token(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos, sin`` (``[n, d]``) for a micro-batch's per-token ``positions`` (``[b, s]``,
        flattened), made once and shared by every layer of the model: the last micro-batch's
        are kept (the same tensor object, unmodified, and dtype), so a micro-batch holds one
        pair, ``2·e·b·s·d`` bytes, however many layers rotate by it (each layer's rotation
        keeps a reference until its backward)."""
        if positions.is_inference():  # no version counter; nothing is saved for a backward
            return self.tables_at(positions.reshape(-1), dtype)
        kept = self._per_token
        if (
            kept is not None
            and kept[0] is positions
            and kept[1] == positions._version
            and kept[2] == dtype
        ):
            return kept[3]
        tables = self.tables_at(positions.reshape(-1), dtype)
        if not is_fake(tables[0]):  # as tables(): none made under a fake mode is kept
            self._per_token = (positions, positions._version, dtype, tables)
        return tables

    def tables(
        self,
        start: int,
        length: int,
        dtype: torch.dtype,
        device: torch.device,
        state: ParallelState | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``cos, sin``, each ``[length, d]``, for the positions :func:`token_positions` gives
        (``[start, start + length)`` without context parallelism; the generation cache's path
        passes ``start``)."""
        c, rank = _context(state)
        key = (start, length, c, rank, dtype, device)
        if key in self._cache:
            return self._cache[key]
        positions = token_positions(start, length, state, device)
        tables = self.tables_at(positions, dtype, start + length * c)
        if not is_fake(tables[0]):  # tables made under a fake mode (the planner's) are not kept
            if len(self._cache) > 8:
                self._cache.clear()
            self._cache[key] = tables
        return tables

    def tables_at(
        self, positions: Tensor, dtype: torch.dtype, seq_len: int = 0
    ) -> tuple[Tensor, Tensor]:
        """``cos, sin`` (``[n, d]``, not cached) for any positions ``[n]`` of a sequence of
        ``seq_len`` tokens (read by ``dynamic`` RoPE scaling only, which is unscaled up to its
        ``original_max_position_embeddings``)."""
        config = self.config
        inv_freq = rope_inverse_frequencies(
            config.head_dim, config.rope_theta, config.rope_scaling, seq_len
        )
        return rope_tables(positions, inv_freq, dtype)


class _Rope(torch.autograd.Function):
    """Rotate the queries and keys of a fused QKV tensor ``[s, B, r + 2, d]`` (slots ``:r+1``),
    copying the values, into a new tensor of the same layout.

    forward:  ``y = x·cos + rotate_half(x)·sin`` on Q and K; V copied.
    backward: ``grad_x = grad·cos - rotate_half(grad·sin)`` on Q and K (the rotation is
              orthogonal); V's gradient passed through.
    saves:    nothing but the (shared, ``[s, d]``) tables: the rotation needs no input.
    """

    @staticmethod
    def forward(ctx: Any, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.tables = (cos, sin)
        out = qkv.clone()
        qk = qkv[..., :-1, :]  # [s, B, r + 1, d], or [s, b, g, r + 1, d] (per-token positions)
        out[..., :-1, :] = qk * cos + rotate_half(qk) * sin
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.tables
        out = grad.clone()
        gqk = grad[..., :-1, :]
        out[..., :-1, :] = gqk * cos - rotate_half(gqk * sin)
        return out, None, None


class Attention(nn.Module):
    """Self-attention, heads split over the tensor-parallel group (see module docstring).

    ``forward(x)``: ``[s/t or s, b, h]`` normalised input -> ``[s/t or s, b, h]`` (before the
    residual dropout). ``forward(x, norm)``: ``x`` is the layer input, normalised by ``norm``
    inside the QKV linears and recomputed in their backward (``layernorm`` recompute).
    Public pieces: ``query``, ``key``, ``value`` (column parallel), ``proj`` (row parallel),
    ``heads`` (Q, K, V at given positions), ``output`` (the projection of a context).
    """

    def __init__(self, ctx: BuildContext) -> None:
        """Built from ``ctx`` whole: its config's sizes, its layout, its dropout streams, its
        layer's ``core_attn`` recompute module and the model's RoPE tables."""
        super().__init__()
        config, state, kwargs = ctx.config, ctx.state, ctx.kwargs
        t = state.tensor_parallel_size
        a, g, d, h = config.num_heads, config.groups, config.head_dim, config.hidden_size
        sp = config.sequence_parallel
        self.local_heads = a // t
        self.local_groups = max(g // t, 1)
        self.per_group = self.local_heads // self.local_groups
        self.head_dim = d
        replicas = max(t // g, 1)
        self.dropout_p = config.attention_dropout
        self.backend = ATTENTION_BACKENDS[config.attention]
        self.core: CoreFn = self.backend.core
        self.cp_group = state.cp_group
        self.state = state
        # the CP core recomputes itself in backward: core_attn would redo it twice
        cp = state.context_parallel_size > 1
        self.recompute_core = ctx.recomputes("core_attn") and self.backend.keeps_scores and not cp
        self.rng = ctx.rng
        self.norm_kind = NORMS[config.normalization]
        self.rotary = ctx.rotary if not POSITIONS[config.position_embedding].learned else None
        common: dict[str, Any] = {
            "sequence_parallel": sp, "bias": config.has_bias("qkv"), "init_std": config.init_std,
            **kwargs,
        }  # fmt: skip
        self.query = ColumnParallelLinear(h, a * d, state, **common)
        self.key = ColumnParallelLinear(h, g * d, state, replicas=replicas, **common)
        self.value = ColumnParallelLinear(h, g * d, state, replicas=replicas, **common)
        if self.key.bias is not None and self.rotary is None:
            # softmax ignores a shift common to every key of a row (causal mask and dropout
            # included): unrotated, the key bias's gradient is zero in exact arithmetic
            self.key.bias.inert_gradient = True  # type: ignore[attr-defined]
        self.qk_norm = None
        if config.qk_norm is not None:
            self.qk_norm = QKNorm(
                config.qk_norm, a, g, d, config.layernorm_eps, state, **kwargs
            )  # fmt: skip
        state.tensor_parallel_subgroup(replicas)  # made now, on every rank together
        self.proj = RowParallelLinear(
            a * d, h, state, sequence_parallel=sp, bias=config.has_bias("proj"),
            init_std=config.output_init_std, **kwargs,
        )  # fmt: skip

    def heads(
        self,
        x: Tensor,
        norm: NormModule | None = None,
        start: int = 0,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Q ``[B, r, s, d]``, K and V ``[B, 1, s, d]`` (``B = b·g_l``) of ``x`` ``[s/t or s, b,
        h]``, rotated under RoPE for positions ``[start, start + s)``, or under context
        parallelism (``s`` the local sequence) for this CP rank's chunks' true positions
        (:func:`token_positions`); ``positions`` (``[b, s]``, e.g. restarting per document)
        replaces them. Views of one storage."""
        qkv = fused_column_linear(  # [s, b, g_l·(r+2)·d]
            x, (self.query, self.key, self.value), self.local_groups, norm, self.norm_kind
        )
        s, b, _ = qkv.shape
        if self.qk_norm is not None:  # [s, b, g_l, r+2, d]: queries and keys normalised
            qkv = self.qk_norm(qkv.view(s, b, self.local_groups, -1, self.head_dim))
        qkv = qkv.view(s, b * self.local_groups, self.per_group + 2, self.head_dim)
        if self.rotary is not None and positions is not None:  # per token: [s, b, 1, 1, d]
            cos, sin = (
                y.view(b, s, 1, 1, -1).transpose(0, 1)
                for y in self.rotary.per_token(positions, qkv.dtype)
            )
            qkv = _Rope.apply(qkv.view(s, b, self.local_groups, *qkv.shape[2:]), cos, sin)
            qkv = qkv.view(s, b * self.local_groups, *qkv.shape[3:])
        elif self.rotary is not None:
            cos, sin = self.rotary.tables(start, s, qkv.dtype, qkv.device, self.state)
            qkv = _Rope.apply(qkv, cos[:, None, None], sin[:, None, None])
        r = self.per_group
        q, k, v = (y.permute(1, 2, 0, 3) for y in qkv.split([r, 1, 1], dim=2))
        return q, k, v

    def output(self, context: Tensor, b: int) -> Tensor:
        """The output projection of a context ``[B, r, s, d]``: ``-> [s/t or s, b, h]``."""
        return heads_row_linear(context, self.proj, b)

    def _core(self, q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None = None) -> Tensor:
        if self.state.context_parallel_size > 1:
            # [B, r, s/c, d] as [b, hq, s/c, d]; K/V [B, 1, s/c, d]
            return context_parallel_attention(
                q, k, v, self.cp_group, core=self.backend.name, dropout_p=self.dropout_p,
                generator=self.rng.sharded, training=self.training, documents=documents,
            )  # fmt: skip
        return self.core(q, k, v, self.dropout_p, self.rng.sharded, self.training, documents)

    def forward(
        self,
        x: Tensor,
        norm: NormModule | None = None,
        documents: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """``documents`` (``[b, s]`` ids of the whole sequence): block-causal attention;
        ``positions`` (``[b, s]``, the local tokens'): RoPE at those positions
        (:mod:`lightning_sp.model.documents`)."""
        q, k, v = self.heads(x, norm, positions=positions)
        b = q.shape[0] // self.local_groups
        if self.recompute_core and self.training and torch.is_grad_enabled():
            context = recompute(partial(self._core, documents=documents), self.rng, q, k, v)
        else:
            context = self._core(q, k, v, documents)
        return self.output(context, b)  # [s/t or s, b, h]
