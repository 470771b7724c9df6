"""Run a function on N gloo ranks in fresh processes and collect what each rank returns; a
rank's exception is re-raised in the parent with the rank named.

The one spawn helper of the repository, imported by the tests and the benchmarks alike
(``from lightning_sp.testing.spawn import run_distributed``). Each rank runs
``cores // world size`` threads unless ``OMP_NUM_THREADS`` says otherwise (the package's rule
for runs). Every process group gets a timeout, and the file
store lives in a fresh temporary directory, so concurrent runs never share a port and a
missing collective fails instead of hanging. A rank ends its process groups before it exits
(:func:`~lightning_sp.parallel.release.release_process_groups`): a group that outlives it fails
the rank, named, instead of aborting it at exit now and then.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_sp.parallel.release import leave, release_process_groups
from lightning_sp.parallel.threads import threads_per_rank
from lightning_sp.testing.holders import group_holders

TIMEOUT = datetime.timedelta(seconds=300)
"""How long any collective of a spawned rank may wait."""

RELEASE_SECONDS = 30.0
"""How long a finished rank waits for its gloo workers to be joined before its group counts as
held (:data:`UNRELEASED`). Every rank has passed a barrier by then, so no collective waits for
a peer and the release only needs the CPU: with 4 ranks on 2 busy cores the package's 3 s
(``lightning_sp.parallel.release.RELEASE_SECONDS``, sized for a stopped run that must leave
promptly) failed ranks that had nothing held."""


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    out_dir: str,
    threads: int | None,
    init_group: bool,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    held_groups: bool = False,
    environ: dict[str, str] | None = None,
) -> None:
    if environ is not None:  # a forkserver's child: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(environ)
    # the cores shared out among the ranks, as in runs, unless the caller says how many
    torch.set_num_threads(threads if threads is not None else threads_per_rank(world_size))
    if init_group:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=TIMEOUT,
        )
    try:
        result: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
        if dist.is_initialized():
            # every rank has finished its collectives before any tears down: a rank destroying
            # its gloo group while a peer's last collective is in flight can abort the peer
            dist.barrier()
    except BaseException:
        result = ("error", traceback.format_exc())
    # the groups destroyed and freed now, gloo's workers joined after their last works: not
    # during the interpreter's finalization, where a worker freeing a tensor aborts the
    # process (lightning_sp.parallel.release)
    released = release_process_groups(RELEASE_SECONDS)
    if not released and result[0] == "ok" and not held_groups:  # the product's exit too
        holders = group_holders()
        named = "; ".join(holders) if holders else NO_HOLDER
        result = ("error", f"rank {rank}: {UNRELEASED}; held by: {named}")
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    code = 0 if result[0] == "ok" else 1
    if not released:  # leave() would try the same release again before this exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    leave(code)  # the package's own way out


UNRELEASED = (
    "a process group outlived destroy_process_group (gloo worker threads still run after its "
    "release: an object holds the group, or a collective still waits for a peer); such a rank "
    "can abort at exit with 'terminate called without an active exception'"
)

NO_HOLDER = "no Python object (a C++ holder: torch's own caches, or a collective still waiting)"
"""What the message says when no object the garbage collector sees refers to a group
(:func:`~lightning_sp.testing.holders.group_holders`)."""


PRELOAD = ("torch", "torch.distributed", "lightning", "lightning_sp", "lightning_sp.training",
           "lightning_sp.checkpoint", "lightning_sp.testing.spawn")  # fmt: skip
"""What the ``forkserver`` server imports once for every rank it forks (each spawned rank
imported them itself: about 2 s for the package and 3 s more for Lightning, a rank)."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads: int | None = None,
    init_group: bool = True,
    start_method: str = "forkserver",
    held_groups: bool = False,
) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each rank in a fresh process.

    ``fn`` must be a module-level function (it is pickled into the children) and return
    something picklable. ``threads``: intra-op threads per rank (default:
    :func:`~lightning_sp.parallel.threads.threads_per_rank`, ``OMP_NUM_THREADS`` or
    cores // ``world_size``). ``init_group``: start the
    default gloo process group (with :data:`TIMEOUT`) before ``fn``; without it ``fn`` starts
    its own (as Lightning's strategies do). ``start_method``: ``spawn`` starts clean
    interpreters, each paying the imports (seconds per rank); ``forkserver`` (default) forks
    each rank from one server process of the session that has only imported
    :data:`PRELOAD` and never run a kernel (so forking it is safe), each rank taking the
    caller's ``os.environ`` of the moment as a spawned one does; ``fork`` reuses the parent's
    imports and is safe only while the parent has run no multi-threaded kernels.
    ``held_groups``: a rank whose process group outlives its release (:data:`UNRELEASED`)
    still succeeds, leaving without the interpreter's finalization (the package's own exit
    does the same, safely); for
    ``fn`` that hold a group through torch's own caches, out of the garbage collector's reach
    (torch 2.13): DTensor's ``redistribute`` once ``torch._dynamo`` is loaded, and layers
    compiled by ``torch.compile`` around collectives (neither ``torch._dynamo.reset()`` nor
    emptying DTensor's caches frees it). Every other caller keeps the check.
    """
    lazy = os.environ.get("LIGHTNING_SP_LAZY")
    # the ranks import Lightning only if the test module uses its names (5 s a rank here)
    os.environ["LIGHTNING_SP_LAZY"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        environ = None
        if start_method == "forkserver":
            # read once, when the session's server starts; a no-op once it runs
            multiprocessing.set_forkserver_preload(list(PRELOAD))
            environ = dict(os.environ)
        try:
            mp.start_processes(
                _worker,
                args=(world_size, store, tmp, threads, init_group, fn, args, held_groups, environ),
                nprocs=world_size,
                join=True,
                start_method=start_method,
            )
        except mp.ProcessRaisedException:
            pass  # the per-rank result files say which rank failed and why
        except mp.ProcessExitedException as exc:
            if not _reported_failure(tmp, world_size):  # else the result files say why
                raise AssertionError(f"a rank died: {exc}") from None
        finally:
            if lazy is None:
                del os.environ["LIGHTNING_SP_LAZY"]
            else:
                os.environ["LIGHTNING_SP_LAZY"] = lazy
        results: list[Any] = []
        failures: list[str] = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                failures.append(f"--- rank {rank} --- no result")
                continue
            with open(path, "rb") as fh:
                status, value = pickle.load(fh)
            if status == "error":
                failures.append(f"--- rank {rank} ---\n{value}")
            results.append(value)
        if failures:
            raise AssertionError("a rank failed:\n" + "\n".join(failures))
        return results


def _reported_failure(folder: str, world_size: int) -> bool:
    """Whether some rank wrote an error result into ``folder`` (it then left with a non-zero
    code of its own)."""
    for rank in range(world_size):
        path = os.path.join(folder, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as fh:
                if pickle.load(fh)[0] == "error":
                    return True
    return False
