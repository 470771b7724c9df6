"""Run a function on N gloo ranks in fresh processes; re-raise any rank's failure in the parent.

Every process group gets a timeout, and the file store lives in a fresh temporary directory, so
parallel test runs never share a port and a missing collective fails instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)


def _worker(
    rank: int, world_size: int, store_path: str, fn: Callable[..., Any], args: tuple, errors: Any
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=TIMEOUT,
    )
    try:
        fn(rank, world_size, *args)
        # every rank has finished its collectives before any tears down: a rank destroying its
        # gloo group while a peer's last collective is in flight can abort the peer
        dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    ``fn`` must be a module-level function (it is pickled into the children).
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        try:
            mp.start_processes(
                _worker,
                args=(world_size, store, fn, args, errors),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as exc:
            failures = []
            while not errors.empty():
                failures.append(errors.get())
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures))
            raise AssertionError(f"a rank failed:\n{detail or exc}") from None
