"""Activation memory: the paper's formulas. The same bytes measured at full scale without the
memory are :mod:`lightning_sp.memory.fake`'s; parameters, gradients and optimizer state are
:mod:`lightning_sp.memory.model_state`'s.

Formulas (Korthikanti et al. §4, Table 2, eq. 5, §4.5), in bytes. Symbols as in the paper:
s sequence length, b micro-batch, h hidden size, a heads, t tensor-parallel size, p pipeline
size, m model chunks per pipeline rank (interleaving), L layers, v vocabulary. The activation
formulas take one :class:`~lightning_sp.model.shape.ActivationShape` (built from a
``GPTConfig``, t and the micro-batch): the paper stores activations in 2 bytes and dropout
masks in 1; both are fields there, as are the MLP width (the paper's 4h), whether each dropout
is on and the attention backend. What each recompute module drops comes from its descriptor
(:data:`lightning_sp.model.recompute.RECOMPUTE_MODULES`).

Context parallelism (``ActivationShape.c = c > 1``): every stored term is divided by ``c``
(each rank holds ``s/c`` tokens of every sequence, its two load-balanced chunks), and the
attention core stores no ``s x s`` scores and no logsumexp whatever the backend: the CP core
(:mod:`lightning_sp.parallel.context_attention`) keeps only q, k, v (views of the QKV storage,
the ``qkv`` term) and recomputes itself in backward. What does not divide by ``c``: with
attention dropout the CP core also keeps its generator state, a constant per layer (5056 bytes
for CPU's Mersenne Twister, 16 for CUDA's Philox; not in these formulas, like the norms'
statistics they are stated apart: :data:`CONTEXT_GENERATOR_STATE_BYTES`); the transient gathered
K/V, ``2·e·b·(g'/t)·s·d`` per layer while one attention runs (not stored); parameters, gradients
and optimizer states (CP shards none of them); the FLOPs (each rank does ``1/c`` of them).
"""

from __future__ import annotations

from lightning_sp.errors import ConfigError
from lightning_sp.model.parts.base import (
    EVERY_RANK,
    INSIDE,
    OUTSIDE,
    REPLICATED,
    float8_scale,
)
from lightning_sp.model.parts.block import block_of_shape
from lightning_sp.model.recompute import RecomputePolicy, active_modules
from lightning_sp.model.shape import ActivationShape

ACTIVATION_BYTES = 2
"""Bytes per stored activation element in the paper (fp16/bf16)."""

MASK_BYTES = 1
"""Bytes per dropout-mask element in the paper (a ``bool`` mask)."""

TABLE2_ROWS = (
    "no_parallelism",
    "tensor_parallel",
    "tensor_sequence_parallel",
    "tensor_parallel_selective",
    "tensor_sequence_parallel_selective",
    "full_recompute",
)

TABLE2_SETTINGS: dict[str, tuple[bool, str]] = {
    "no_parallelism": (False, "none"),  # evaluated at t = 1
    "tensor_parallel": (False, "none"),
    "tensor_sequence_parallel": (True, "none"),
    "tensor_parallel_selective": (False, "selective"),
    "tensor_sequence_parallel_selective": (True, "selective"),
    "full_recompute": (False, "full"),  # the paper's 2sbh: the full layer input on every rank
}
"""Table 2 row -> ``(sequence_parallel, recompute)`` that realises it."""

FIGURE7_ROWS = (
    "tensor_sequence_parallel",
    "tensor_parallel_selective",
    "tensor_sequence_parallel_selective",
    "full_recompute",
)
"""The bars of the paper's Figure 7, each a percentage of the ``tensor_parallel`` baseline."""


