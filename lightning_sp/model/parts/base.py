"""What a part of a transformer layer is: the contract every part (a norm, the attention, a
feed-forward) fulfils, and the records it answers in.

A part owns, in one place, everything the rest of the package asks about it:

* :meth:`Part.build`: the ``nn.Module`` it is (one rank's shard), from a
  :class:`~lightning_sp.model.parts.build.BuildContext`;
* :meth:`Part.saved_terms`: the tensors it saves for backward, ``name -> (bytes for the whole
  layer before any split, region)``; the region says how a rank's share divides
  (:data:`INSIDE`: by t; :data:`OUTSIDE`: by t under sequence parallelism only); the names
  are what the recompute modules drop (:data:`lightning_sp.model.recompute.RECOMPUTE_MODULES`);
* :meth:`Part.gemms` and :meth:`Part.memory_ops`: its kernels on one rank, and
  :meth:`Part.collectives`: the collectives its module runs besides the layer's tensor-parallel
  ones, for the step-time model (:mod:`lightning_sp.planner.steptime`);
* :meth:`Part.parameters`: its parameter count on one rank (split by t, and replicated);
* :meth:`Part.forward_flops`: its forward matmul FLOPs (all ranks together);
* :meth:`Part.weights`: its parameters' Hugging Face tensors under a family's naming scheme
  (:mod:`lightning_sp.model.parts.weights`);
* :meth:`Part.step_totals`: the per-layer sums its module counts over a training step and the
  step metrics made of them (:class:`StepTotals`; what the training loop logs through the
  generic module hooks, :mod:`lightning_sp.model.hooks`).

Every method reads the layer's sizes from one
:class:`~lightning_sp.model.shape.ActivationShape` (``s, b, h, a, g, d, f, t, c``, element
sizes, dropouts, attention backend); a part's own options (a norm kind, biases, an
activation) are its fields. The layer (:mod:`lightning_sp.model.parts.block`) is a sum over
its parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from torch import Tensor, nn

from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.parts.weights import HFNames, Weight
from lightning_sp.model.shape import ActivationShape

ACT, MASK = 2, 1
"""Bytes per activation element and per dropout-mask element in the kernel records (the
paper's: bf16 activations, 1-byte masks)."""

INSIDE, OUTSIDE, REPLICATED = "inside", "outside", "replicated"
"""Where a saved tensor lives: inside the tensor-parallel region (split by t), outside it
(replicated over t, or split by t under sequence parallelism), or replicated on every TP rank
whatever the layout (per-token statistics of a norm over a sharded dimension)."""

EVERY_RANK = "every_rank"
"""A saved tensor of the same size on every rank whatever the layout (a float8 input's
scale: 4 bytes)."""

Terms = dict[str, tuple[float, str]]
"""Saved tensors of a part: ``name -> (bytes for the whole layer before any split, region)``."""


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
    routed: bool = False
    """Whether it runs on the tokens routed to this rank (a mixture of experts' experts): its
    rows follow the tokens the rank receives, which an imbalanced router sets above the mean
    the shape states (the step-time model's ``expert_load_imbalance``)."""
    high_precision: bool = False
    """Whether it stays in the run's precision under ``fp8`` (a mixture of experts' router),
    as the attention core (``tag``) does."""

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
    routed: bool = False
    """Whether it moves the tokens routed to this rank (as :attr:`Gemm.routed`)."""

    @property
    def replayed(self) -> float:
        return self.forward_bytes if self.replay_bytes is None else self.replay_bytes


def activation_op(name: str, elements: float, inputs: int, split: int = 1) -> MemoryOp:
    """The fused MLP activation on ``elements`` outputs (rows x width before the ``split``
    over TP ranks), reading its ``inputs`` inputs of the same width (GeLU one, SwiGLU's gate
    and up two), as bytes per element of ``elements·(1 + inputs)/(2·split)``: forward 4 (read
    2, write 2), backward 6 (read input and gradient, write gradient), tagged ``mlp_act``."""
    inner = elements * (1 + inputs) / (2 * split)
    return MemoryOp(name, 4 * inner, 6 * inner, tag="mlp_act")


class CollectiveKind(Enum):
    """What a part's collective does over the tensor-parallel group (the step-time model
    prices each kind: :data:`lightning_sp.planner.kernels.COLLECTIVE_SECONDS`)."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"


@dataclass(frozen=True)
class Collective:
    """A collective over the tensor-parallel group that a part's module runs on one rank,
    besides the layer's own TP collectives (the f / g around its linears, which the step-time
    model places itself): ``nbytes`` per call (an all-reduce's tensor; the whole, gathered
    tensor of an all-gather or reduce-scatter), ``forward`` and ``backward`` calls per
    micro-batch (a backward call is priced as the same kind: an all-gather's adjoint, a
    reduce-scatter of the same tensor, moves as many bytes)."""

    name: str
    kind: CollectiveKind
    nbytes: float
    forward: int
    backward: int


@dataclass(frozen=True)
class PartLinear:
    """One linear of a part that may take a LoRA adapter (:mod:`lightning_sp.model.lora`):
    its module name under the part (``query``, ``fc2``), ``column`` or ``row`` parallel, its
    input and output widths before any TP split (``h``; a row-parallel linear's input ``f`` or
    ``a·d``; a key's output ``g'·d``, replicas counted), and the term of the input it keeps for
    its weight gradient (``qkv_input``, ``fc2_input``; ``""`` when it keeps its input whatever
    the weight: the attention projection holds the core's output, which SDPA keeps too)."""

    name: str
    kind: str
    width: int
    outputs: int
    input_term: str = ""


@dataclass(frozen=True)
class StepTotals:
    """What a part's module counts over a training step, and the step's metrics made of it.

    The module (:class:`~lightning_sp.model.hooks.CountsStepTotals`) adds ``width`` float64
    sums per training forward; the loop places each layer's at its global layer number in a
    ``[num_layers, width]`` table, sums the table over every data-parallel replica and
    pipeline stage (:func:`~lightning_sp.model.hooks.step_metrics`), and ``metrics(table)``
    turns the sums into the step's metrics by name (``moe/aux_loss`` ...; rows of layers
    that counted nothing are zero)."""

    width: int
    metrics: Callable[[Tensor], dict[str, Tensor]]


def tokens(x: ActivationShape) -> int:
    """Rows of every token-wise GEMM on one rank: ``s·b/c``."""
    return x.s * x.b // x.c


def outside_elements(x: ActivationShape) -> float:
    """Elements of one ``[s, b, h]`` tensor outside the TP region on one rank: ``s·b·h/c``,
    divided by t under sequence parallelism."""
    return x.s // x.c * x.b * x.h / (x.t if x.sequence_parallel else 1)


def float8_scale(term: str) -> str:
    """The name of the scale kept beside ``term``'s float8 input: dropped with ``term``."""
    return f"{term}_scale"


class Part(ABC):
    """One part of a transformer layer (see the module docstring). Subclasses are frozen
    dataclasses whose fields are the part's options."""

    @abstractmethod
    def build(self, ctx: BuildContext) -> nn.Module:
        """The module, one rank's shard; its parameters marked for initialisation."""

    @abstractmethod
    def saved_terms(self, x: ActivationShape) -> Terms:
        """The tensors it saves for backward with no recompute module active."""

    def gemms(self, x: ActivationShape) -> list[Gemm]:
        """Its forward GEMMs on one rank (backward: :func:`lightning_sp.planner.ops.
        backward_gemms` of each)."""
        return []

    reads_sequence: bool = False
    """Whether its module takes the sequence's document ids and token positions (keywords
    ``documents``, ``positions``: attention masks across documents and rotates by position; a
    feed-forward acts on each token alone)."""

    input_term: str = ""
    """The term of its input tensor as its linears save it (``qkv_input``, ``fc1_input``):
    before a pre-norm the ``layernorm`` module drops it (the norm's input stands for it);
    after no norm (post-norm) it is the residual stream itself, kept under the name
    ``<sublayer>_input``."""

    def input_gemms(self) -> tuple[str, ...]:
        """Names of its GEMMs that read the layer's (gathered) sequence: under sequence
        parallelism the all-gather before them overlaps their backward."""
        return ()

    def memory_ops(self, x: ActivationShape) -> list[MemoryOp]:
        """Its memory-bound kernels on one rank."""
        return []

    def collectives(self, x: ActivationShape) -> list[Collective]:
        """The TP collectives its module runs on one rank besides the layer's (none for most
        parts; none at ``x.t = 1``)."""
        return []

    @abstractmethod
    def parameters(self, x: ActivationShape) -> tuple[int, int]:
        """``(split, replicated)``: parameters split over the ``x.t`` tensor-parallel ranks
        (their total over all ranks, replicas of shared K/V groups counted) and parameters
        every rank holds whole."""

    def forward_flops(self, x: ActivationShape) -> float:
        """Matmul FLOPs of its forward for ``x.b`` whole sequences of ``x.s`` (all ranks)."""
        return 0.0

    def expert_parameters(self, x: ActivationShape) -> int:
        """Of the replicated count of :meth:`parameters`, those that expert parallelism
        shares out (a rank of an EP group of ``e`` holds ``1/e`` of them); 0 for most parts."""
        return 0

    def active_expert_parameters(self, x: ActivationShape) -> int:
        """Of :meth:`expert_parameters`, those one token uses (``k`` of ``E`` experts)."""
        return 0

    def dispatch_bytes(self, x: ActivationShape) -> float:
        """Bytes of the rows one rank sends to experts in one forward all-to-all (the combine
        brings as many back; backward repeats both); 0 for most parts."""
        return 0.0

    @abstractmethod
    def weights(self, names: HFNames) -> tuple[Weight, ...]:
        """Its parameters (names under its module) and the Hugging Face tensors holding them
        (names under the layer prefix) in the family naming scheme ``names``: only the
        parameters its options give it; ``KeyError`` for a convention it has no names in."""

    def linears(self, x: ActivationShape) -> tuple[PartLinear, ...]:
        """Its linears that may take a LoRA adapter (none for most parts; an MoE layer's
        experts take none)."""
        return ()

    def adapter_terms(self, x: ActivationShape, sub: str) -> tuple[Terms, frozenset[str]]:
        """With LoRA (``x.lora``; ``sub``: its sublayer's module name, the prefix of the
        adapted paths): the terms its adapters add, and those of its own :meth:`saved_terms`
        its frozen base no longer keeps.

        Each adapted linear keeps its low-rank activation ``A drop(x)``, ``e·sb·r`` on every
        TP rank (``[s, b, r]``: the whole sequence, as the linear's gathered input or its
        partial sum over its input shard; :data:`REPLICATED`), and with ``lora_dropout`` a
        1-byte mask of its input: ``k·sbh`` (a column-parallel linear's gathered input,
        replicated) or ``k·sb·w`` for a row-parallel one of input width ``w`` (inside: split
        by t). A term holding the input of linears none of which is adapted is dropped: a
        frozen weight needs no weight gradient, so no input (its input gradient needs only
        ``W``)."""
        lora = x.lora
        if lora is None:
            return {}, frozenset()
        e, k, sb = x.activation_bytes, x.mask_bytes, x.s * x.b
        linears = self.linears(x)
        adapted = [lin for lin in linears if f"{sub}.{lin.name}" in lora.targets]
        terms: Terms = {}
        for lin in adapted:
            terms[f"{sub}.{lin.name}.lora_low"] = (e * sb * lora.r, REPLICATED)
            if lora.dropout:
                region = REPLICATED if lin.kind == "column" else INSIDE
                terms[f"{sub}.{lin.name}.lora_mask"] = (k * sb * lin.width, region)
        kept = {lin.input_term for lin in adapted}
        dropped = frozenset(lin.input_term for lin in linears if lin.input_term) - kept
        return terms, dropped

    def float8_terms(self, x: ActivationShape, terms: Terms, kept: set[str]) -> Terms:
        """Its :meth:`saved_terms` (as the layer holds them, ``terms``) under an FP8 recipe
        that keeps a linear's forward cast of its input (``x.fp8``,
        :data:`~lightning_sp.parallel.fp8.KEEPS_FLOAT8_INPUT`); ``kept``: the terms its
        linears' inputs are held under. Default: each of those ``e·N`` bytes becomes ``N`` (1
        byte an element) and its 4-byte fp32 scale, :func:`float8_scale`, is kept on every
        rank (:data:`EVERY_RANK`; a recompute module that drops the input drops its scale)."""
        out: Terms = {}
        for name, (nbytes, region) in terms.items():
            out[name] = (nbytes / x.activation_bytes, region) if name in kept else (nbytes, region)
            if name in kept:
                out[float8_scale(name)] = (4.0, EVERY_RANK)
        return out

    def stats_terms(self, x: ActivationShape) -> Terms:
        """Per-row statistics it saves besides :meth:`saved_terms` (a norm's mean and rstd,
        ``O(sb)``: Table 2 leaves them out), as terms; recomputing the norm drops them."""
        return {}

    def step_totals(self) -> StepTotals | None:
        """What its module counts over a training step for the step's metrics (its module
        then implements :class:`~lightning_sp.model.hooks.CountsStepTotals`); ``None`` for
        most parts."""
        return None
