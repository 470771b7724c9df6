"""The layer's norm parts: a LayerNorm or RMSNorm over the hidden size, before (or after) a
sublayer."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_sp.model.parts.base import OUTSIDE, MemoryOp, Part, Terms, outside_elements
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.parts.weights import HFNames, WeightMap, convention, norm
from lightning_sp.model.shape import ActivationShape
from lightning_sp.model.spec import NORMS, NormKind
from lightning_sp.parallel.init import mark_parameter

HF_NORMS: dict[str, dict[str, dict[str, str]]] = {
    "gpt2": {"pre": {"ln1": "ln_1", "ln2": "ln_2"}},
    "llama": {
        "pre": {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"},
        "post": {"ln1": "post_attention_layernorm", "ln2": "post_feedforward_layernorm"},
    },
}
"""The layer norms' Hugging Face modules: convention -> placement (``pre``, ``post``) -> our
norm (``ln1``, ``ln2``) -> theirs. OLMo 2's post-norms are Llama's naming after the sublayers."""


@dataclass(frozen=True)
class Norm(Part):
    """A norm over ``h`` of the residual stream (``ln1``, ``ln2``): ``kind`` names the
    descriptor (:data:`lightning_sp.model.spec.NORMS`), ``name`` the module (and its term
    ``<name>_input``).

    saves:  its input, ``e·sbh`` (outside the TP region), and per-row statistics
            (:meth:`stats_terms`);
    kernel: one fused norm, forward read 2 + write 2 bytes per element, backward 6;
    params: ``h`` (RMSNorm) or ``2h`` (LayerNorm), replicated (under SP their gradients are
            partial sums per rank, all-reduced over TP).
    """

    kind: str
    name: str

    @property
    def descriptor(self) -> NormKind:
        return NORMS[self.kind]

    def build(self, ctx: BuildContext) -> nn.Module:
        config = ctx.config
        sp = config.sequence_parallel
        norm = self.descriptor.build(config.hidden_size, config.layernorm_eps, **ctx.kwargs)
        mark_parameter(norm.weight, init="ones", sequence_parallel=sp)
        if norm.bias is not None:
            mark_parameter(norm.bias, init="zeros", sequence_parallel=sp)
        return norm  # type: ignore[return-value]

    def saved_terms(self, x: ActivationShape) -> Terms:
        return {f"{self.name}_input": (x.activation_bytes * x.sbh, OUTSIDE)}

    def stats_terms(self, x: ActivationShape) -> Terms:
        per_row = self.descriptor.stats_bytes_per_row(x.norm_stats_bytes or x.activation_bytes)
        return {f"{self.name}_stats": (per_row * x.s * x.b, OUTSIDE)}

    def memory_ops(self, x: ActivationShape) -> list[MemoryOp]:
        outside = outside_elements(x)
        return [MemoryOp("layernorm", 4 * outside, 6 * outside, tag="layernorm")]

    def parameters(self, x: ActivationShape) -> tuple[int, int]:
        return 0, self.descriptor.parameters(x.h)

    def weights(self, names: HFNames, placement: str = "pre") -> tuple[WeightMap, ...]:
        """Weight (and LayerNorm's bias) of the norm before (``pre``) or after (``post``) its
        sublayer."""
        modules = convention(HF_NORMS, names.norm, "norm").get(placement, {})
        if self.name not in modules:
            raise KeyError(f"the {names.norm!r} naming has no {placement}-norm {self.name!r}")
        return norm("", modules[self.name], self.descriptor.has_bias)
