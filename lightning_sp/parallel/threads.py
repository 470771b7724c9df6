"""CPU threads per rank: the cores shared out among the ranks of one host.

Every rank of a host otherwise starts torch with one intra-op thread per core, so ``n`` local
ranks run ``n`` times as many threads as there are cores and thrash (a 4-rank pipeline test
timed out on a 16-core host that way). The rule: ``OMP_NUM_THREADS`` when it is set, else
``cores // local ranks`` (at least 1), where the cores are those this process may run on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from lightning_sp.errors import ConfigError


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(
    local_ranks: int, cores: int | None = None, environ: Mapping[str, str] | None = None
) -> int:
    """Intra-op threads for one of ``local_ranks`` ranks on a host with ``cores`` cores.

    ``OMP_NUM_THREADS`` in ``environ`` (default ``os.environ``) wins and must be a positive
    integer; otherwise ``max(1, cores // local_ranks)``.
    """
    environ = os.environ if environ is None else environ
    given = environ.get("OMP_NUM_THREADS")
    if given is not None:
        if not given.strip().isdigit() or int(given) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={given!r} must be a positive integer or unset")
        return int(given)
    if local_ranks < 1:
        raise ValueError(f"local_ranks={local_ranks} must be >= 1")
    return max(1, (available_cores() if cores is None else cores) // local_ranks)


def set_rank_threads(local_ranks: int) -> int:
    """Apply :func:`threads_per_rank` to this process (``torch.set_num_threads``); return it."""
    threads = threads_per_rank(local_ranks)
    torch.set_num_threads(threads)
    return threads
