"""The kernels of one transformer layer (and of the embedding and head) on one rank: the one
place the step-time model reads the block's architecture from.

* :func:`layer_gemms`: the forward GEMMs of a layer as ``(name, m, n, k, batch)`` records
  (``[batch] x (m x k) @ (k x n)``); backward runs, for each, a data-gradient GEMM ``(m, k,
  n)`` and a weight-gradient GEMM ``(k, n, m)`` of the same FLOPs (:func:`backward_gemms`).
* :func:`layer_memory_ops`: the element-wise kernels (LayerNorm, bias-dropout-add, GeLU,
  softmax, attention dropout, the context permute), as bytes moved in forward, backward and
  replay; they are memory bound.
* :func:`layer_collectives`: the TP collectives a part runs besides the layer's own f / g
  (OLMo 2's query/key norm statistics' all-reduces, an MoE layer's all-gather and
  reduce-scatter of its dispatched rows under expert tensor parallelism), each of a
  :class:`CollectiveKind`.

Both are sums over the layer's parts (:mod:`lightning_sp.model.parts`): each part states its
own GEMMs and kernels, so a new part (a gated MLP's third GEMM, a query/key norm) changes
nothing here. The records :class:`Gemm` and :class:`MemoryOp` are the parts' own.

Each record carries ``tag``: the recompute module (:data:`lightning_sp.model.recompute.
RECOMPUTE_MODULES`) whose replay runs it again in backward (``""``: none). The FLOPs a
module redoes come from its descriptor, not from here (:mod:`lightning_sp.planner.steptime`).
Element sizes are the paper's: 2-byte activations, 1-byte dropout masks.

Context parallelism (``c > 1``): every rank runs ``s/c`` tokens of each sequence (its two
load-balanced chunks of ``L = s/(2c)``), so every token-wise kernel and GEMM has ``s·b/c``
rows. The attention core is the CP core's (:mod:`lightning_sp.parallel.context_attention`):
rank 0's chunk 0 attends the ``L`` keys ``0 .. L-1`` and its chunk ``2c-1`` all ``s`` keys,
each a dense ``L x keys`` block under a mask (``(2c+1)·L²`` query-key pairs per head, the same
on every rank; no causal block skipping). Its GEMMs are listed per chunk
(``attention_scores.0`` ...) and tagged ``cp_core``: the CP core recomputes them in backward
whatever the recompute policy (``core_attn`` does not act under CP).
"""

from __future__ import annotations

from lightning_sp.model.config import GPTConfig
from lightning_sp.model.parts.attention import CP_CORE, attention_pairs, cp_key_lengths
from lightning_sp.model.parts.base import ACT, MASK, Collective, CollectiveKind, Gemm, MemoryOp
from lightning_sp.model.parts.block import block_of_shape
from lightning_sp.model.shape import ActivationShape

__all__ = [
    "ACT",
    "CP_CORE",
    "CROSS_ENTROPY_BYTES",
    "MASK",
    "Collective",
    "CollectiveKind",
    "Gemm",
    "MemoryOp",
    "attention_pairs",
    "backward_gemms",
    "cp_key_lengths",
    "embedding_memory_ops",
    "head_gemms",
    "head_memory_ops",
    "layer_collectives",
    "layer_gemms",
    "layer_memory_ops",
]


CROSS_ENTROPY_BYTES = (38, 22)
"""Bytes per logit the vocab-parallel cross entropy moves, forward and backward
(:func:`head_memory_ops`)."""


def layer_gemms(shape: ActivationShape) -> list[Gemm]:
    """The forward GEMMs of one transformer layer of ``shape`` (a model laid out at
    micro-batch ``b``: :meth:`~lightning_sp.model.config.GPTConfig.activation_shape`) on one
    of its ``t`` tensor-parallel ranks: the sum over the layer's parts (:meth:`~lightning_sp.model.
    parts.block.Block.gemms`). For GPT-2 / Llama: QKV ``h -> (a + 2g')d`` (``g' = max(g, t)``
    key/value heads, replicas counted), scores ``QKᵀ`` and ``probs·V`` per query head
    (``b·a/t``), projection, the MLP's input projections ``h -> f`` (one, or SwiGLU's gate and
    up) and ``f -> h``; column-parallel outputs and row-parallel inputs split by ``t``. Under
    context parallelism ``c`` the token GEMMs have ``s·b/c`` rows and the core is one pair of
    GEMMs per local chunk (:func:`cp_key_lengths`), tagged :data:`CP_CORE`. A mixture of
    experts at expert-parallel size ``e`` runs its ``E/e`` local experts as a batch of GEMMs
    of the rows each receives (:meth:`~lightning_sp.model.moe.part.MoEFeedForward.gemms`);
    ``etp``: the expert tensor parallel size (its GEMMs ``f_e/t`` wide over the TP group's
    gathered rows)."""
    return block_of_shape(shape).gemms(shape)


