"""The kernels of one transformer layer (and of the embedding and head) on one rank: the one
place the step-time model reads the block's architecture from.

* :func:`layer_gemms`: the forward GEMMs of a layer as ``(name, m, n, k, batch)`` records
  (``[batch] x (m x k) @ (k x n)``); backward runs, for each, a data-gradient GEMM ``(m, k,
  n)`` and a weight-gradient GEMM ``(k, n, m)`` of the same FLOPs (:func:`backward_gemms`).
* :func:`layer_memory_ops`: the element-wise kernels (LayerNorm, bias-dropout-add, GeLU,
  softmax, attention dropout, the context permute), as bytes moved in forward, backward and
  replay; they are memory bound.

Both read only ``GPTConfig`` fields (``hidden_size``, ``ffn_size``, ``num_heads``,
``seq_length``, ``vocab_size``, ``attention``): a new block family (GQA's fewer K/V heads, a
gated MLP's third GEMM) is a change to these two functions.

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

from dataclasses import dataclass

from lightning_sp.model.config import GPTConfig
from lightning_sp.model.cores import ATTENTION_BACKENDS
from lightning_sp.model.spec import ACTIVATIONS

ACT, MASK = 2, 1
"""Bytes per activation element and per dropout-mask element (the paper's)."""


@dataclass(frozen=True)
class Gemm:
    """``[batch] x (m x k) @ (k x n)`` on one rank."""

    name: str
    m: int
    n: int
    k: int
    batch: int = 1
    tag: str = ""
    """The recompute module that replays it (``core_attn`` for the attention core)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch

    @property
    def bytes(self) -> float:
        """Operands read and result written once, 2-byte elements."""
        return float(ACT * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n))


@dataclass(frozen=True)
class MemoryOp:
    """One memory-bound kernel of a layer on one rank: bytes read + written."""

    name: str
    forward_bytes: float
    backward_bytes: float
    tag: str = ""
    """The recompute module that replays it."""
    replay_bytes: float | None = None
    """Bytes its replay moves (``None``: ``forward_bytes``)."""

    @property
    def replayed(self) -> float:
        return self.forward_bytes if self.replay_bytes is None else self.replay_bytes


CP_CORE = "cp_core"
"""The tag of the CP attention core's kernels (replayed by the core itself, not a module)."""


def cp_key_lengths(s: int, c: int) -> tuple[int, ...]:
    """The keys each local query chunk of CP rank 0 attends: ``(s,)`` without CP (one dense
    ``s x s`` block); ``(L, s)`` for chunks 0 and ``2c-1`` under CP (``L = s/(2c)``)."""
    return (s,) if c == 1 else (s // (2 * c), s)


def attention_pairs(s: int, c: int) -> int:
    """Query-key pairs per head the core computes on one rank: ``s²`` (``math`` without CP,
    no causal skipping); ``L·(L + s) = (2c+1)·L²`` under CP."""
    if c == 1:
        return s * s
    return s // (2 * c) * sum(cp_key_lengths(s, c))


def layer_gemms(config: GPTConfig, t: int, b: int, c: int = 1) -> list[Gemm]:
    """The forward GEMMs of one transformer layer on one of ``t`` tensor-parallel ranks for a
    micro-batch of ``b`` sequences, from the config's descriptors: QKV ``h -> (a + 2g')d``
    (``g' = max(g, t)`` key/value heads, replicas counted; ``3h`` for multi-head attention),
    scores ``QKᵀ`` and ``probs·V`` per query head (``b·a/t`` of them, head dim ``d = h/a``),
    projection ``h -> h``, the MLP's input projections ``h -> f`` (one, or SwiGLU's gate and
    up) and ``f -> h``; column-parallel outputs and row-parallel inputs split by ``t``. Under
    context parallelism ``c`` the token GEMMs have ``s·b/c`` rows and the core is one pair of
    GEMMs per local chunk (:func:`cp_key_lengths`), tagged :data:`CP_CORE`."""
    s, h, f, a = config.seq_length, config.hidden_size, config.ffn_size, config.num_heads
    tokens, d, heads = s * b // c, config.head_dim, b * a // t
    kv = max(config.groups, t)
    if c == 1:
        core = [
            Gemm("attention_scores", s, s, d, heads, tag="core_attn"),
            Gemm("attention_values", s, d, s, heads, tag="core_attn"),
        ]
    else:
        chunk = s // (2 * c)
        core = [
            gemm
            for i, keys in enumerate(cp_key_lengths(s, c))
            for gemm in (
                Gemm(f"attention_scores.{i}", chunk, keys, d, heads, tag=CP_CORE),
                Gemm(f"attention_values.{i}", chunk, d, keys, heads, tag=CP_CORE),
            )
        ]
    return [
        Gemm("qkv", tokens, (a + 2 * kv) * d // t, h),
        *core,
        Gemm("projection", tokens, h, a * d // t),
        *(Gemm(name, tokens, f // t, h) for name in ACTIVATIONS[config.activation].inputs),
        Gemm("fc2", tokens, h, f // t),
    ]


def layer_memory_ops(
    config: GPTConfig, t: int, b: int, sequence_parallel: bool, c: int = 1
) -> list[MemoryOp]:
    """The memory-bound kernels of one layer on one rank (Megatron's fused kernels), bytes per
    element read + written:

    * outside the tensor-parallel region (``sbh`` elements, ``/t`` under sequence
      parallelism): two LayerNorms (forward read 2 + write 2; backward read input and
      gradient, write gradient, 6) and two bias-dropout-adds (forward read 2 + 2, write 2 and
      a 1-byte mask, 7; backward read gradient and mask, write 2, 5; ``residual_mask`` replays
      only the mask, 1);
    * inside (``/t``): bias-GeLU on ``sbf`` (4 / 6); with attention that keeps ``s x s``
      tensors (``math``), the fused scale-mask-softmax on ``b·a·s²`` (4 / 6), its dropout
      (5 / 5) and the context permute ``[b·a, s, d] -> [s, b, h]`` on ``sbh`` (4 / 4).

    Under context parallelism every ``s`` is the rank's ``s/c`` and the softmax and dropout
    run on :func:`attention_pairs` per head, tagged :data:`CP_CORE`.
    """
    s, h, f, a = config.seq_length, config.hidden_size, config.ffn_size, config.num_heads
    local = s // c
    outside = local * b * h / (t if sequence_parallel else 1)
    inputs = len(ACTIVATIONS[config.activation].inputs)  # SwiGLU reads gate and up
    inner, scores = local * b * f * (1 + inputs) / (2 * t), b * a * attention_pairs(s, c) / t
    core = "core_attn" if c == 1 else CP_CORE
    ops = [
        MemoryOp("layernorm", 2 * 4 * outside, 2 * 6 * outside, tag="layernorm"),
        MemoryOp(
            "bias_dropout_add",
            2 * (3 * ACT + MASK) * outside,
            2 * (2 * ACT + MASK) * outside,
            tag="residual_mask",
            replay_bytes=2 * MASK * outside,
        ),
        MemoryOp("bias_gelu", 4 * inner, 6 * inner, tag="mlp_act"),
    ]
    if ATTENTION_BACKENDS[config.attention].keeps_scores:
        ops += [
            MemoryOp("softmax", 4 * scores, 6 * scores, tag=core),
            MemoryOp("attention_dropout", 5 * scores, 5 * scores, tag=core),
            MemoryOp("context_permute", 4 * local * b * h / t, 4 * local * b * h / t, tag=core),
        ]
    return ops


def head_gemms(config: GPTConfig, t: int, b: int, c: int = 1) -> list[Gemm]:
    """The output layer's forward GEMM (logits over this rank's padded vocabulary shard, for
    its ``s·b/c`` tokens)."""
    v = config.padded_vocab_size(t) // t
    return [Gemm("logits", config.seq_length * b // c, v, config.hidden_size)]


def head_memory_ops(
    config: GPTConfig, t: int, b: int, sequence_parallel: bool, c: int = 1
) -> list[MemoryOp]:
    """The final LayerNorm (4 / 6 bytes per ``sbh`` element, ``/t`` under SP) and the
    vocab-parallel cross entropy on ``s·b·v/t`` logits: forward reads the bf16 logits and
    makes fp32 passes (cast, max, exp, sum, normalise: 2 + 4·5 = 22 bytes), backward reads
    the fp32 softmax and writes the bf16 gradient (4 + 4 + 2 = 10 bytes); ``s/c`` tokens."""
    s, h = config.seq_length // c, config.hidden_size
    outside = s * b * h / (t if sequence_parallel else 1)
    logits = s * b * config.padded_vocab_size(t) / t  # s: this rank's s/c
    return [
        MemoryOp("final_layernorm", 4 * outside, 6 * outside),
        MemoryOp("cross_entropy", 22 * logits, 10 * logits),
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
