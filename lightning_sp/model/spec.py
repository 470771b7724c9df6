"""The parts a decoder architecture is made of, as data: each part states, in one place, the
module it builds, the tensors it saves for backward, its parameters and its forward FLOPs.

An architecture is a choice of one descriptor per kind (``GPTConfig.normalization``,
``position_embedding``, ``activation``) plus the attention heads and key/value groups, linear
biases and tied embeddings. The model (:mod:`lightning_sp.model.gpt`), the memory formulas,
the FLOPs count, the planner, the monitors, the pipeline and the Hugging Face interop read
these descriptors; none of them asks which architecture it is looking at.

Symbols: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``f`` MLP width, ``e`` bytes per
activation element.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from torch import Tensor, nn

from lightning_sp.model import ops


class NormModule(Protocol):
    """What a built norm offers: its parameters and epsilon, and the standalone forward."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    eps: float

    def __call__(self, x: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class NormKind:
    """A normalisation: ``layernorm`` (weight and bias) or ``rmsnorm`` (weight only)."""

    name: str
    functional: Callable[[Tensor, Tensor, Tensor | None, float], Tensor]
    """``fn(x, weight, bias, eps)``: the norm, differentiable by autograd (what the fused
    ``layernorm`` recompute replays in its consumer's backward)."""
    has_bias: bool
    stats_bytes_per_row: Callable[[float], float]
    """Bytes of per-row statistics the standalone norm saves besides its input, given the
    bytes of a LayerNorm statistic (:attr:`ActivationShape.norm_stats_bytes`, else ``e``)
    (LayerNorm: mean and rstd, ``2e`` on a CPU, 8 on CUDA for 2-byte activations; RMSNorm:
    an fp32 rstd, 4). Table 2 leaves these out."""

    def build(self, hidden_size: int, eps: float, **kwargs: Any) -> NormModule:
        """The standalone module (``.weight``, ``.bias`` or None, ``.eps``)."""
        if self.has_bias:
            return cast(NormModule, nn.LayerNorm(hidden_size, eps=eps, **kwargs))
        return cast(NormModule, ops.RMSNorm(hidden_size, eps=eps, **kwargs))

    def parameters(self, h: int) -> int:
        """Parameters of one norm: ``2h`` with a bias, else ``h``."""
        return 2 * h if self.has_bias else h


NORMS: dict[str, NormKind] = {
    n.name: n
    for n in (
        NormKind("layernorm", ops.layer_norm, True, lambda e: 2 * e),
        NormKind("rmsnorm", ops.rms_norm, False, lambda e: 4.0),
    )
}
"""Every normalisation, by ``GPTConfig.normalization`` name."""


@dataclass(frozen=True)
class ActivationKind:
    """The MLP's nonlinearity. A *gated* one (SwiGLU) has two input projections, ``gate`` and
    ``up``, whose outputs ``z = [gate | up]`` (width ``2f``) it turns into ``f``; an ungated one
    has one, ``fc1`` (width ``f``)."""

    name: str
    forward: Callable[[Tensor], Tensor]
    """``act(z)``: ``[..., f·inputs] -> [..., f]``."""
    backward: Callable[[Tensor, Tensor], Tensor]
    """``act_backward(grad, z)``: the gradient with respect to ``z``."""
    inputs: tuple[str, ...]
    """Names of the input projections (``h -> f`` each, column parallel), in ``z``'s order."""
    hf_name: str
    """Hugging Face's name for it (``activation_function`` / ``hidden_act``)."""

    @property
    def gated(self) -> bool:
        return len(self.inputs) > 1

    def input_bytes(self, e: float, sbf: float) -> float:
        """Bytes of ``z`` (what the activation saves): ``e·sbf`` per input projection."""
        return len(self.inputs) * e * sbf

    def parameters(self, h: int, f: int, bias: bool) -> int:
        """Parameters of the whole MLP (all ranks): input projections and the output one."""
        n = len(self.inputs)
        return n * f * h + f * h + ((n * f + h) if bias else 0)

    def forward_flops(self, tokens: float, h: int, f: int) -> float:
        """Matmul FLOPs of the MLP's forward for ``tokens`` tokens: ``2·tokens·h·f`` per
        projection (``4Bshf`` ungated, ``6Bshf`` gated)."""
        return 2.0 * tokens * h * f * (len(self.inputs) + 1)


ACTIVATIONS: dict[str, ActivationKind] = {
    a.name: a
    for a in (
        ActivationKind("gelu", ops.gelu, ops.gelu_backward, ("fc1",), "gelu"),
        ActivationKind("gelu_tanh", ops.gelu_tanh, ops.gelu_tanh_backward, ("fc1",), "gelu_new"),
        ActivationKind("swiglu", ops.swiglu, ops.swiglu_backward, ("gate", "up"), "silu"),
    )
}
"""Every MLP activation, by ``GPTConfig.activation`` name."""


@dataclass(frozen=True)
class PositionKind:
    """How positions enter: ``learned`` (a table of ``s × h`` added to the embedding) or
    ``rope`` (rotary: Q and K rotated inside attention; no parameters)."""

    name: str
    learned: bool

    def parameters(self, s: int, h: int) -> int:
        return s * h if self.learned else 0


POSITIONS: dict[str, PositionKind] = {
    p.name: p for p in (PositionKind("learned", True), PositionKind("rope", False))
}
"""Every position encoding, by ``GPTConfig.position_embedding`` name."""
