"""The experts of one rank: ``E_local`` SwiGLU MLPs run as grouped matrix products.

Weights are held as Hugging Face's fused in-memory layout, one tensor per projection:
``gate_up [E_local, 2f, h]`` (each expert's ``[gate; up]`` rows) and ``down [E_local, h, f]``.
With expert tensor parallel size 1 they are unsharded inside the tensor-parallel group: every TP
rank holds the same experts and runs them on its own sequence shard's tokens, so their
gradients are partial sums over TP (marked ``sequence_parallel``). With expert tensor parallel
size ``t`` each TP rank holds ``f/t`` of every expert's inner dimension (``gate_up``: rows
``[r·f/t, (r+1)·f/t)`` of the gate and of the up block, column parallel; ``down``: those
columns, row parallel; :class:`~lightning_sp.parallel.init.ExpertSlice`), runs every row the
TP group's ranks received for its experts and returns partial sums of the output; its
gradients are complete for its slice (not marked ``sequence_parallel``). They are marked
``expert`` too, so that gradient reduction takes the expert-data group instead of all of
data x context (:func:`~lightning_sp.parallel.grads.finalize_grads`). ``expert_start`` tells
the initialiser the global index of the first local expert, so each expert draws the same
values under every expert-parallel size.

:func:`grouped_linear` runs ``torch._grouped_mm`` where it can (fp32 and bf16 with 16-byte
aligned rows) and a loop of per-expert matmuls otherwise (float64); both compute the same
products, and the function saves only its input and weight.

With an FP8 recipe (:attr:`Experts.fp8`, set by :func:`~lightning_sp.model.fp8.attach_fp8`)
each expert's gate, up and down projections are their own ``Float8Linear``
(:func:`~lightning_sp.parallel.fp8_grouped.fp8_grouped_linear`): ``gate_up`` column parallel,
``down`` row parallel over the expert tensor parallel group, SwiGLU between them in high
precision.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_sp.model.fused import activate
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.spec import ACTIVATIONS
from lightning_sp.parallel.comm import Group
from lightning_sp.parallel.fp8 import Recipe
from lightning_sp.parallel.fp8_grouped import fp8_grouped_linear
from lightning_sp.parallel.init import ExpertSlice, mark_parameter

SWIGLU = ACTIVATIONS["swiglu"]


def grouped_available(dtype: torch.dtype, *widths: int) -> bool:
    """Whether ``torch._grouped_mm`` takes ``dtype`` with rows of these widths (fp32 and bf16
    only, each row a multiple of 16 bytes; CPU and CUDA alike)."""
    if dtype not in (torch.float32, torch.bfloat16) or not hasattr(torch, "_grouped_mm"):
        return False
    per_row = 16 // (torch.finfo(dtype).bits // 8)
    return all(w % per_row == 0 for w in widths)


def _offsets(counts: list[int], device: torch.device) -> Tensor:
    return torch.tensor(counts, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


def _loop(a: Tensor, b: Tensor, counts: list[int]) -> Tensor:
    """``cat([a_i @ b_i])`` over row groups ``a_i`` of ``a`` (``b``: ``[E, k, n]``)."""
    parts = [rows @ b[i] for i, rows in enumerate(a.split(counts))]
    return torch.cat(parts) if parts else a.new_empty((0, b.shape[2]))


def _grouped_forward(x: Tensor, weight: Tensor, counts: list[int], grouped: bool) -> Tensor:
    """``y_i = x_i W_iᵀ`` for the row groups ``x_i`` of ``x`` (``counts`` rows each)."""
    if grouped:
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=_offsets(counts, x.device))
    return _loop(x, weight.transpose(1, 2), counts)


def _grouped_backward(
    grad: Tensor, x: Tensor | None, weight: Tensor, counts: list[int], grouped: bool
) -> tuple[Tensor, Tensor | None]:
    """The input and weight gradients of :func:`_grouped_forward` (no weight gradient, and
    no ``x`` needed, for a frozen weight: ``x=None``)."""
    grad = grad.contiguous()
    if grouped:
        offs = _offsets(counts, grad.device)
        grad_x = torch._grouped_mm(grad, weight, offs=offs)
        if x is None:
            return grad_x, None
        grad_w = torch._grouped_mm(grad.t(), x, offs=offs)  # [E, n, k]
        return grad_x, grad_w
    grad_x = _loop(grad, weight, counts)
    if x is None:
        return grad_x, None
    grad_w = torch.stack(
        [g.t() @ rows for g, rows in zip(grad.split(counts), x.split(counts), strict=True)]
    )
    return grad_x, grad_w


class _GroupedLinear(torch.autograd.Function):
    """``y_i = x_i W_iᵀ`` per row group; saves ``x`` and ``W`` only (``W`` only for a frozen
    weight, as under LoRA: its input gradient needs no ``x``, and it gets no weight gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, counts: list[int], grouped: bool) -> Tensor:
        ctx.counts, ctx.grouped = counts, grouped
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return _grouped_forward(x, weight, counts, grouped)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        return (*_grouped_backward(grad, x, weight, ctx.counts, ctx.grouped), None, None)


