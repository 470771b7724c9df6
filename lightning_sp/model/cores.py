"""The attention core and its backends.

A backend is one descriptor in :data:`ATTENTION_BACKENDS`: the attention-core function, whether
it keeps ``s x s`` tensors for backward (what ``core_attn`` recomputation can drop), and the
matmul FLOPs its backward redoes. The memory formulas, the FLOPs count and the planner read the
descriptor (``GPTConfig.attention`` names it).

Layout: a core takes the heads of one rank grouped by key/value group, ``q: [B, r, s, d]`` and
``k, v: [B, 1, s, d]`` with ``B = b·g/t`` (micro-batch times this rank's key/value groups) and
``r`` query heads per group (``r = 1``: multi-head attention), all views of the QKV output
laid out ``[s, b, group, (q_1 … q_r | k | v), d]``, and returns the context ``[B, r, s, d]``.

* ``math``: the paper's: ``softmax(QKᵀ/√d + causal) -> dropout -> ·V``, storing the softmax
  output, a 1-byte mask and the dropout output (``5as²b/t``, Table 2); Q, K and V stay views
  of the QKV output (one ``QKᵀ`` matmul per query head of a group), so nothing is copied.
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` (with
  ``enable_gqa`` for ``r > 1``). The fused kernels (flash / memory-efficient on CUDA, flash on
  CPU) store Q, K, V (views of the QKV output), their output (which the projection shares) and
  an fp32 logsumexp (``4asb/t`` bytes); their backward recomputes QKᵀ. Attention dropout draws
  from our sharded stream (:func:`~lightning_sp.parallel.random.drawing_from` swaps it in as
  the device's default generator, host-side, and torch's own state is restored), so masks
  differ per TP rank and replay identically under recompute.
  On CPU with ``dropout_p > 0`` torch leaves the fused kernel for a math fallback that stores
  fp32 ``s x s`` scores and masks (measured 108sbh for one core at s=256, a=8, h=256, bf16,
  torch 2.13); the model warns once when that happens.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sp.errors import ConfigError
from lightning_sp.model.documents import same_document
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.random import drawing_from, dropout

CoreFn = Callable[..., Tensor]
"""``core(q, k, v, dropout_p, generator, training, documents=None) -> context``."""


def attention_core(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    generator: torch.Generator,
    training: bool,
    documents: Tensor | None = None,
) -> Tensor:
    """Causal softmax(QKᵀ/√d) V with dropout on the probabilities (the ``math`` backend, the
    part ``core_attn`` recomputes). ``q: [B, r, s, d]``, ``k, v: [B, 1, s, d]`` ->
    ``[B, r, s, d]``. ``documents`` (``[b, s]`` ids, ``B = b·n``): block-causal, a query sees
    the earlier keys of its own document only (:mod:`lightning_sp.model.documents`)."""
    n, r, s, d = q.shape
    causal = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    bias = causal.expand(n, s, s)  # [B, s, s], a transient input: baddbmm does not save it
    if documents is not None:
        bias = bias.masked_fill(~same_document(documents, documents, n), float("-inf"))
    key_t = k[:, 0].transpose(1, 2)  # [B, d, s]

    def scores_of(head: int) -> Tensor:  # [B, s, s]; baddbmm saves only its q and k views
        return torch.baddbmm(bias, q[:, head], key_t, alpha=1.0 / math.sqrt(d))

    if r == 1:
        scores = scores_of(0).unsqueeze(1)  # [B, 1, s, s]
    else:
        scores = torch.stack([scores_of(i) for i in range(r)], dim=1)  # [B, r, s, s]
    probs = torch.softmax(scores, dim=-1)  # saves its output
    probs = dropout(probs, dropout_p, generator, training)  # saves a 1-byte mask
    return torch.bmm(probs.view(n, r * s, s), v[:, 0]).view(n, r, s, d)  # saves probs and v


def sdpa_core(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    generator: torch.Generator,
    training: bool,
    documents: Tensor | None = None,
) -> Tensor:
    """Causal attention through ``F.scaled_dot_product_attention`` (the ``sdpa`` backend);
    with ``documents`` (``[b, s]``) block-causal, as one causal call per document
    (:func:`_per_document`).

    ``q: [B, r, s, d]``, ``k, v: [B, 1, s, d]``. With ``r = 1`` it runs as one batch of ``B``
    heads, ``[1, B, s, d]``, so that the fused kernels' output, laid out ``[1, s, B, d]`` in
    memory, merges into ``[s, b, h/t]`` without a copy; with ``r > 1`` as ``B`` batches of
    ``r`` query heads sharing one key/value head (``enable_gqa``). Returns ``[B, r, s, d]``.
    """
    p = dropout_p if training else 0.0
    r = q.shape[1]
    if r == 1:
        q, k, v = (y.transpose(0, 1) for y in (q, k, v))  # [1, B, s, d]
    gqa = r > 1
    if p > 0.0 and q.device.type == "cpu":
        warnings.warn(
            "attention='sdpa' with attention_dropout > 0 on CPU: torch's fused CPU kernel has "
            "no dropout, so SDPA falls back to its math path, which stores s x s scores and "
            "masks (more than attention='math'); use attention_dropout=0 or attention='math' "
            "on CPU",
            stacklevel=2,
        )
    attend: Callable[..., Tensor] = nn.functional.scaled_dot_product_attention
    if documents is not None:  # one causal call per document: no s x s mask
        attend = partial(_per_document, documents=documents, heads_dim=1 if r == 1 else 0)
    if p == 0.0:
        out = attend(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        with drawing_from(generator):  # our sharded stream, not torch's global RNG
            out = attend(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)
    return out.transpose(0, 1) if r == 1 else out


def _per_document(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor, heads_dim: int, **kwargs: Any
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` (causal) run on each document
    alone: block-causal attention without an ``s x s`` mask. ``documents [b, s]``; the
    ``B = b·n`` rows of sequence ``i`` are ``[i·n, (i+1)·n)`` along ``heads_dim`` (1 for the
    ``[1, B, s, d]`` layout, 0 for ``[B, r, s, d]``).

    Why not a boolean ``attn_mask``: on CPU (torch 2.13) an explicit mask leaves the fused
    kernel for the math path, which saves the ``s x s`` probabilities: measured 44.2 sbh per
    Llama layer (s=256, b=2, h=256, a=8, bf16) against 28.2 sbh causal; these calls save what the
    fused kernel saves, plus the concatenated output (a copy the projection keeps: +2 sbh).
    """
    b = documents.shape[0]
    n = q.shape[heads_dim] // b
    rows = []
    for i in range(b):
        lengths = torch.unique_consecutive(documents[i], return_counts=True)[1].tolist()
        heads = slice(i * n, (i + 1) * n)
        pieces, start = [], 0
        for length in lengths:
            span = slice(start, start + length)
            index = (slice(None), heads, span) if heads_dim == 1 else (heads, slice(None), span)
            pieces.append(
                nn.functional.scaled_dot_product_attention(q[index], k[index], v[index], **kwargs)
            )
            start += length
        rows.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))
    return rows[0] if b == 1 else torch.cat(rows, dim=heads_dim)


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend: its core function and what it costs in memory and FLOPs."""

    name: str
    core: CoreFn
    """``core(q, k, v, dropout_p, generator, training)``, see the module docstring."""
    keeps_scores: bool
    """Whether it stores ``s x s`` tensors for backward (``core_attn`` drops them)."""
    backward_redone_flops: Callable[[ActivationShape], float]
    """Matmul FLOPs its backward recomputes per layer for ``shape.b`` sequences (all ranks)."""
    document_copy: bool = False
    """Whether, under a document mask, its output is a concatenation of per-document outputs
    that the projection keeps besides the pieces the kernels keep (``sdpa``: one more
    ``[s, b, a·d/t]`` context, ``e·sb·a·d/t`` per layer); ``math`` masks its score bias
    in place of the causal one and saves nothing more."""


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend("math", attention_core, True, lambda x: 0.0),
        # flash-style backward recomputes the scores QKᵀ (2bs²·ad, 2bs²h when a·d = h)
        AttentionBackend(
            "sdpa",
            sdpa_core,
            False,
            lambda x: 2.0 * x.b * x.s * x.s * x.a * x.head_dim,
            document_copy=True,
        ),
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
