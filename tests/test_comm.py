"""Each communication op's backward is the adjoint of its forward, over real gloo ranks.

Inner products over a replicated tensor count it once; over a per-rank tensor they sum the
ranks. For a correct op pair, <op(x), y> == <x, op_backward(y)> with that measure; a swapped or
missing collective breaks the identity.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_sp.parallel import comm
from lightning_sp.testing.spawn import run_distributed

# op, input kind, output kind: "R" replicated over the group, "D" distinct per rank
OPS = [
    ("f_bar", "D", "R"),
    ("g_bar", "D", "D"),
    ("scatter_to_sequence_parallel", "R", "D"),
    ("gather_from_sequence_parallel", "D", "R"),
]


def _random(shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + (0 if kind == "R" else 1000 * dist.get_rank()))
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _inner(a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
    value = (a * b).sum()
    if kind == "D":
        dist.all_reduce(value)
    return value


def _adjoint_worker(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    s = 4 * world_size
    for name, in_kind, out_kind in OPS:
        op = getattr(comm, name)
        in_rows = s // world_size if name == "gather_from_sequence_parallel" else s
        x = _random((in_rows, 3, 5), in_kind, 1).requires_grad_()
        x_before = x.detach().clone()
        out = op(x, group)
        y = _random(tuple(out.shape), out_kind, 2)
        out.backward(y)
        lhs, rhs = _inner(out.detach(), y, out_kind), _inner(x.detach(), x.grad, in_kind)
        torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=0, msg=f"{name} is not adjoint")
        assert torch.equal(x.detach(), x_before), f"{name} modified its input in place"
        expected_rows = {
            "f_bar": s, "g_bar": s // world_size,
            "scatter_to_sequence_parallel": s // world_size, "gather_from_sequence_parallel": s,
        }[name]  # fmt: skip
        assert out.shape[0] == expected_rows, (name, out.shape)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ops_are_adjoint(world_size: int) -> None:
    run_distributed(_adjoint_worker, world_size)


def test_ops_are_identity_without_a_group() -> None:
    x = torch.randn(4, 2, requires_grad=True)
    for name, _, _ in OPS:
        assert getattr(comm, name)(x, None) is x