def table2_row(sequence_parallel: bool, recompute: str, tensor_parallel_size: int) -> str:
    """The Table 2 row that describes a (sequence_parallel, recompute, t) configuration."""
    if recompute == "full":
        return "full_recompute"
    if tensor_parallel_size == 1 and not sequence_parallel:
        return "no_parallelism" if recompute == "none" else "tensor_parallel_selective"
    base = "tensor_sequence_parallel" if sequence_parallel else "tensor_parallel"
    return base + ("_selective" if recompute == "selective" else "")


CONTEXT_GENERATOR_STATE_BYTES = {"cpu": 5056, "cuda": 16}
"""Bytes of the generator state the CP attention core keeps per layer with attention dropout,
by device type (not divided by c, not in :func:`activation_bytes_per_layer`)."""


def layer_saved_terms(shape: ActivationShape) -> dict[str, tuple[float, str]]:
    """Every tensor one transformer layer saves for backward, as ``name -> (bytes for the
    whole layer before any split, region)``: the sum over the layer's parts
    (:meth:`~lightning_sp.model.parts.block.Block.saved_terms`; each part states its own
    terms). For GPT-2 and Llama, with ``e = activation_bytes``, ``k =
    mask_bytes``, ``f`` the MLP width, ``d = h/a`` the head dimension and ``g' = max(g, t)``
    the key/value heads counted over the TP group (replicas included):

    * outside (the paper's ``10sbh``): the inputs of norm 1 (``ln1_input``), the QKV
      linears (``qkv_input``), norm 2 (``ln2_input``) and the MLP's input projections
      (``fc1_input``), ``e·sbh`` each; the residual dropout masks ``attn_residual_mask``,
      ``mlp_residual_mask``, ``k·sbh`` each (with hidden dropout);
    * inside (the paper's ``24sbh`` for GPT): Q, K, V in one storage (``qkv``)
      ``e·sb·d·(a + 2g')`` (``3e·sbh`` for multi-head attention; rotated in place of the
      linear's output under RoPE), the projection input (``proj_input``, the attention core's
      own output) ``e·sbh``, the activation's input (``act_input``: ``e·sbf``, SwiGLU's
      ``[gate | up]`` ``2e·sbf``) and the fc2 input (``fc2_input``) ``e·sbf``;
    * the attention core, by backend: ``math`` keeps ``attention_scores``, the softmax
      output, its dropout mask and the dropout output, ``(2e + k)·as²b`` (the paper's
      ``5as²b``; ``e·as²b`` without attention dropout); ``sdpa`` keeps none, only the
      kernel's fp32 logsumexp ``attention_lse``, ``4asb`` (and on CUDA its 16-byte Philox
      state, ``attention_rng``: :meth:`ActivationShape.on_cuda`).

    The norms' per-row statistics (``O(sb)``) are neglected, as in the paper
    (:func:`layernorm_stats_bytes_per_layer` has them). For a Llama layer (no dropout, SwiGLU,
    ``g`` groups) with TP + SP and no recompute this is ``sbh/t·(6 + 2(a + 2g')/a + 6f/h)``
    plus the core; see the README's derivation.

    Under context parallelism (``c > 1``) the terms are still those of the whole sequence (the
    per-rank division by ``c`` is :func:`_per_rank`'s), except the core's: the CP core stores
    neither ``attention_scores`` nor ``attention_lse`` (0 for both backends).
    """
    return block_of_shape(shape).saved_terms(shape)


def _per_rank(shape: ActivationShape, nbytes: float, region: str) -> float:
    """One rank's part of a whole-layer term: ``/t`` inside the TP region (and outside under
    sequence parallelism), ``/c`` everywhere (each CP rank holds ``s/c`` tokens)."""
    if region == EVERY_RANK:
        return nbytes
    if region == REPLICATED:
        return nbytes / shape.c
    split = region == INSIDE or shape.sequence_parallel
    return (nbytes / shape.t if split else nbytes) / shape.c


