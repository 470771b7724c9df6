"""A transformer layer as a composition of parts: sublayers, each a norm, a mixer (attention,
a feed-forward) and the norm's placement, joined by residual connections with dropout.

``pre`` placement (GPT-2, Llama): ``x + drop(mixer(norm(x)))``; ``post`` (OLMo 2):
``x + drop(norm(mixer(x)))``. The layer's saved tensors, kernels, parameters and FLOPs are the
sums over its parts plus each residual's own (its dropout mask ``k·sbh`` and the fused
bias-dropout-add). :class:`Block` is what the memory formulas, the planner, the FLOPs count
and the model read; none of them asks which family it is looking at.

The feed-forward slot is a registry (:data:`FEED_FORWARDS`, ``GPTConfig.feed_forward``): the
dense MLP today; a mixture of experts is one more entry (a :class:`~lightning_sp.model.parts.
base.Part` whose input term is ``fc1_input``, so that the ``layernorm`` module drops it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_sp.model.moe.part import MoEFeedForward
from lightning_sp.model.parts.attention import SelfAttention
from lightning_sp.model.parts.base import (
    ACT,
    EVERY_RANK,
    INSIDE,
    MASK,
    OUTSIDE,
    REPLICATED,
    Collective,
    Gemm,
    MemoryOp,
    Part,
    Terms,
    outside_elements,
)
from lightning_sp.model.parts.build import LayerConfig
from lightning_sp.model.parts.dense import DenseMLP
from lightning_sp.model.parts.norm import Norm
from lightning_sp.model.parts.weights import HFNames, Weight, under
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.fp8 import KEEPS_FLOAT8_INPUT

PLACEMENTS = ("pre", "post")
"""Where a sublayer's norm goes, by ``GPTConfig.norm_placement`` name."""


@dataclass(frozen=True)
class Sublayer:
    """One residual branch: ``name`` (the mixer's module name: ``attention``, ``mlp``), its
    norm (module ``norm.name``: ``ln1``, ``ln2``), the mixer part, where the norm goes, and
    ``mask`` (the residual dropout mask's term name)."""

    name: str
    norm: Norm
    mixer: Part
    mask: str
    placement: str = "pre"
    """``pre`` or ``post`` (:data:`PLACEMENTS`)."""

    @property
    def parts(self) -> tuple[Part, Part]:
        return self.norm, self.mixer

    def residual_terms(self, x: ActivationShape) -> Terms:
        """The residual dropout's mask, ``k·sbh`` with hidden dropout (outside)."""
        return {self.mask: (x.mask_bytes * x.sbh if x.hidden_dropout else 0.0, OUTSIDE)}

    def residual_ops(self, x: ActivationShape) -> list[MemoryOp]:
        """The fused bias-dropout-add (forward read 2 + 2, write 2 and a 1-byte mask, 7 bytes
        per element; backward read gradient and mask, write 2, 5; ``residual_mask`` replays
        only the mask, 1)."""
        outside = outside_elements(x)
        return [
            MemoryOp(
                "bias_dropout_add",
                (3 * ACT + MASK) * outside,
                (2 * ACT + MASK) * outside,
                tag="residual_mask",
                replay_bytes=MASK * outside,
            )
        ]


