"""The machine under the timings: how much of it others used, and how malloc behaves.

Timings on a shared two-core machine are only meaningful when nothing else runs. Around every
timed interval the ranks record the machine's busy CPU time (``/proc/stat``, including time the
hypervisor gave to other guests) and their own CPU time (``time.process_time``, all threads of
the process, gloo's included); the difference is what others took. Intervals where that
exceeds :data:`CLEAN_SHARE` of the machine are not used for the medians (they stay in the
JSON with their share).
"""

from __future__ import annotations

import ctypes
import os
import time

import torch
import torch.distributed as dist

CLEAN_SHARE = 0.10
"""An interval is clean if other processes used less than this share of all cores."""


def machine_busy_seconds() -> float:
    """CPU seconds the machine's CPUs have been busy or, on a virtual machine, taken away by
    the hypervisor ("steal"), since boot (0 where unknown)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def sample() -> tuple[float, float, float]:
    """``(wall clock, machine busy seconds, this process's CPU seconds)``, now."""
    return time.perf_counter(), machine_busy_seconds(), time.process_time()


def foreign_share(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Share of all cores that other processes used between two :func:`sample` calls taken on
    every rank of the default process group at (nearly) the same moments.

    Collective: every rank must call it. The machine's busy time is rank 0's reading; our own
    CPU time is summed over the ranks (all on this machine).
    """
    wall = after[0] - before[0]
    busy = after[1] - before[1]
    own = after[2] - before[2]
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    values = torch.tensor([busy if rank0 else 0.0, own, wall], dtype=torch.float64)
    if dist.is_initialized():  # NCCL reduces no CPU tensor: the current CUDA device's copy
        values = values.cuda() if dist.get_backend() == "nccl" else values
        dist.all_reduce(values)
        values = values.cpu()
        values[2] /= dist.get_world_size()
    busy_all, own_all, wall_mean = values.tolist()
    cores = os.cpu_count() or 1
    return max(0.0, busy_all - own_all) / max(wall_mean * cores, 1e-9)


def proc_line(path: str, prefix: str) -> str:
    """The rest of the first line of ``path`` that starts with ``prefix`` ("" if none)."""
    try:
        with open(path) as fh:
            return next((line[len(prefix) :] for line in fh if line.startswith(prefix)), "")
    except OSError:
        return ""


def rss_kib(field: str) -> int:
    """This process's ``/proc/self/status`` ``field`` in KiB: ``VmRSS`` (the resident set
    now), ``VmHWM`` (its peak); 0 where unknown."""
    return int((proc_line("/proc/self/status", field + ":").split() or ["0"])[0])


# -- glibc malloc ------------------------------------------------------------------------------

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc ``mallopt`` parameters. Setting either also stops glibc from adjusting them."""


def _mallopt(param: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(param, value))
    except (OSError, AttributeError):  # not glibc
        return False


def malloc_mmap_from(threshold: int) -> bool:
    """Serve every allocation of ``threshold`` bytes or more by ``mmap`` and return it to the
    system when freed, so that RSS follows the live tensors rather than the heap's high-water
    mark. False where this is not glibc."""
    return _mallopt(M_MMAP_THRESHOLD, threshold)


def malloc_keep_memory() -> bool:
    """Serve allocations up to glibc's limit (32 MiB) from the heap and never trim it, so that
    memory freed by one iteration is reused by the next without page faults, as a GPU caching
    allocator does. False where this is not glibc."""
    return _mallopt(M_MMAP_THRESHOLD, 32 * 2**20) and _mallopt(M_TRIM_THRESHOLD, 2**30)
