"""The rank-thread rule: ``OMP_NUM_THREADS`` if set, else cores // local ranks."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_sp.errors import ConfigError
from lightning_sp.parallel.threads import available_cores, threads_per_rank
from lightning_sp.testing.spawn import run_distributed


@pytest.mark.parametrize(
    ("local_ranks", "cores", "environ", "expected"),
    [
        (4, 16, {}, 4),  # 16 cores, 4 ranks: 4 each (not 16 each)
        (3, 16, {}, 5),
        (8, 4, {}, 1),  # more ranks than cores: at least one thread
        (1, 16, {}, 16),
        (4, 16, {"OMP_NUM_THREADS": "2"}, 2),  # the environment wins
        (4, 2, {"OMP_NUM_THREADS": "6"}, 6),
    ],
)
def test_threads_per_rank(
    local_ranks: int, cores: int, environ: dict[str, str], expected: int
) -> None:
    assert threads_per_rank(local_ranks, cores, environ) == expected


@pytest.mark.parametrize("value", ["0", "two", "-1", ""])
def test_bad_omp_num_threads_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
        threads_per_rank(2, 16, {"OMP_NUM_THREADS": value})


def _report_threads(rank: int, world_size: int) -> None:
    assert "OMP_NUM_THREADS" not in os.environ
    expected = max(1, available_cores() // world_size)
    assert torch.get_num_threads() == expected, (torch.get_num_threads(), expected)


@pytest.mark.slow
def test_spawned_test_ranks_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without OMP_NUM_THREADS each of the spawn helper's ranks runs cores // ranks threads
    (torch's own default would be every core in every rank)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run_distributed(_report_threads, 2)
