"""RMSNorm on the queries and keys inside attention, between the QKV projection and RoPE:

* ``head`` (Qwen3): over each head's ``d`` features, one weight ``[d]`` for all query heads and
  one for all key heads. The weights are whole on every TP rank but each rank normalises only
  its heads, so their gradients are partial sums per rank, all-reduced over TP (marked like a
  sequence-parallel norm's). The statistics are fp32 (``x.float()``), as Hugging Face's
  ``Qwen3RMSNorm`` computes them.
* ``projection`` (OLMo 2): over the whole query projection (``a·d`` features per token) and the
  whole key projection (``g·d``), weights ``[a·d]`` and ``[g·d]`` split over TP like the
  projections' rows (key replicas included). The statistics span the sharded dimension: each
  rank sums its squares and the sums are all-reduced over TP (the keys' divided by their
  replicas), in forward and again for the gradient's inner product in backward. They are
  computed in ``promote(dtype, fp32)`` (float64 for a float64 model: the same to 1e-16 under
  any t; Hugging Face's ``Olmo2RMSNorm`` rounds them to fp32).

Layout: the fused QKV output ``[s, b, G, r + 2, d]`` (``G`` key/value groups on this rank,
``r`` query heads per group; slots ``:r`` queries, ``r`` the key, ``r + 1`` the value), in and
out; the value slot is copied. Saves: its input (the QKV linear's output storage,
``e·sb·d·(a + 2g')/t``) and the fp32 (or wider) ``rstd``: per head ``[s, b, G, r + 1, 1]``
(``4·sb·(a + g')/t`` bytes), per projection ``[s, b, 1, 1, 1]`` twice (``8·sb``, on every
rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sp.parallel.init import ShardSpec, mark_parameter
from lightning_sp.parallel.state import ParallelState

QK_NORMS = ("head", "projection")
"""The query/key norms, by ``GPTConfig.qk_norm`` name."""


def _sum(x: Tensor, dims: tuple[int, ...], group: Any, replicas: int) -> Tensor:
    """``Σ x`` over ``dims`` (kept), all-reduced over ``group`` and divided by ``replicas``."""
    total = x.sum(dims, keepdim=True)
    if group is not None:
        dist.all_reduce(total, group=group)
    return total / replicas if replicas > 1 else total


class _QKNorm(torch.autograd.Function):
    """forward:  ``y = w·(x·rstd)`` on the query slots and the key slot of ``qkv``
                 ``[s, b, G, r + 2, d]``, ``rstd = 1/sqrt(mean(x²) + eps)`` over ``d``
                 (``per_head``) or over the rank's slots all-reduced (projection); the value
                 slot copied.
    backward: ``grad_x = rstd·(gw - n·mean(gw·n))``, ``gw = grad·w``, ``n = x·rstd`` (the mean
              all-reduced like the statistics); ``grad_w = Σ grad·n`` over tokens (and
              heads, per head).
    saves:    ``qkv`` and the two ``rstd``."""

    @staticmethod
    def forward(
        ctx: Any, qkv: Tensor, wq: Tensor, wk: Tensor, eps: float, per_head: bool,
        group: Any, sizes: tuple[int, int], replicas: int,
    ) -> Tensor:  # fmt: skip
        r = qkv.shape[3] - 2
        wide = torch.float32 if per_head else torch.promote_types(qkv.dtype, torch.float32)
        ctx.setup = (eps, per_head, group, sizes, replicas, r, wide)
        out = qkv.clone()
        rstds = []
        for slots, weight, size, reps in ((slice(0, r), wq, sizes[0], 1),
                                          (slice(r, r + 1), wk, sizes[1], replicas)):  # fmt: skip
            x = qkv[:, :, :, slots].to(wide)  # [s, b, G, r or 1, d]
            if per_head:
                rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
                w = weight
            else:
                rstd = torch.rsqrt(_sum(x.pow(2), (2, 3, 4), group, reps) / size + eps)
                w = weight.view(x.shape[2:])
            out[:, :, :, slots] = w * (x * rstd).to(qkv.dtype)
            rstds.append(rstd)
        ctx.save_for_backward(qkv, wq, wk, *rstds)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        qkv, wq, wk, rstd_q, rstd_k = ctx.saved_tensors
        _, per_head, group, sizes, replicas, r, wide = ctx.setup
        grad_in = grad.clone()
        grads_w = []
        for slots, weight, rstd, size, reps in (
            (slice(0, r), wq, rstd_q, sizes[0], 1),
            (slice(r, r + 1), wk, rstd_k, sizes[1], replicas),
        ):
            g = grad[:, :, :, slots]
            x = qkv[:, :, :, slots]
            calc = torch.promote_types(x.dtype, torch.float32)
            normed = (x.to(wide) * rstd).to(x.dtype)
            w = weight if per_head else weight.view(x.shape[2:])
            if per_head:
                grad_w = (g * normed).reshape(-1, weight.shape[0]).sum(0)
            else:
                grad_w = (g * normed).sum((0, 1)).reshape(weight.shape)
            gw = (g * w).to(calc)
            n = x.to(calc) * rstd.to(calc)
            if per_head:
                mean = (gw * n).mean(-1, keepdim=True)
            else:
                mean = _sum(gw * n, (2, 3, 4), group, reps) / size
            grad_in[:, :, :, slots] = (rstd.to(calc) * (gw - n * mean)).to(x.dtype)
            grads_w.append(grad_w)
        return grad_in, grads_w[0], grads_w[1], None, None, None, None, None


class QKNorm(nn.Module):
    """The query/key RMSNorm of one attention shard (see the module docstring): ``kind``
    ``head`` or ``projection``; ``forward(qkv [s, b, G, r + 2, d]) -> same``. Parameters
    ``q_norm`` and ``k_norm``."""

    def __init__(
        self,
        kind: str,
        heads: int,
        groups: int,
        head_dim: int,
        eps: float,
        state: ParallelState,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        t, rank = state.tensor_parallel_size, state.tensor_parallel_rank
        self.kind, self.eps = kind, eps
        self.per_head = kind == "head"
        self.replicas = max(t // groups, 1)
        self.group = state.tp_group if t > 1 and not self.per_head else None
        self.sizes = (heads * head_dim, groups * head_dim)
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        if self.per_head:  # whole on every rank; each rank's heads give a partial gradient
            q, k = head_dim, head_dim
            specs = (ShardSpec(), ShardSpec())
        else:  # the projections' rows of this rank
            q = heads * head_dim // t
            k = groups * head_dim * self.replicas // t
            specs = (ShardSpec(0, rank * q), ShardSpec(0, rank // self.replicas * k, self.replicas))
        self.q_norm = nn.Parameter(torch.ones(q, **factory))
        self.k_norm = nn.Parameter(torch.ones(k, **factory))
        for param, spec in zip((self.q_norm, self.k_norm), specs, strict=True):
            mark_parameter(param, shard=spec, init="ones", sequence_parallel=self.per_head)

    def forward(self, qkv: Tensor) -> Tensor:
        return _QKNorm.apply(
            qkv, self.q_norm, self.k_norm, self.eps, self.per_head, self.group, self.sizes,
            self.replicas,
        )  # fmt: skip
