"""Dispatch and combine in one process (no expert parallelism): the combine is each token's
weighted sum of its kept rows, and its hand-written backward is autograd's (gradcheck, float64),
dropless and with dropped assignments."""

from __future__ import annotations

import pytest
import torch

from lightning_sp.parallel.dispatch import combine, dispatch

T, K, E, H = 10, 2, 4, 6


def _routing(drop: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    experts = torch.stack([torch.randperm(E)[:K] for _ in range(T)])  # [T, k]
    weights = torch.rand(T, K, dtype=torch.float64)
    keep = torch.rand(T, K) > 0.4 if drop else None
    if keep is not None:
        keep[0] = False  # a token with every assignment dropped
    return experts, weights, keep


@pytest.mark.parametrize("drop", [False, True])
def test_combine_is_the_weighted_sum_of_kept_rows(drop: bool) -> None:
    experts, weights, keep = _routing(drop)
    x = torch.randn(T, H, dtype=torch.float64)
    scale = torch.randn(E, H, dtype=torch.float64)  # expert j's output: its row times scale[j]
    rows, routing = dispatch(x, experts, keep, E, None)
    assert sum(routing.counts) == (T * K if keep is None else int(keep.sum()))
    y = rows * scale.repeat_interleave(torch.tensor(routing.counts), dim=0)
    out = combine(y, weights, routing, None)
    kept = torch.ones(T, K, dtype=torch.bool) if keep is None else keep
    expected = (kept.unsqueeze(-1) * weights.unsqueeze(-1) * x.unsqueeze(1) * scale[experts]).sum(1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-14)
    if drop:
        assert torch.equal(out[0], torch.zeros(H, dtype=torch.float64))


@pytest.mark.parametrize("drop", [False, True])
def test_combine_backward_passes_gradcheck(drop: bool) -> None:
    experts, weights, keep = _routing(drop)
    x = torch.randn(T, H, dtype=torch.float64)
    rows, routing = dispatch(x, experts, keep, E, None)
    y = torch.randn_like(rows).requires_grad_()
    w = weights.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda y, w: combine(y, w, routing, None), (y, w))