@dataclass(frozen=True)
class Block:
    """A layer's sublayers, in order (see the module docstring)."""

    sublayers: tuple[Sublayer, ...]

    @property
    def parts(self) -> tuple[Part, ...]:
        return tuple(p for sub in self.sublayers for p in sub.parts)

    def saved_terms(self, x: ActivationShape) -> Terms:
        """Every tensor the layer saves, outside terms first then inside ones, each in
        sublayer order (norm, mixer, residual mask); with LoRA (``x.lora``) the mixers'
        adapter terms added and the inputs their frozen linears no longer keep left out
        (:meth:`~lightning_sp.model.parts.base.Part.adapter_terms`)."""
        terms: Terms = {}
        for sub in self.sublayers:
            mixer = sub.mixer.saved_terms(x)
            adapters, frozen = sub.mixer.adapter_terms(x, sub.name)  # LoRA: x.lora
            mixer = {n: v for n, v in mixer.items() if n not in frozen} | adapters
            kept = {lin.input_term for lin in sub.mixer.linears(x) if lin.input_term}
            if sub.placement == "post" and sub.mixer.input_term in mixer:
                mixer[f"{sub.name}_input"] = mixer.pop(sub.mixer.input_term)
                kept = {f"{sub.name}_input" if n == sub.mixer.input_term else n for n in kept}
            if x.fp8 is not None and KEEPS_FLOAT8_INPUT[x.fp8]:
                mixer = sub.mixer.float8_terms(x, mixer, kept)
            terms.update(sub.norm.saved_terms(x))
            terms.update(mixer)
            terms.update(sub.residual_terms(x))
        order = (OUTSIDE, INSIDE, REPLICATED, EVERY_RANK)
        return {n: v for region in order for n, v in terms.items() if v[1] == region}

    def stats_terms(self, x: ActivationShape, norms_recomputed: bool = False) -> Terms:
        """The norms' per-row statistics, left out of :meth:`saved_terms` (Table 2 neglects
        them); ``norms_recomputed`` (the ``layernorm`` module): the pre-norms' are not kept
        (they are recomputed whole inside their consumers' backward) where the mixer's linears
        read the norm (an ``input_term``); an MoE layer's norm feeds the router as well, which
        keeps its output, so that norm runs as it is and keeps its statistics."""
        return {
            n: v
            for sub in self.sublayers
            if not (norms_recomputed and sub.placement == "pre" and sub.mixer.input_term)
            for p in sub.parts
            for n, v in p.stats_terms(x).items()
        }

    def gemms(self, x: ActivationShape) -> list[Gemm]:
        return [g for p in self.parts for g in p.gemms(x)]

    def input_gemms(self) -> tuple[tuple[str, ...], ...]:
        """Per sublayer, the mixer's GEMMs reading the gathered sequence (``qkv``; ``fc1``
        or ``gate`` + ``up``)."""
        return tuple(sub.mixer.input_gemms() for sub in self.sublayers)

    def memory_ops(self, x: ActivationShape) -> list[MemoryOp]:
        """The parts' and residuals' kernels; kernels of one name (the two norms, the two
        bias-dropout-adds) summed into one record, at the first one's place."""
        merged: dict[str, MemoryOp] = {}
        for sub in self.sublayers:
            for op in [*sub.norm.memory_ops(x), *sub.mixer.memory_ops(x), *sub.residual_ops(x)]:
                if op.name in merged:
                    old = merged[op.name]
                    replay = None
                    if old.replay_bytes is not None or op.replay_bytes is not None:
                        replay = old.replayed + op.replayed
                    op = MemoryOp(
                        op.name,
                        old.forward_bytes + op.forward_bytes,
                        old.backward_bytes + op.backward_bytes,
                        op.tag,
                        replay,
                    )
                merged[op.name] = op
        return list(merged.values())

    def collectives(self, x: ActivationShape) -> list[Collective]:
        """The TP collectives the parts run besides the layer's own."""
        return [col for p in self.parts for col in p.collectives(x)]

    def parameters(self, x: ActivationShape) -> int:
        """Parameters on one of ``x.t`` tensor-parallel ranks."""
        counts = [p.parameters(x) for p in self.parts]
        return sum(split // x.t for split, _ in counts) + sum(rep for _, rep in counts)

    def forward_flops(self, x: ActivationShape) -> float:
        """Matmul FLOPs of the layer's forward for ``x.b`` sequences (all ranks)."""
        return sum(p.forward_flops(x) for p in self.parts)

    def expert_parameters(self, x: ActivationShape) -> int:
        """Parameters of the layer that expert parallelism shares out (the routed experts)."""
        return sum(p.expert_parameters(x) for p in self.parts)

    def active_expert_parameters(self, x: ActivationShape) -> int:
        """Of :meth:`expert_parameters`, those one token uses."""
        return sum(p.active_expert_parameters(x) for p in self.parts)

    def dispatch_bytes(self, x: ActivationShape) -> float:
        """Bytes one rank sends in each of the layer's expert all-to-alls."""
        return sum(p.dispatch_bytes(x) for p in self.parts)

    def weights(self, names: HFNames) -> tuple[Weight, ...]:
        """Every parameter of the layer (our names under ``layers.{i}``) and the Hugging Face
        tensor holding it (under ``names.layer``): each part's rows under its module, the
        norms named by their placement."""
        rows: list[Weight] = []
        for sub in self.sublayers:
            rows += under(sub.norm.weights(names, sub.placement), sub.norm.name)
            rows += under(sub.mixer.weights(names), sub.name)
        return under(tuple(rows), "layers.{i}", names.layer)


FeedForwardFactory = Callable[[LayerConfig], Part]

FEED_FORWARDS: dict[str, FeedForwardFactory] = {
    "dense": lambda c: DenseMLP(c.activation, c.has_bias("fc1"), c.has_bias("fc2")),
    "moe": lambda c: MoEFeedForward(c.moe),
}
"""The feed-forward slot's parts, by ``GPTConfig.feed_forward`` name: each builds the part of
a config."""


def block_of(config: LayerConfig) -> Block:
    """The layer of ``config``: attention then feed-forward, each behind a norm."""
    norm, where = config.normalization, config.norm_placement
    attention = SelfAttention(config.has_bias("qkv"), config.has_bias("proj"), config.qk_norm)
    feed_forward = FEED_FORWARDS[config.feed_forward](config)
    return Block(
        (
            Sublayer("attention", Norm(norm, "ln1"), attention, "attn_residual_mask", where),
            Sublayer("mlp", Norm(norm, "ln2"), feed_forward, "mlp_residual_mask", where),
        )
    )


def block_of_shape(x: ActivationShape) -> Block:
    """The layer a shape describes: its ``block`` if it carries one, else the pre-norm
    attention + dense MLP of its ``norm`` and ``activation`` (the paper's, by default)."""
    if isinstance(x.block, Block):
        return x.block
    attention = SelfAttention()
    mlp = DenseMLP(x.activation)
    return Block(
        (
            Sublayer("attention", Norm(x.norm, "ln1"), attention, "attn_residual_mask"),
            Sublayer("mlp", Norm(x.norm, "ln2"), mlp, "mlp_residual_mask"),
        )
    )
