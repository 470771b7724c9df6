"""Medians with bootstrap confidence intervals (seeded, so a report is reproducible from its
samples)."""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import _cpu

RESAMPLES = 2000
LEVEL = 0.95


def _interval(estimates: list[float], level: float) -> tuple[float, float]:
    estimates.sort()
    tail = (1.0 - level) / 2.0
    lo = estimates[int(tail * (len(estimates) - 1))]
    hi = estimates[int((1.0 - tail) * (len(estimates) - 1))]
    return lo, hi


def median_ci(
    values: Sequence[float], level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
    """``(median, low, high)``: the median of ``values`` and a percentile-bootstrap confidence
    interval for it."""
    rng = random.Random(seed)
    n = len(values)
    estimates = [statistics.median(rng.choices(values, k=n)) for _ in range(RESAMPLES)]
    return (statistics.median(values), *_interval(estimates, level))


def ratio_of_medians_ci(
    numerator: Sequence[float], denominator: Sequence[float], level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
    """``(ratio, low, high)``: ``median(numerator) / median(denominator)`` for two independent
    samples, with a percentile-bootstrap confidence interval (each sample resampled)."""
    rng = random.Random(seed)
    estimates = [
        statistics.median(rng.choices(numerator, k=len(numerator)))
        / statistics.median(rng.choices(denominator, k=len(denominator)))
        for _ in range(RESAMPLES)
    ]
    ratio = statistics.median(numerator) / statistics.median(denominator)
    return (ratio, *_interval(estimates, level))


def interleaved(
    steps: Mapping[str, Callable[[], object]], warmup: int, rounds: int,
    sync: Callable[[], None] = lambda: None, *, slowest_rank: bool = False, rotate: bool = False,
    shares: list[float] | None = None,
) -> dict[str, list[float]]:  # fmt: skip
    """Seconds of each step per round: ``warmup`` untimed rounds, then ``rounds`` rounds each
    running every step once in order (``rotate``: the order rotated by one step each round),
    each timed between two ``sync()`` calls (so that a drift of the machine's speed hits every
    step of a round alike). ``slowest_rank`` (collective: every rank of the default process
    group calls it): each step starts after a barrier and counts the slowest rank's seconds.
    ``shares``: appended, per timed round, the share of the CPUs other processes took
    (:func:`benchmarks._cpu.foreign_share`, collective where a process group is up)."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(warmup + rounds):
        before = _cpu.sample()
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            if slowest_rank:
                dist.barrier()
            sync()
            start = time.perf_counter()
            steps[name]()
            sync()
            elapsed = time.perf_counter() - start
            if slowest_rank:
                elapsed_max = torch.tensor([elapsed], dtype=torch.float64)
                dist.all_reduce(elapsed_max, op=dist.ReduceOp.MAX)
                elapsed = elapsed_max.item()
            if r >= warmup:
                seconds[name].append(elapsed)
        if shares is not None and r >= warmup:
            shares.append(_cpu.foreign_share(before, _cpu.sample()))
    return seconds


def ratio_ci(
    numerator: Sequence[float], denominator: Sequence[float]
) -> tuple[float, float, float]:
    """:func:`median_ci` of the per-round ratios ``numerator[i] / denominator[i]``."""
    return median_ci([n / d for n, d in zip(numerator, denominator, strict=True)])


def clean_rounds(shares: Sequence[float]) -> tuple[list[int], dict[str, Any]]:
    """The rounds the medians use: those in which other processes took under
    :data:`benchmarks._cpu.CLEAN_SHARE` of the machine (``shares``, per round) when at least
    half are, else all; and what a result records of them (``rounds_used``, ``clean``: whether
    those are the clean ones, ``other_processes_share``)."""
    clean = [i for i, share in enumerate(shares) if share < _cpu.CLEAN_SHARE]
    used = clean if 2 * len(clean) >= len(shares) else list(range(len(shares)))
    summary = {"rounds_used": len(used), "clean": len(used) == len(clean),
               "other_processes_share": list(shares)}  # fmt: skip
    return used, summary


def medians(
    seconds: Mapping[str, Sequence[float]], used: Sequence[int], scale: float = 1.0
) -> dict[str, float]:
    """Each sample's median over the rounds ``used``, times ``scale``."""
    return {n: scale * statistics.median([v[i] for i in used]) for n, v in seconds.items()}


def ratios_over(
    seconds: Mapping[str, Sequence[float]], ours: str, others: Sequence[str], used: Sequence[int]
) -> dict[str, list[float]]:
    """``OURS_over_OTHER``: :func:`median_ci` of the per-round ratios ``ours / other`` over the
    rounds ``used``."""
    mine = seconds[ours]
    return {
        f"{ours}_over_{other}": list(median_ci([mine[i] / seconds[other][i] for i in used]))
        for other in others
    }


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work (``torch.cuda.synchronize``; nothing on a CPU)."""
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None