def layer_memory_ops(shape: ActivationShape) -> list[MemoryOp]:
    """The memory-bound kernels of one layer of ``shape`` on one rank (Megatron's fused
    kernels), the sum over the layer's parts (:meth:`~lightning_sp.model.parts.block.Block.
    memory_ops`), bytes per element read + written:

    * outside the tensor-parallel region (``sbh`` elements, ``/t`` under sequence
      parallelism): the norms (forward read 2 + write 2; backward read input and gradient,
      write gradient, 6) and the bias-dropout-adds (forward read 2 + 2, write 2 and a 1-byte
      mask, 7; backward read gradient and mask, write 2, 5; ``residual_mask`` replays only the
      mask, 1);
    * inside (``/t``): bias-GeLU on ``sbf`` (4 / 6); with attention that keeps ``s x s``
      tensors (``math``), the fused scale-mask-softmax on ``b·a·s²`` (4 / 6), its dropout
      (5 / 5) and the context permute ``[b·a, s, d] -> [s, b, h]`` on ``sbh`` (4 / 4);
    * a mixture of experts: the experts' SwiGLU on the ``k·T`` rows it computes and the
      dispatch's and combine's row copies (:meth:`~lightning_sp.model.moe.part.
      MoEFeedForward.memory_ops`).

    Under context parallelism every ``s`` is the rank's ``s/c`` and the softmax and dropout
    run on :func:`attention_pairs` per head, tagged :data:`CP_CORE`.
    """
    return block_of_shape(shape).memory_ops(shape)


def layer_collectives(shape: ActivationShape) -> list[Collective]:
    """The TP collectives the layer's parts run on one rank of ``shape`` besides the layer's
    own f / g (the sum over its parts, :meth:`~lightning_sp.model.parts.block.Block.
    collectives`; under expert tensor parallelism, the experts' gather and reduce-scatter)."""
    return block_of_shape(shape).collectives(shape)


def head_gemms(config: GPTConfig, t: int, b: int, c: int = 1) -> list[Gemm]:
    """The output layer's forward GEMM (logits over this rank's padded vocabulary shard, for
    its ``s·b/c`` tokens)."""
    v = config.padded_vocab_size(t) // t
    return [Gemm("logits", config.seq_length * b // c, v, config.hidden_size)]


def head_memory_ops(
    config: GPTConfig, t: int, b: int, sequence_parallel: bool, c: int = 1
) -> list[MemoryOp]:
    """The final LayerNorm (4 / 6 bytes per ``sbh`` element, ``/t`` under SP) and the
    vocab-parallel cross entropy on ``s·b·v/t`` logits, each pass of
    :class:`lightning_sp.parallel.vocab` counted with what it reads and writes: forward the
    fp32 cast of the bf16 logits (2 + 4), the max (4), the shift (4 + 4), the exp (4 + 4),
    the sum (4) and the normalisation in place (4 + 4), 38 bytes; backward the softmax's
    clone (4 + 4), the scale by the loss gradient in place (4 + 4) and the cast back to bf16
    (4 + 2), 22 bytes; ``s/c`` tokens."""
    s, h = config.seq_length // c, config.hidden_size
    outside = s * b * h / (t if sequence_parallel else 1)
    logits = s * b * config.padded_vocab_size(t) / t  # s: this rank's s/c
    return [
        MemoryOp("final_layernorm", 4 * outside, 6 * outside),
        MemoryOp("cross_entropy", CROSS_ENTROPY_BYTES[0] * logits, CROSS_ENTROPY_BYTES[1] * logits),
    ]


def embedding_memory_ops(
    config: GPTConfig, t: int, b: int, sequence_parallel: bool, c: int = 1
) -> list[MemoryOp]:
    """Word-embedding gather and position add (forward write 2, read 2 + 2 and write 2 per
    ``sbh`` element; backward the scatter-add of the gradient, read 2 + read-modify-write an
    fp32 row 8) and the embedding dropout (7 / 5, ``/t`` under SP); ``s/c`` tokens."""
    sbh = config.seq_length // c * b * config.hidden_size
    outside = sbh / (t if sequence_parallel else 1)
    return [
        MemoryOp("embedding", 8 * sbh, 10 * sbh),
        MemoryOp("embedding_dropout", (2 * ACT + MASK) * outside, (2 * ACT + MASK) * outside),
    ]


def backward_gemms(gemm: Gemm) -> tuple[Gemm, Gemm]:
    """The data-gradient ``(m, k, n)`` and weight-gradient ``(k, n, m)`` GEMMs of ``gemm``
    (for the attention GEMMs: the gradients of both operands)."""
    return (
        Gemm(gemm.name + ".dgrad", gemm.m, gemm.k, gemm.n, gemm.batch, gemm.tag),
        Gemm(gemm.name + ".wgrad", gemm.k, gemm.n, gemm.m, gemm.batch, gemm.tag),
    )
