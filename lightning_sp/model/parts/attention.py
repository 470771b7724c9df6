"""The self-attention part: Q, K, V projections (``a`` query heads, ``g`` key/value groups of
head dimension ``d``), the attention core of the configured backend, the output projection.

Its module is :class:`lightning_sp.model.attention.Attention`; this file states what it costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_sp.model.cores import ATTENTION_BACKENDS
from lightning_sp.model.parts.base import (
    EVERY_RANK,
    INSIDE,
    OUTSIDE,
    REPLICATED,
    Collective,
    CollectiveKind,
    Gemm,
    MemoryOp,
    Part,
    PartLinear,
    Terms,
    tokens,
)
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.parts.weights import HFNames, Weight, WeightMap, convention, join, linear
from lightning_sp.model.shape import ActivationShape

HF_ATTENTION: dict[str, dict[str, str]] = {
    "gpt2": {"query": "attn.c_attn", "key": "attn.c_attn", "value": "attn.c_attn",
             "proj": "attn.c_proj"},
    "llama": {"query": "self_attn.q_proj", "key": "self_attn.k_proj",
              "value": "self_attn.v_proj", "proj": "self_attn.o_proj",
              "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
}  # fmt: skip
"""The attention's Hugging Face modules under a layer: convention -> our module (``query``,
``key``, ``value``, ``proj``, the query/key norms' ``q_norm``, ``k_norm``) -> theirs. GPT-2's
``c_attn`` holds query, key and value, concatenated in that order."""

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


@dataclass(frozen=True)
class SelfAttention(Part):
    """Causal self-attention, heads split over the TP group (``g' = max(g, t)`` key/value
    heads counted over the group, replicas included).

    saves (whole layer, ``e`` bytes per activation, ``k`` per mask element):
      * ``qkv_input`` ``e·sbh`` (outside; the ``layernorm`` module drops it);
      * ``qkv``: Q, K, V in one storage ``e·sb·d·(a + 2g')`` (inside; ``3e·sbh`` for
        multi-head attention with ``a·d = h``; rotated in place of the linear's output);
      * the core: ``math`` keeps ``attention_scores`` ``(2e + k)·as²b`` (``e·as²b`` without
        attention dropout; the paper's 5as²b), ``sdpa`` an fp32 ``attention_lse`` ``4asb``
        and, on CUDA, the kernel's Philox state ``attention_rng`` (16 bytes per call: one
        call, or one per document under a document mask, which is not counted); under CP
        none;
      * ``proj_input``: the core's own output ``e·sb·a·d`` (inside);
      * ``document_context``: under a document mask with ``sdpa`` (one call per document), the
        concatenated context the projection keeps, ``e·sb·a·d`` (inside); 0 otherwise.
    GEMMs: ``qkv`` ``h -> (a + 2g')d/t``, the core (per query head), ``projection``
    ``a·d/t -> h``. Params: ``(a + 2g')·d·h + a·d·h``, biases as ``bias_qkv`` / ``bias_proj``.
    """

    bias_qkv: bool = True
    """Biases on the query, key and value projections."""
    bias_proj: bool = True
    """A bias on the output projection (row parallel: replicated)."""
    qk_norm: str | None = None
    """RMSNorm on queries and keys (:mod:`lightning_sp.model.qk_norm`): ``head``,
    ``projection`` or None."""

    input_term = "qkv_input"
    reads_sequence = True

    def build(self, ctx: BuildContext) -> nn.Module:
        from lightning_sp.model.attention import Attention

        return Attention(ctx)

    def saved_terms(self, x: ActivationShape) -> Terms:
        e, k = x.activation_bytes, x.mask_bytes
        keeps_scores = ATTENTION_BACKENDS[x.attention].keeps_scores
        context_core = x.c > 1  # stores q, k, v only (the qkv term)
        per_score = 2 * e + k if x.attention_dropout else e
        d = x.head_dim
        sb = x.s * x.b
        return {
            "qkv_input": (e * x.sbh, OUTSIDE),
            "qkv": (e * sb * d * (x.a + 2 * x.kv_heads), INSIDE),
            "attention_scores": (
                per_score * x.a * x.s * x.s * x.b if keeps_scores and not context_core else 0.0,
                INSIDE,
            ),
            "attention_lse": (
                0.0 if keeps_scores or context_core else 4.0 * x.a * x.s * x.b,
                INSIDE,
            ),
            "attention_rng": (
                0.0 if keeps_scores or context_core else x.kernel_rng_bytes,
                EVERY_RANK,
            ),
            "proj_input": (e * sb * x.a * d if x.d else e * x.sbh, INSIDE),
            "document_context": (self._document_context(x), INSIDE),
            **self._qk_norm_terms(x),
        }

    def _document_context(self, x: ActivationShape) -> float:
        """Under a document mask, with a backend that runs one call per document
        (:attr:`~lightning_sp.model.cores.AttentionBackend.document_copy`, ``sdpa``): the
        concatenated context the projection keeps besides the kernels' own outputs,
        ``e·sb·a·d`` (``2sbh`` in bf16 for ``a·d = h``); 0 under context parallelism (the CP
        core masks its chunk pairs and keeps q, k, v only) and for ``math`` (its mask replaces
        the causal score bias, transient). Assumes a micro-batch of more than one document
        piece (``b > 1`` or a boundary in the sequence): with ``b = 1`` and one document the
        kernel's output is kept as is."""
        copies = ATTENTION_BACKENDS[x.attention].document_copy
        if not (x.documents and copies) or x.c > 1:
            return 0.0
        return x.activation_bytes * x.s * x.b * x.a * x.head_dim

    def _qk_norm_terms(self, x: ActivationShape) -> Terms:
        """With a query/key norm: its input, the QKV linear's output (a second storage of
        ``qkv``'s size, ``e·sb·d·(a + 2g')``, inside), and its fp32 ``rstd``: per head
        ``4·sb·(a + g')`` (inside), per projection ``2·4·sb`` on every rank (replicated)."""
        if self.qk_norm is None:
            return {}
        sb, e = x.s * x.b, x.activation_bytes
        nbytes = e * sb * x.head_dim * (x.a + 2 * x.kv_heads)
        if self.qk_norm == "head":
            stats: tuple[float, str] = (4.0 * sb * (x.a + x.kv_heads), INSIDE)
        else:
            width = 8 if x.activation_bytes >= 8 else 4  # float64 models keep float64 stats
            stats = (2.0 * width * sb, REPLICATED)
        return {"qk_norm_input": (nbytes, INSIDE), "qk_norm_stats": stats}

    def gemms(self, x: ActivationShape) -> list[Gemm]:
        s, h, a, t, c = x.s, x.h, x.a, x.t, x.c
        d, heads, kv = x.head_dim, x.b * a // t, x.kv_heads
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
        n = tokens(x)
        return [
            Gemm("qkv", n, (a + 2 * kv) * d // t, h),
            *core,
            Gemm("projection", n, h, a * d // t),
        ]

    def input_gemms(self) -> tuple[str, ...]:
        return ("qkv",)

    def linears(self, x: ActivationShape) -> tuple[PartLinear, ...]:
        """``query``, ``key``, ``value`` (column, reading ``qkv_input``) and ``proj`` (row,
        ``a·d`` wide, keeping the core's output whatever its weight)."""
        h, d, kv = x.h, x.head_dim, x.kv_heads
        return (
            PartLinear("query", "column", h, x.a * d, "qkv_input"),
            PartLinear("key", "column", h, kv * d, "qkv_input"),
            PartLinear("value", "column", h, kv * d, "qkv_input"),
            PartLinear("proj", "row", x.a * d, h),
        )

    def memory_ops(self, x: ActivationShape) -> list[MemoryOp]:
        """With a backend that keeps ``s x s`` tensors (``math``): the fused scale-mask-softmax
        on ``b·a·s²/t`` (4 / 6 bytes per element), its dropout (5 / 5) and the context permute
        ``[b·a, s, d] -> [s, b, a·d]`` (4 / 4); under CP on :func:`attention_pairs`, tagged
        :data:`CP_CORE`."""
        if not ATTENTION_BACKENDS[x.attention].keeps_scores:
            return self._qk_norm_ops(x)
        local = x.s // x.c
        scores = x.b * x.a * attention_pairs(x.s, x.c) / x.t
        core = "core_attn" if x.c == 1 else CP_CORE
        permute = 4 * local * x.b * (x.a * x.d if x.d else x.h) / x.t
        return [
            *self._qk_norm_ops(x),
            MemoryOp("softmax", 4 * scores, 6 * scores, tag=core),
            MemoryOp("attention_dropout", 5 * scores, 5 * scores, tag=core),
            MemoryOp("context_permute", permute, permute, tag=core),
        ]

    def _qk_norm_ops(self, x: ActivationShape) -> list[MemoryOp]:
        """The query/key norm reads and writes the QKV output (4 / 6 bytes per element)."""
        if self.qk_norm is None:
            return []
        n = x.s // x.c * x.b * x.head_dim * (x.a + 2 * x.kv_heads) / x.t
        return [MemoryOp("qk_norm", 4 * n, 6 * n)]

    def collectives(self, x: ActivationShape) -> list[Collective]:
        """The query/key norm over the whole projection (``projection``) at ``t > 1``: its
        statistics span the TP-sharded projection, so each rank's sums are all-reduced over
        TP, one per token for the queries and one for the keys, in forward (the sum of
        squares) and in backward (the gradient's inner product): 2 + 2 all-reduces of
        ``w·s·b/c`` bytes (``w`` = 4, fp32; 8 for a float64 model). None per head (each rank
        normalises whole heads)."""
        if self.qk_norm != "projection" or x.t == 1:
            return []
        width = 8 if x.activation_bytes >= 8 else 4
        nbytes = float(width * (x.s // x.c) * x.b)
        return [
            Collective("qk_norm_stats", CollectiveKind.ALL_REDUCE, nbytes, forward=2, backward=2)
        ]

    def parameters(self, x: ActivationShape) -> tuple[int, int]:
        """Q ``a·d·h``, K and V ``g'·d·h`` each, the projection ``a·d·h``, biases as chosen;
        a query/key norm ``2d`` (per head, replicated) or ``(a + g')·d`` (split)."""
        h, a, d, kv = x.h, x.a, x.head_dim, x.kv_heads
        qkv = (a + 2 * kv) * d
        split = qkv * h + a * d * h + (qkv if self.bias_qkv else 0)
        replicated = h if self.bias_proj else 0
        if self.qk_norm == "head":
            replicated += 2 * d
        elif self.qk_norm == "projection":
            split += (a + kv) * d
        return split, replicated

    def weights(self, names: HFNames) -> tuple[Weight, ...]:
        """Q, K, V (biases with ``bias_qkv``), the output projection (``bias_proj``) and the
        query/key norms' weights (``qk_norm.q_norm``, ``qk_norm.k_norm``) if it has them."""
        hf = convention(HF_ATTENTION, names.attention, "attention")
        rows: list[Weight] = []
        for module in ("query", "key", "value"):
            rows += linear(module, hf[module], self.bias_qkv, names)
        rows += linear("proj", hf["proj"], self.bias_proj, names)
        if self.qk_norm is not None:
            rows += [WeightMap(f"qk_norm.{n}", join(hf[n], "weight")) for n in ("q_norm", "k_norm")]
        return tuple(rows)

    def forward_flops(self, x: ActivationShape) -> float:
        """QKV ``2·n·h·(a + 2g)·d``, QKᵀ and probs·V ``2·n·s·a·d`` each, output projection
        ``2·n·a·d·h`` for ``n = b·s`` tokens (``8Bsh² + 4Bs²h`` for multi-head attention)."""
        n, s, h, a, g, d = x.b * x.s, x.s, x.h, x.a, x.groups, x.head_dim
        return 2.0 * n * h * (a + 2 * g) * d + 4.0 * n * s * a * d + 2.0 * n * a * d * h
