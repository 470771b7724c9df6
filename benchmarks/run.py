"""The one command: ``python -m benchmarks.run [--smoke] [--out DIR] [--only A,B]``.

Runs, in this order, (1) activation bytes per layer (:mod:`benchmarks.activation_bytes`),
(2) time per layer (:mod:`benchmarks.layer_time`), (3) FLOPs (:mod:`benchmarks.flops`) and
(4) training throughput under Lightning (:mod:`benchmarks.throughput`). Each section writes
``SECTION.json`` (everything measured, with the run's ``meta``: command, machine, load) and
``SECTION.md`` (one table) into ``--out`` (default ``benchmarks/results``;
``benchmarks/results/smoke`` with ``--smoke``). What the numbers mean, and where we win and
lose, is ``docs/benchmarks.md``.

``--smoke``: tiny shapes, one repeat, seconds (what ``tests/test_benchmarks.py`` runs); its
numbers mean nothing. The full run takes about ten minutes on two idle cores. Timings need an
idle machine: every timed interval records how much of the CPUs other processes took, medians
use the clean intervals, and ``meta`` records the load (``--wait-idle`` waits for quiet first).

Multi-rank measurements run in forked gloo ranks, one intra-op thread each; this process only
orchestrates and never runs a multi-threaded kernel itself (fork safety).
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning
import torch

from benchmarks import _cpu, _format, activation_bytes, flops, layer_time, throughput

SECTIONS = {"activation_bytes": activation_bytes, "layer_time": layer_time, "flops": flops,
            "throughput": throughput}  # fmt: skip
"""The sections, in the order they run: each module's ``run`` measures, its ``markdown`` is the
table."""


def _machine() -> dict[str, Any]:
    """The CPU's name, its cores, the memory, the platform and the load average now."""
    cpu = _cpu.proc_line("/proc/cpuinfo", "model name").partition(":")[2].strip()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory = 0.0
    cpu = cpu or platform.processor() or platform.machine()
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": memory,
            "platform": platform.platform(), "loadavg_start": _format.loadavg()}  # fmt: skip


def _cpu_seconds() -> tuple[float, float]:
    """``(busy CPU seconds of the whole machine, CPU seconds of this process and its reaped
    children)`` so far; their difference over a section is what other processes used."""
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return _cpu.machine_busy_seconds(), sum(u.ru_utime + u.ru_stime for u in usages)


def wait_until_idle(max_seconds: float, window: float = 5.0) -> float:
    """Wait (at most ``max_seconds``) for a ``window`` of seconds during which other processes
    use less than :data:`benchmarks._cpu.CLEAN_SHARE` of the machine; returns the seconds
    waited."""
    start = time.time()
    cores = os.cpu_count() or 1
    while time.time() - start < max_seconds:
        before = _cpu.machine_busy_seconds()
        time.sleep(window)
        if (_cpu.machine_busy_seconds() - before) / (window * cores) < _cpu.CLEAN_SHARE:
            break
    return time.time() - start


def _run_sections(
    only: list[str], smoke: bool, cache: str
) -> tuple[dict[str, Any], dict[str, float], dict[str, float]]:
    """Run the selected sections in order: ``(results, seconds, other processes' CPU share)``
    per section."""
    layer = layer_time.SMOKE if smoke else layer_time.FULL
    model = throughput.SMOKE if smoke else throughput.FULL
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "activation_bytes": lambda: activation_bytes.run(
            activation_bytes.SMOKE if smoke else activation_bytes.FULL
        ),
        "layer_time": lambda: layer_time.run(layer),
        "flops": lambda: flops.run(layer, model),
        "throughput": lambda: throughput.run(model, cache, peak_rounds=1 if smoke else 4),
    }
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    foreign_share: dict[str, float] = {}
    for name in [name for name in SECTIONS if name in only]:
        print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
        t0 = time.time()
        busy0, own0 = _cpu_seconds()
        results[name] = jobs[name]()
        busy1, own1 = _cpu_seconds()
        seconds[name] = time.time() - t0
        foreign = max(0.0, (busy1 - busy0) - (own1 - own0))
        foreign_share[name] = foreign / (seconds[name] * (os.cpu_count() or 1))
        print(f"[benchmarks] {name} done in {seconds[name]:.1f} s", file=sys.stderr, flush=True)
    return results, seconds, foreign_share


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmarks and write ``SECTION.json`` + ``SECTION.md`` per section; returns
    ``{"meta": ..., SECTION: result, ...}``."""
    parser = _format.parser(__doc__, "tiny shapes, 1 repeat (seconds)")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                        help="first wait up to SECONDS for the machine to be idle")  # fmt: skip
    _format.add_only(parser, list(SECTIONS), list(SECTIONS))
    args = parser.parse_args(argv)
    only = args.only
    warnings.filterwarnings("ignore")
    waited = wait_until_idle(args.wait_idle) if args.wait_idle > 0 else 0.0
    started = time.time()
    machine = _machine()
    with tempfile.TemporaryDirectory(prefix="benchmarks-data-") as cache:  # tokenized corpus
        results, section_seconds, foreign_share = _run_sections(only, args.smoke, cache)
    meta = {
        "command": _format.command("benchmarks.run", argv),
        "smoke": args.smoke,
        "started": datetime.datetime.fromtimestamp(started)
        .astimezone()
        .isoformat(timespec="seconds"),
        "seconds": time.time() - started,
        "waited_for_idle_seconds": waited,
        "section_seconds": section_seconds,
        "other_processes_cpu_share": foreign_share,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "machine": {**machine, "loadavg_end": _format.loadavg()},
    }
    out = _format.out_dir(args.out, args.smoke)
    for name, result in results.items():
        _format.write(out, name, {"meta": meta, **result}, SECTIONS[name].markdown(result))
    print(f"[benchmarks] wrote {', '.join(results)} (.json, .md) to {out}", file=sys.stderr)
    return {"meta": meta, **results}


if __name__ == "__main__":
    main()
