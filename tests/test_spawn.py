"""The spawn helper (:mod:`lightning_sp.testing.spawn`): every rank's result comes back in rank
order, and a rank's exception is re-raised in the parent with the rank and its traceback."""

from __future__ import annotations

import gc

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


_HELD: list[object] = []


class _Cycle:
    """Garbage only the collector frees (it refers to itself), holding the default group."""

    def __init__(self) -> None:
        self.me = self
        self.group = dist.group.WORLD


def _group_in_a_cycle(rank: int, world_size: int) -> int:
    gc.disable()  # left to the release alone to collect
    _Cycle()
    return rank


def _holds_the_group(rank: int, world_size: int) -> int:
    _HELD.append(dist.group.WORLD)  # a module-level holder: the group outlives its release
    return rank


def test_every_rank_ends_its_groups_before_it_exits() -> None:
    """Issue 40, item 6: a rank left its gloo groups to the interpreter's finalization, where a
    worker thread freeing a finished collective's tensor aborts the process ("terminate called
    without an active exception"; the helper hid it with os._exit). Each rank now ends them
    first (``lightning_sp.parallel.release``): a group held by garbage cycles is freed with
    them; one an object still holds fails the rank, named, instead of aborting it at random."""
    assert run_distributed(_group_in_a_cycle, 2) == [0, 1]
    # whichever rank finds its group held first is reported (the other may be stopped first)
    with pytest.raises(AssertionError, match=r"(?s)--- rank (\d) ---.*rank \1: a process group "
                       r"outlived destroy_process_group") as failed:  # fmt: skip
        run_distributed(_holds_the_group, 2)
    # the message names what holds the group, so an intermittent holder can be found from a log
    assert "held by: a builtins.list in module test_spawn, key '_HELD'" in str(failed.value), str(
        failed.value
    )
