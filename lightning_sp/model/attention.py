"""Self-attention and its backends.

A backend is one descriptor in :data:`ATTENTION_BACKENDS`: the attention-core function
(``[b·a/t, s, d]`` Q, K, V in, the context out, dropout drawn from the generator it is given),
whether it keeps ``s x s`` tensors for backward (what ``core_attn`` recomputation can drop),
and the matmul FLOPs its backward redoes. The memory formulas, the FLOPs count and the planner
read the descriptor (``GPTConfig.attention`` names it).

* ``math``: the paper's: ``softmax(QKᵀ/√d + causal) -> dropout -> ·V``, storing the softmax
  output, a 1-byte mask and the dropout output (``5as²b/t``, Table 2).
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``. The fused
  kernels (flash / memory-efficient on CUDA, flash on CPU) store Q, K, V (views of the QKV
  output, ``6sbh/t``), their output (``2sbh/t``, which the projection shares) and an fp32
  logsumexp (``4asb/t`` bytes); their backward recomputes QKᵀ. Attention dropout draws from
  our sharded stream (:func:`~lightning_sp.parallel.random.drawing_from` swaps it in as the
  device's default generator, host-side, and torch's own state is restored), so masks differ
  per TP rank and replay identically under recompute.
  On CPU with ``dropout_p > 0`` torch leaves the fused kernel for a math fallback that stores
  fp32 ``s x s`` scores and masks (measured 108sbh for one core at s=256, a=8, h=256, bf16,
  torch 2.13); the model warns once when that happens.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sp.errors import ConfigError
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.fused import heads_row_linear, norm_column_linear
from lightning_sp.model.recompute import recompute
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_sp.parallel.random import RNGStreams, drawing_from, dropout
from lightning_sp.parallel.state import ParallelState

CoreFn = Callable[[Tensor, Tensor, Tensor, float, torch.Generator, bool], Tensor]


def attention_core(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, generator: torch.Generator, training: bool
) -> Tensor:
    """Causal softmax(QKᵀ/√d) V with dropout on the probabilities (the ``math`` backend, the
    part ``core_attn`` recomputes). ``q, k, v``: ``[b·a/t, s, d]`` -> ``[b·a/t, s, d]``."""
    s = q.shape[1]
    causal = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    scores = torch.baddbmm(  # [b·a/t, s, s]; baddbmm saves only q and k
        causal.expand(q.shape[0], s, s), q, k.transpose(1, 2), alpha=1.0 / math.sqrt(q.shape[-1])
    )
    probs = torch.softmax(scores, dim=-1)  # saves its output
    probs = dropout(probs, dropout_p, generator, training)  # saves a 1-byte mask
    return torch.bmm(probs, v)  # saves probs and v


def sdpa_core(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, generator: torch.Generator, training: bool
) -> Tensor:
    """Causal attention through ``F.scaled_dot_product_attention`` (the ``sdpa`` backend).

    ``q, k, v``: ``[b·a/t, s, d]``; run as one batch of ``b·a/t`` heads, ``[1, b·a/t, s, d]``,
    so that the fused kernels' output, laid out ``[1, s, b·a/t, d]`` in memory, merges into
    ``[s, b, h/t]`` without a copy. Returns ``[b·a/t, s, d]``.
    """
    p = dropout_p if training else 0.0
    q, k, v = (y.unsqueeze(0) for y in (q, k, v))
    if p == 0.0:
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.squeeze(0)
    if q.device.type == "cpu":
        warnings.warn(
            "attention='sdpa' with attention_dropout > 0 on CPU: torch's fused CPU kernel has "
            "no dropout, so SDPA falls back to its math path, which stores s x s scores and "
            "masks (more than attention='math'); use attention_dropout=0 or attention='math' "
            "on CPU",
            stacklevel=2,
        )
    with drawing_from(generator):  # our sharded stream, not torch's global RNG
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    return out.squeeze(0)


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend: its core function and what it costs in memory and FLOPs."""

    name: str
    core: CoreFn
    """``core(q, k, v, dropout_p, generator, training)``, ``[b·a/t, s, d]`` in and out."""
    keeps_scores: bool
    """Whether it stores ``s x s`` tensors for backward (``core_attn`` drops them)."""
    backward_redone_flops: Callable[[ActivationShape], float]
    """Matmul FLOPs its backward recomputes per layer for ``shape.b`` sequences (all ranks)."""


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend("math", attention_core, True, lambda x: 0.0),
        # flash-style backward recomputes the scores QKᵀ (2bs²h) from the logsumexp
        AttentionBackend("sdpa", sdpa_core, False, lambda x: 2.0 * x.b * x.s * x.s * x.h),
    )
}
"""Every attention backend, by ``GPTConfig.attention`` name."""


def check_attention(name: object) -> None:
    """:class:`ConfigError` (one line) unless ``name`` is a backend this torch can run."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention={name!r} is not an attention backend; valid: "
            f"{', '.join(ATTENTION_BACKENDS)}"
        )
    if name == "sdpa" and not hasattr(nn.functional, "scaled_dot_product_attention"):
        raise ConfigError(
            f"attention='sdpa' needs torch.nn.functional.scaled_dot_product_attention, which "
            f"torch {torch.__version__} lacks (torch >= 2.0); use attention='math'"
        )


class Attention(nn.Module):
    """Self-attention, heads split over the tensor-parallel group.

    ``forward(x)``: ``[s/t or s, b, h]`` normalised input -> ``[s/t or s, b, h]`` (before the
    residual dropout). ``forward(x, norm)``: ``x`` is the layer input, normalised by ``norm``
    inside the QKV linear and recomputed in its backward (``layernorm`` recompute).
    Public pieces: ``qkv`` (column parallel, rows ordered ``[head][q|k|v][d]``), ``proj`` (row
    parallel), ``core`` (the backend's core function).
    """

    def __init__(
        self,
        config: GPTConfig,
        state: ParallelState,
        rng: RNGStreams,
        recompute_core: bool,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        sp = config.sequence_parallel
        self.local_heads = config.num_heads // state.tensor_parallel_size
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_dropout
        self.backend = ATTENTION_BACKENDS[config.attention]
        self.core: CoreFn = self.backend.core
        self.recompute_core = recompute_core and self.backend.keeps_scores
        self.rng = rng
        self.qkv = ColumnParallelLinear(
            config.hidden_size, 3 * config.hidden_size, state,
            sequence_parallel=sp, init_std=config.init_std, **kwargs,
        )  # fmt: skip
        self.proj = RowParallelLinear(
            config.hidden_size, config.hidden_size, state,
            sequence_parallel=sp, init_std=config.output_init_std, **kwargs,
        )  # fmt: skip

    def _core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.core(q, k, v, self.dropout_p, self.rng.sharded, self.training)

    def forward(self, x: Tensor, norm: nn.LayerNorm | None = None) -> Tensor:
        qkv = self.qkv(x) if norm is None else norm_column_linear(x, norm, self.qkv)
        s, b, _ = qkv.shape  # [s, b, 3h/t]
        qkv = qkv.view(s, b * self.local_heads, 3 * self.head_dim)
        # three views of one storage: [s, b·a/t, d] -> [b·a/t, s, d]
        q, k, v = (y.transpose(0, 1) for y in qkv.split(self.head_dim, dim=-1))
        if self.recompute_core and self.training and torch.is_grad_enabled():
            context = recompute(self._core, self.rng, q, k, v)
        else:
            context = self._core(q, k, v)
        return heads_row_linear(context, self.proj, b)  # [s/t or s, b, h]
