"""The dense feed-forward part (the MLP): ``h -> f`` (the activation's input projections,
column parallel: ``fc1``, or SwiGLU's ``gate`` and ``up``) -> activation -> ``f -> h``
(``fc2``, row parallel). The first entry of the feed-forward slot
(:data:`lightning_sp.model.parts.block.FEED_FORWARDS`); a mixture of experts is the next."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lightning_sp.model.fused import act_row_linear, activate, fused_column_linear
from lightning_sp.model.parts.base import (
    INSIDE,
    OUTSIDE,
    Gemm,
    MemoryOp,
    Part,
    PartLinear,
    Terms,
    activation_op,
    tokens,
)
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.parts.weights import HFNames, WeightMap, convention, linear
from lightning_sp.model.shape import ActivationShape
from lightning_sp.model.spec import ACTIVATIONS, NORMS, ActivationKind, NormModule
from lightning_sp.parallel.layers import ColumnParallelLinear, RowParallelLinear

HF_MLP: dict[str, dict[str, str]] = {
    "gpt2": {"fc1": "mlp.c_fc", "fc2": "mlp.c_proj"},
    "llama": {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "fc2": "mlp.down_proj"},
}
"""The MLP's Hugging Face modules under a layer: convention -> our linear (``fc1``, or
SwiGLU's ``gate`` and ``up``; ``fc2``) -> theirs."""


class MLP(nn.Module):
    """h -> f (the activation's input projections, column parallel: ``fc1``, or ``gate`` and
    ``up``) -> activation -> h (``fc2``, row parallel)."""

    def __init__(
        self, ctx: BuildContext, bias_in: bool | None = None, bias_out: bool | None = None
    ) -> None:
        """Built from ``ctx`` whole (its config's sizes and activation, its layout, its
        layer's ``mlp_act`` recompute module); ``bias_in`` / ``bias_out`` (the part's; None:
        the config's ``fc1`` / ``fc2`` biases)."""
        super().__init__()
        config, state, kwargs = ctx.config, ctx.state, ctx.kwargs
        sp = config.sequence_parallel
        self.kind = ACTIVATIONS[config.activation]
        self.norm_kind = NORMS[config.normalization]
        self.recompute_act = ctx.recomputes("mlp_act")
        """Whether the activation is recomputed in fc2's backward (``mlp_act``)."""
        bias_in = config.has_bias("fc1") if bias_in is None else bias_in
        bias_out = config.has_bias("fc2") if bias_out is None else bias_out
        for name in self.kind.inputs:
            linear = ColumnParallelLinear(
                config.hidden_size, config.ffn_size, state, sequence_parallel=sp,
                bias=bias_in, init_std=config.init_std, **kwargs,
            )  # fmt: skip
            self.add_module(name, linear)
        self.fc2 = RowParallelLinear(
            config.ffn_size, config.hidden_size, state, sequence_parallel=sp,
            bias=bias_out, init_std=config.output_init_std, **kwargs,
        )  # fmt: skip

    @property
    def inputs(self) -> list[ColumnParallelLinear]:
        """The input projections, in the order of the activation's input ``z``."""
        return [getattr(self, name) for name in self.kind.inputs]

    def forward(
        self, x: Tensor, norm: NormModule | None = None, recompute_act: bool | None = None
    ) -> Tensor:
        """``x``: the normalised input, or with ``norm`` the layer input (normalised inside
        the input projections, recomputed in their backward). ``recompute_act`` (default: the
        module's): the activation recomputed in fc2's backward. ``[s/t or s, b, h]`` in and
        out, ``[s, b, f/t]`` inside."""
        z = fused_column_linear(x, self.inputs, 1, norm, self.norm_kind)  # [s, b, n·f/t]
        if self.recompute_act if recompute_act is None else recompute_act:
            return act_row_linear(z, self.fc2, self.kind)
        return self.fc2(activate(z, self.kind))


@dataclass(frozen=True)
class DenseMLP(Part):
    """The dense MLP of width ``f`` (``x.ffn``) and activation ``activation``.

    saves: ``fc1_input`` ``e·sbh`` (outside; the ``layernorm`` module drops it), the
    activation's input ``act_input`` (``e·sbf`` per input projection: SwiGLU ``2e·sbf``) and
    ``fc2_input`` ``e·sbf`` (inside; ``mlp_act`` drops it). GEMMs: one ``h -> f/t`` per input
    projection, ``fc2`` ``f/t -> h``. Params: ``n·f·h + f·h`` (``n`` input projections) and
    biases as ``bias_in`` / ``bias_out``.
    """

    activation: str = "gelu"
    """The activation (:data:`lightning_sp.model.spec.ACTIVATIONS`)."""
    bias_in: bool = True
    """Biases on the input projections (column parallel: split)."""
    bias_out: bool = True
    """A bias on ``fc2`` (row parallel: replicated)."""

    input_term = "fc1_input"

    @property
    def kind(self) -> ActivationKind:
        return ACTIVATIONS[self.activation]

    def build(self, ctx: BuildContext) -> nn.Module:
        return MLP(ctx, self.bias_in, self.bias_out)

    def saved_terms(self, x: ActivationShape) -> Terms:
        e, sbf = x.activation_bytes, x.s * x.b * x.ffn
        return {
            "fc1_input": (e * x.sbh, OUTSIDE),
            "act_input": (self.kind.input_bytes(e, sbf), INSIDE),
            "fc2_input": (e * sbf, INSIDE),
        }

    def gemms(self, x: ActivationShape) -> list[Gemm]:
        n, f, t, h = tokens(x), x.ffn, x.t, x.h
        return [
            *(Gemm(name, n, f // t, h) for name in self.kind.inputs),
            Gemm("fc2", n, h, f // t),
        ]

    def input_gemms(self) -> tuple[str, ...]:
        return self.kind.inputs

    def linears(self, x: ActivationShape) -> tuple[PartLinear, ...]:
        """The input projections (column, reading ``fc1_input``) and ``fc2`` (row, ``f``
        wide, reading ``fc2_input``)."""
        h, f = x.h, x.ffn
        inputs = tuple(PartLinear(n, "column", h, f, "fc1_input") for n in self.kind.inputs)
        return (*inputs, PartLinear("fc2", "row", f, h, "fc2_input"))

    def memory_ops(self, x: ActivationShape) -> list[MemoryOp]:
        """The fused bias-activation on ``sbf/t`` (reading ``z``: SwiGLU reads gate and up),
        4 / 6 bytes per element."""
        elements = x.s // x.c * x.b * x.ffn
        return [activation_op("bias_gelu", elements, len(self.kind.inputs), x.t)]

    def parameters(self, x: ActivationShape) -> tuple[int, int]:
        h, f, n = x.h, x.ffn, len(self.kind.inputs)
        split = n * f * h + f * h + (n * f if self.bias_in else 0)
        return split, h if self.bias_out else 0

    def weights(self, names: HFNames) -> tuple[WeightMap, ...]:
        """The activation's input projections (biases with ``bias_in``) and ``fc2``
        (``bias_out``)."""
        hf = convention(HF_MLP, names.feed_forward, "dense MLP")
        missing = [m for m in (*self.kind.inputs, "fc2") if m not in hf]
        if missing:
            raise KeyError(f"the {names.feed_forward!r} MLP naming has no {missing[0]!r}")
        return (
            *(w for m in self.kind.inputs for w in linear(m, hf[m], self.bias_in, names)),
            *linear("fc2", hf["fc2"], self.bias_out, names),
        )

    def forward_flops(self, x: ActivationShape) -> float:
        return self.kind.forward_flops(x.b * x.s, x.h, x.ffn)
