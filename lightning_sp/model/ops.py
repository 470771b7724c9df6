"""The elementwise pieces of a decoder block, each with the backward it needs written out, so
that what a block saves for backward is exactly what these functions are given:

* norms: LayerNorm (``F.layer_norm``) and RMSNorm (statistics in fp32, as Llama's reference
  code and Hugging Face's ``LlamaRMSNorm`` compute them, whatever the activation dtype);
* MLP activations ``act(z)`` with ``act_backward(grad, z)``: GeLU (exact or tanh) on ``z`` of
  width ``f``, SwiGLU ``silu(gate) * up`` on ``z = [gate | up]`` of width ``2f``;
* rotary position embeddings (RoPE): the cos/sin tables for given positions, with Llama 3.1's
  frequency scaling, computed in fp32 as Hugging Face does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

# -- norms -------------------------------------------------------------------------------------


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dimension (``F.layer_norm``)."""
    return nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)


def rms_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dimension: ``weight * (x / rms(x))`` with the statistics in fp32
    and the product in ``x``'s dtype (Llama's definition, as Hugging Face's ``LlamaRMSNorm``
    computes it). Differentiable; the standalone norm and the fused ``layernorm`` recompute
    both run this one function, so their gradients agree bit for bit."""
    return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm saving its input and the fp32 ``rstd`` per row, nothing else.

    forward:  ``y = w * (x·rstd)``, ``rstd = 1/sqrt(mean(x²) + eps)`` computed from ``x`` in
              fp32, the normalised ``x·rstd`` cast to ``x``'s dtype before the weight.
    backward: ``n = x·rstd``; ``grad_w = Σ_rows grad·n``; ``grad_x = rstd·(gw - n·mean(gw·n))``
              with ``gw = grad·w``, in fp32 (float64 for float64 inputs), cast back.
    saves:    ``x`` and ``rstd`` (``[..., 1]``, fp32).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        wide = torch.promote_types(x.dtype, torch.float32)
        normed = (x.float() * rstd).to(x.dtype)
        grad_w = (grad * normed).reshape(-1, grad.shape[-1]).sum(0)
        gw = (grad * weight).to(wide)
        n = x.to(wide) * rstd
        grad_x = rstd * (gw - n * (gw * n).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


class RMSNorm(nn.Module):
    """RMSNorm with a weight and no bias; saves its input and an fp32 ``rstd`` per row."""

    bias: None

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = None

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, None, self.eps)


# -- MLP activations ---------------------------------------------------------------------------


def gelu(z: Tensor) -> Tensor:
    return nn.functional.gelu(z)


def gelu_backward(grad: Tensor, z: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad, z)


def gelu_tanh(z: Tensor) -> Tensor:
    return nn.functional.gelu(z, approximate="tanh")


def gelu_tanh_backward(grad: Tensor, z: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad, z, approximate="tanh")


def swiglu(z: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``z = [gate | up]`` along the last dimension: ``[..., 2f] ->
    [..., f]``."""
    gate, up = z.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def swiglu_backward(grad: Tensor, z: Tensor) -> Tensor:
    """The gradient of :func:`swiglu` with respect to ``z = [gate | up]``."""
    gate, up = z.chunk(2, dim=-1)
    out = torch.empty_like(z)
    grad_gate, grad_up = out.chunk(2, dim=-1)  # views: written in place, no concatenation
    # d/dgate: silu'(gate)·(grad·up), one fused kernel; d/dup: grad·silu(gate)
    torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
    torch.mul(grad, nn.functional.silu(gate), out=grad_up)
    return out


# -- rotary position embeddings ----------------------------------------------------------------


ROPE_TYPES = ("llama3", "linear", "dynamic")
"""The RoPE frequency scalings, by ``RopeScaling.rope_type`` (Hugging Face's names)."""


@dataclass
class RopeScaling:
    """A RoPE frequency scaling, by ``rope_type`` (Hugging Face's ``rope_type``):

    * ``llama3`` (Llama 3.1): wavelengths longer than ``original_max_position_embeddings /
      low_freq_factor`` are divided by ``factor``, shorter than ``... / high_freq_factor`` are
      kept, and those in between interpolated smoothly;
    * ``linear``: every frequency divided by ``factor`` (positions interpolated);
    * ``dynamic`` (dynamic NTK): for a sequence of ``L > original_max_position_embeddings =
      M`` tokens the base becomes ``theta·(factor·L/M - (factor - 1))^(d/(d-2))``; for ``L <=
      M`` the frequencies are unscaled (Hugging Face's ``dynamic``, whose ``M`` is
      ``max_position_embeddings``).
    """

    factor: float = 8.0
    """How much the low frequencies are slowed down."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int = 8192
    """The context length the model was pre-trained with before the extension."""
    rope_type: str = "llama3"
    """``llama3``, ``linear`` or ``dynamic`` (:data:`ROPE_TYPES`)."""


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, seq_len: int = 0
) -> Tensor:
    """``1/theta^(2i/d)`` for ``i < d/2``, in fp32, scaled by ``scaling`` (``seq_len``: the
    sequence the tables are for, which only ``dynamic`` reads), as Hugging Face computes it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling.rope_type == "dynamic":
        limit = scaling.original_max_position_embeddings
        if seq_len > limit:
            factor = scaling.factor
            theta = theta * (factor * seq_len / limit - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of ``positions × inv_freq`` (fp32 angles), each ``[len(positions), d]``
    (the ``d/2`` angles twice, for the two halves), cast to ``dtype``."""
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (the halves-convention rotation)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