def dropped_bytes_per_layer(shape: ActivationShape, module: str) -> float:
    """Bytes per layer per rank that the recompute module ``module`` stops storing under
    ``shape`` (0 where it does not act, e.g. ``core_attn`` under ``sdpa``)."""
    terms = layer_saved_terms(shape)
    return sum(
        _per_rank(shape, *terms[term])
        for m in active_modules((module,), shape.attention)
        for dropped in m.drops
        for term in (dropped, float8_scale(dropped))  # an FP8 input's scale goes with it
        if term in terms  # a module names the terms of every part it acts on
    )


def activation_bytes_per_layer(shape: ActivationShape, recompute: object = "none") -> float:
    """Activation bytes one transformer layer stores on one rank (paper Table 2, generalised).

    ``recompute``: a preset name, ``full`` or a list of recompute modules. The sum of
    :func:`layer_saved_terms` on this rank (inside terms divided by t; outside terms divided by
    t under sequence parallelism), less the terms the active modules drop. ``full`` stores the
    layer input only: ``e·sbh``, or ``e·sbh/t`` under sequence parallelism.

    With the defaults (2-byte activations, 1-byte masks, MLP width 4h, dropout on, ``math``)
    this is Table 2 exactly, e.g. ``34sbh/t`` for TP+SP+selective, ``20sbh/t`` for TP+SP+lean.
    """
    policy = RecomputePolicy.parse(recompute).check_resolved()
    if policy.full:
        return _per_rank(shape, shape.activation_bytes * shape.sbh, OUTSIDE)
    dropped = {term for m in active_modules(policy.modules, shape.attention) for term in m.drops}
    dropped |= {float8_scale(term) for term in dropped}  # an FP8 input's scale goes with it
    return sum(
        _per_rank(shape, nbytes, region)
        for name, (nbytes, region) in layer_saved_terms(shape).items()
        if name not in dropped
    )


def layernorm_stats_bytes_per_layer(shape: ActivationShape, recompute: object = "none") -> float:
    """What Table 2 leaves out: the per-row statistics the parts' norms save (LayerNorm: mean
    and rstd in the activation dtype on CPU, ``2e·sb`` each; RMSNorm: an fp32 rstd, ``4sb``),
    divided by t under sequence parallelism. None under ``full`` or with the ``layernorm``
    module, which recompute the norms whole. The measured bytes per layer are
    :func:`activation_bytes_per_layer` plus this, exactly."""
    policy = RecomputePolicy.parse(recompute)
    if policy.full:
        return 0.0
    stats = block_of_shape(shape).stats_terms(shape, norms_recomputed="layernorm" in policy.modules)
    return sum(_per_rank(shape, nbytes, region) for nbytes, region in stats.values())


def table2_bytes_per_layer(row: str, s: int, b: int, h: int, a: int, t: int = 1) -> float:
    """The bytes of a Table 2 row by name (``no_parallelism`` is evaluated at ``t = 1``)."""
    if row not in TABLE2_SETTINGS:
        raise ConfigError(f"row={row!r} is not a Table 2 row; valid: {', '.join(TABLE2_ROWS)}")
    sequence_parallel, recompute = TABLE2_SETTINGS[row]
    t = 1 if row == "no_parallelism" else t
    shape = ActivationShape(s, b, h, a, t, sequence_parallel=sequence_parallel)
    return activation_bytes_per_layer(shape, recompute)


def figure7_percentages(s: int, b: int, h: int, a: int, t: int) -> dict[str, float]:
    """Figure 7: each of :data:`FIGURE7_ROWS` as a percentage of the ``tensor_parallel`` row."""
    baseline = table2_bytes_per_layer("tensor_parallel", s, b, h, a, t)
    return {
        row: 100.0 * table2_bytes_per_layer(row, s, b, h, a, t) / baseline for row in FIGURE7_ROWS
    }


# -- pipeline parallelism: the first stage (eq. 5, interleaving) --------------------------------


