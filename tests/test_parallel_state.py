"""ParallelState on real gloo ranks: mesh coordinates, group membership, timeouts, RNG streams."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from lightning_sp import ParallelState
from lightning_sp.parallel.buffer import GradBuffer
from lightning_sp.parallel.random import RNGStreams
from lightning_sp.testing.spawn import run_distributed


def _layout_worker(rank: int, world_size: int) -> None:
    state = ParallelState.from_process_group(tensor_parallel_size=2, pipeline_parallel_size=1)
    assert (state.tensor_parallel_size, state.data_parallel_size) == (2, world_size // 2)
    # TP ranks are adjacent: global rank = dp * t + tp
    assert rank == state.data_parallel_rank * 2 + state.tensor_parallel_rank
    assert dist.get_process_group_ranks(state.tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    if world_size > 2:
        assert dist.get_process_group_ranks(state.dp_group) == list(range(rank % 2, world_size, 2))
    assert state.pp_group is None and state.is_first_stage and state.is_last_stage

    # dropout streams: replicated agrees within a TP group, sharded differs; both differ over DP
    def draws(generator: torch.Generator) -> list[torch.Tensor]:
        mine = torch.rand(8, generator=generator)
        out = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(out, mine)
        return out

    rng = RNGStreams(seed=3, state=state)
    replicated, sharded = draws(rng.replicated), draws(rng.sharded)
    peer = rank ^ 1  # the other rank of my TP group
    assert torch.equal(replicated[rank], replicated[peer])
    assert not torch.equal(sharded[rank], sharded[peer])
    if world_size > 2:
        other_replica = (rank + 2) % world_size
        assert not torch.equal(replicated[rank], replicated[other_replica])

    # context parallelism (t = 1, c = 2): the gradient group is every rank of equal (pp, tp),
    # dp-major, and a distributed buffer's shards over it are disjoint and cover every element
    cp = ParallelState.from_process_group(context_parallel_size=2)
    group = cp.gradient_group
    assert dist.get_process_group_ranks(group) == list(range(world_size))
    assert cp.gradient_shards == world_size and dist.get_rank(group) == cp.gradient_shard_rank
    assert cp.gradient_shard_rank == cp.data_parallel_rank * 2 + cp.context_parallel_rank
    weight = torch.nn.Parameter(torch.zeros(7))
    owned = GradBuffer([weight], cp, distributed=True).owned().get(id(weight))
    start, end = owned[:2] if owned else (0, 0)
    ranges = [None] * world_size
    dist.all_gather_object(ranges, (start, end))
    covered = sorted(i for lo, hi in ranges for i in range(lo, hi))
    assert covered == list(range(7)), ranges


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mesh_layout_and_rng_streams(world_size: int) -> None:
    run_distributed(_layout_worker, world_size)


def _timeout_worker(rank: int, world_size: int) -> None:
    state = ParallelState.from_process_group(
        tensor_parallel_size=2, timeout=datetime.timedelta(seconds=2)
    )
    if rank == 0:  # rank 1 never joins this all-reduce: it must fail, not hang
        with pytest.raises(RuntimeError, match=r"(?i)timed out"):
            dist.all_reduce(torch.ones(1), group=state.tp_group)
    else:
        time.sleep(6)


@pytest.mark.slow
def test_group_collective_times_out_instead_of_hanging() -> None:
    run_distributed(_timeout_worker, 2)


def test_single_process_state_needs_no_process_group() -> None:
    state = ParallelState.single()
    assert state.world_size == 1 and state.tp_group is None


def test_from_process_group_requires_initialised_distributed() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ParallelState.from_process_group(tensor_parallel_size=1)