class _GroupedActLinear(torch.autograd.Function):
    """``y_i = swiglu(z_i) W_iᵀ`` per row group, saving ``z`` (which SwiGLU's own backward
    keeps anyway), not ``swiglu(z)``: the activation is replayed in backward."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, weight: Tensor, counts: list[int], grouped: bool) -> Tensor:
        ctx.counts, ctx.grouped = counts, grouped
        ctx.save_for_backward(z, weight)
        return _grouped_forward(SWIGLU.forward(z), weight, counts, grouped)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None, None, None]:
        z, weight = ctx.saved_tensors
        act = SWIGLU.forward(z) if ctx.needs_input_grad[1] else None
        grad_act, grad_w = _grouped_backward(grad, act, weight, ctx.counts, ctx.grouped)
        return SWIGLU.backward(grad_act, z), grad_w, None, None


def grouped_linear(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """Per-group linear: ``x`` ``[N, k]`` in ``len(counts)`` consecutive row groups,
    ``weight`` ``[E_local, n, k]`` -> ``[N, n]``; grouped GEMM or a loop (module docstring)."""
    grouped = grouped_available(x.dtype, x.shape[1], weight.shape[1])
    return _GroupedLinear.apply(x, weight, counts, grouped)


class Experts(nn.Module):
    """``E_local = E/e`` SwiGLU experts of width ``f`` (``f/t_e`` of it on this rank under
    expert tensor parallelism of size ``t_e``, this rank ``r_e``): rows ``[N, h]`` grouped by
    local expert (``counts`` rows each) -> ``[N, h]`` (partial sums over the ``t_e`` ranks)."""

    def __init__(self, ctx: BuildContext, config: MoEConfig) -> None:
        """This rank's experts of ``config`` as ``ctx``'s layout places them: ``E/e`` of them
        (the EP rank's block), ``f_e/t_e`` wide under expert tensor parallelism."""
        super().__init__()
        state, c = ctx.state, ctx.config
        t_e = state.expert_tensor_parallel_size
        r_e = state.tensor_parallel_rank if t_e > 1 else 0
        num_local = config.num_experts // state.expert_parallel_size
        first_expert = state.expert_parallel_rank * num_local
        tensor_parallel = state.tensor_parallel_size > 1
        h, f = c.hidden_size, config.expert_ffn_size // t_e
        dtype, device = ctx.kwargs.get("dtype"), ctx.kwargs.get("device")
        self.fp8: Recipe | None = None
        """The FP8 recipe of the experts' GEMMs (``None``: the run's precision)."""
        self.group: Group = state.tp_group if t_e > 1 else None
        """The expert tensor parallel group over which the FP8 scales spanning the experts'
        slices are agreed (``None`` at ``t_e = 1``)."""
        self.gate_up = nn.Parameter(torch.empty(num_local, 2 * f, h, dtype=dtype, device=device))
        self.down = nn.Parameter(torch.empty(num_local, h, f, dtype=dtype, device=device))
        for param, std, sliced in (
            (self.gate_up, c.init_std, ExpertSlice(1, 2, t_e, r_e)),  # [gate; up] rows
            (self.down, c.output_init_std, ExpertSlice(2, 1, t_e, r_e)),  # columns
        ):
            mark_parameter(param, std=std, sequence_parallel=tensor_parallel and t_e == 1)
            param.expert = True  # type: ignore[attr-defined]
            param.expert_start = first_expert  # type: ignore[attr-defined]
            param.expert_slice = sliced  # type: ignore[attr-defined]

    def forward(self, rows: Tensor, counts: list[int], recompute_act: bool = False) -> Tensor:
        """``recompute_act`` (the ``mlp_act`` recompute module): the down projection saves
        SwiGLU's input, replaying the activation in backward."""
        if self.fp8 is not None:
            return self._fp8_forward(rows, counts, recompute_act)
        z = grouped_linear(rows, self.gate_up, counts)  # [N, 2f]: [gate | up] per row
        if recompute_act and torch.is_grad_enabled():
            grouped = grouped_available(z.dtype, z.shape[1] // 2, self.down.shape[1])
            return _GroupedActLinear.apply(z, self.down, counts, grouped)  # [N, h]
        return grouped_linear(activate(z, SWIGLU), self.down, counts)  # [N, f] -> [N, h]

    def _fp8_forward(self, rows: Tensor, counts: list[int], recompute_act: bool) -> Tensor:
        """:meth:`forward` with each expert's three linears in float8 (:attr:`fp8`)."""
        recipe, group = self.fp8, self.group
        assert recipe is not None
        z = fp8_grouped_linear(rows, self.gate_up, counts, recipe, group, "column", splits=2)
        if recompute_act and torch.is_grad_enabled():  # [N, 2f]: saved, SwiGLU replayed
            return fp8_grouped_linear(z, self.down, counts, recipe, group, "row", producer=SWIGLU)
        act = activate(z, SWIGLU)  # [N, f]
        return fp8_grouped_linear(act, self.down, counts, recipe, group, "row")  # [N, h]