def interleave_factor(p: int, m: int = 1) -> float:
    """How many layers' worth the first stage holds, in units of L (paper §4.4).

    ``1`` under 1F1B (eq. 5: the first stage holds ``L/p`` layers for ``p`` micro-batches in
    flight); ``1 + (p - 1)/(p·m)`` under the interleaved schedule with ``m > 1`` model chunks.
    """
    if m == 1:
        return 1.0
    return 1.0 + (p - 1) / (p * m)


def chunk_forwards_in_flight(p: int, m: int = 1, num_microbatches: int | None = None) -> int:
    """Forward passes of model chunks whose activations the first stage holds at its peak.

    1F1B (``m = 1``): ``p`` micro-batches through the stage's one chunk (fewer if there are
    fewer micro-batches). Interleaved (Megatron's schedule): ``2(p-1) + (m-1)p`` warm-up
    forwards plus one, i.e. ``p·m + p - 1`` chunk forwards, capped by the ``n·m`` there are.
    Times ``L/(p·m)`` layers per chunk this is eq. 5's ``L`` and the interleaved
    ``L(1 + (p-1)/(p·m))``.
    """
    n = num_microbatches if num_microbatches is not None else p
    if m == 1:
        return min(p, n)
    return min(p * m + p - 1, n * m)


def layers_in_flight(
    num_layers: int, p: int, m: int = 1, num_microbatches: int | None = None
) -> float:
    """Layers' worth of activations the first pipeline stage holds: ``L`` (eq. 5), ``L·(1 +
    (p-1)/(p·m))`` interleaved, less when there are fewer micro-batches than that needs."""
    return num_layers / (p * m) * chunk_forwards_in_flight(p, m, num_microbatches)


def first_stage_activation_bytes(
    bytes_per_layer: float,
    num_layers: int,
    p: int = 1,
    m: int = 1,
    num_microbatches: int | None = None,
    extra_bytes: float = 0.0,
) -> float:
    """Activation bytes of the first pipeline stage (eq. 5 × the interleaving factor) plus
    ``extra_bytes`` (:func:`extra_activation_bytes`, §4.5)."""
    return bytes_per_layer * layers_in_flight(num_layers, p, m, num_microbatches) + extra_bytes


def embedding_activation_bytes(shape: ActivationShape) -> float:
    """Bytes the input embedding saves per micro-batch (§4.5): its dropout mask, ``k·sbh/t``
    under sequence parallelism, ``k·sbh`` without (the token ids, ``O(sb)``, are neglected)."""
    if not shape.hidden_dropout:
        return 0.0
    return _per_rank(shape, shape.mask_bytes * shape.sbh, OUTSIDE)


def output_activation_bytes(shape: ActivationShape, v: int, logit_bytes: float = 4) -> float:
    """Bytes the final LayerNorm, output layer and cross entropy save per micro-batch (§4.5).

    Final LayerNorm input ``2sbh/t`` and output-layer input ``2sbh/t`` under sequence
    parallelism (``2sbh`` each without), and the fp32 softmax over this rank's vocabulary
    shard ``4sbv/t``. ``v`` is the (padded) vocabulary the output layer has. Each divided by
    ``c`` under context parallelism.
    """
    inputs = _per_rank(shape, 2 * shape.activation_bytes * shape.sbh, OUTSIDE)
    return inputs + logit_bytes * shape.s * shape.b * v / shape.t / shape.c


def extra_activation_bytes(
    shape: ActivationShape, v: int, p: int = 1, microbatches_in_flight: int | None = None
) -> float:
    """§4.5's extras on the first stage: the embedding's dropout masks for the micro-batches in
    flight (``sbhp/t``), plus, only when the first stage is also the last (``p = 1``), the final
    LayerNorm, output layer and loss of one micro-batch (``4sbh/t·(1 + v/h)``)."""
    in_flight = microbatches_in_flight if microbatches_in_flight is not None else p
    extra = in_flight * embedding_activation_bytes(shape)
    if p == 1:
        extra += output_activation_bytes(shape, v)
    return extra
