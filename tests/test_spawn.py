"""The spawn helper (:mod:`lightning_sp.testing.spawn`): every rank's result comes back in rank
order, and a rank's exception is re-raised in the parent with the rank and its traceback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_sp.testing.spawn import run_distributed


def _sum_of_ranks(rank: int, world_size: int, fail_on: int | None) -> tuple[int, float]:
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    if rank == fail_on:
        raise ValueError(f"planted failure on rank {rank}")
    return rank, x.item()


def test_results_in_rank_order_and_a_failing_rank_named() -> None:
    assert run_distributed(_sum_of_ranks, 2, None) == [(0, 1.0), (1, 1.0)]
    with pytest.raises(AssertionError, match=r"(?s)--- rank 1 ---.*planted failure on rank 1"):
        run_distributed(_sum_of_ranks, 2, 1)
