"""Ending gloo's process groups before the interpreter finalizes.

A ``ProcessGroupGloo`` runs its collectives on worker threads (``pt_gloo_runloop``). A worker
drops its reference to a finished collective's work (and so to the tensors it carried) a
moment *after* the caller's ``wait()`` returned; when that is the last reference to a tensor
Python created, the worker takes the GIL to free the Python object. Once the interpreter has
begun finalizing, taking the GIL ends the calling thread (``pthread_exit``), whose forced
unwind through a C++ ``noexcept`` frame calls ``std::terminate``: the process prints
"terminate called without an active exception" and dies of SIGABRT, with no Python frame
(the stack, caught with a terminate handler: ``ProcessGroupGloo::runLoop`` ->
``TensorImpl::decref_pyobject`` -> ``PyEval_AcquireThread`` -> ``pthread_exit``). It needs a
worker still holding a work when the interpreter finalizes: a collective in flight at exit
(a rank stopped by a signal or an error), or a worker descheduled between a collective's end
and its release on a busy machine (1 run in 12 of a 4-rank test on 2 busy cores).

:func:`release_process_groups` ends them properly while the interpreter is alive: it
destroys the process groups and collects the garbage that still holds them, so each
``ProcessGroupGloo`` destructor runs now, waits for its workers' last works and joins them.
Where that cannot finish (a collective waiting for a peer that never comes, a group some
object still holds), it says so, and the caller leaves without the interpreter's finalization.

One such holder is ``torch.distributed.nn.functional``: its functions' default argument
``group=group.WORLD`` is evaluated on import, so a first import after ``init_process_group``
keeps the default group alive for good. This module imports it, so that whoever imports this
module before starting a group (the package's launch paths do) holds no group that way.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from typing import NoReturn

import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (imported before any group exists: see below)

WORKER_THREAD = "pt_gloo_runloop"
"""The name gloo's process groups give their worker threads (what Linux lists in
``/proc/self/task/*/comm``)."""

RELEASE_SECONDS = 3.0
"""How long :func:`release_process_groups` waits for the workers' last collectives: a
finished run's are done at once; a stopped run's fail within a second once the stopped peers
are gone."""

SETTLE_SECONDS = 1.0
"""How long, once the release itself has finished, :func:`release_process_groups` polls for
gloo workers still listed: a joined worker the kernel lists until it has finished exiting. A
group that is really held keeps its workers: this only bounds how long that takes to say."""

COLLECTIONS = 3
"""How many garbage collections :func:`release_process_groups` runs at most while gloo workers
are still listed after the destroy (one frees the cycles; a finalizer it runs can release the
last holder of a group, which the next frees)."""


def gloo_workers() -> int:
    """How many gloo worker threads run in this process (Linux; 0 where ``/proc`` is not)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as f:
                count += f.read().strip() == WORKER_THREAD
        except OSError:  # the thread ended meanwhile
            continue
    return count


def release_process_groups(seconds: float = RELEASE_SECONDS) -> bool:
    """Destroy this process's process groups and free them now, while the interpreter is
    alive: each gloo group's destructor waits for its workers' last works and joins them (see
    the module docstring). True when no gloo worker thread is left; False when one is (a
    collective still waits for a peer, or an object still holds a group, ``seconds`` after the
    release last made progress, after up to :data:`COLLECTIONS` collections and
    :data:`SETTLE_SECONDS` of polling): then the caller must leave without the interpreter's
    finalization (``os._exit`` after flushing), the one way out that cannot abort.

    The garbage is collected only while a worker outlives the destroy (a group held by a cycle),
    and a collection still running (it spends CPU; seconds on a large heap and a busy machine)
    is waited for: only a release that is blocked runs out of time."""
    done = threading.Event()

    def release() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for _ in range(COLLECTIONS):  # while a worker outlives the destroy
            if not gloo_workers():
                break
            gc.collect()  # groups held by garbage cycles (a model's state, its autograd graph)
        done.set()

    # a worker blocked in a collective blocks its group's destructor: wait for it apart
    thread = threading.Thread(target=release, name="lightning-sp-release", daemon=True)
    thread.start()
    released = _wait_while_working(done, thread, seconds)
    return released and _workers_gone(min(seconds, SETTLE_SECONDS))


def _workers_gone(seconds: float) -> bool:
    """Whether every gloo worker is gone: at once (the usual case), or within ``seconds`` of
    polling (see :data:`SETTLE_SECONDS`)."""
    deadline = time.monotonic() + seconds
    while gloo_workers():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)  # a poll of the workers' exit, bounded by the deadline
    return True


def _wait_while_working(done: threading.Event, thread: threading.Thread, seconds: float) -> bool:
    """Wait for ``done``: for ``seconds``, and again while ``thread`` spent CPU time over the
    last wait (it is working, not blocked); at most 20 waits."""
    spent = _cpu_ticks(thread)
    for _ in range(20):
        if done.wait(seconds):
            return True
        now = _cpu_ticks(thread)
        if spent is None or now is None or now <= spent:
            return False
        spent = now
    return done.is_set()


def _cpu_ticks(thread: threading.Thread) -> int | None:
    """The CPU time ``thread`` has spent (clock ticks, Linux; ``None`` where ``/proc`` is not)."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime + stime: fields 14 and 15 of stat


def leave(code: int) -> NoReturn:
    """Exit with ``code``, this process's process groups ended first
    (:func:`release_process_groups`). Where they cannot be (a collective still waits for a
    peer a stop took away, an object still holds a group), the process leaves without the
    interpreter's finalization (``os._exit`` after flushing), the one exit that cannot abort."""
    groups = (dist.is_available() and dist.is_initialized()) or gloo_workers() > 0
    if groups and not release_process_groups():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


__all__ = [
    "COLLECTIONS",
    "RELEASE_SECONDS",
    "SETTLE_SECONDS",
    "WORKER_THREAD",
    "gloo_workers",
    "leave",
    "release_process_groups",
]
