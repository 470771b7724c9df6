"""Compiled against eager layers on the CPU: the ``compile`` section of
:mod:`benchmarks.fit_overhead` (``python -m benchmarks.fit_overhead --only compile``;
``compile_cpu.md``/``.json``).

One process, ``t = 1``, fp32, forward + backward of the same seeded GPT, each transformer layer
eager or compiled with inductor (:func:`lightning_sp.model.compile.compile_layers`, default
options), per recompute policy and dropout. Rounds are interleaved (eager step, compiled step,
...) after the compiled model's warm-up (its compilation is timed apart); the ratio compiled /
eager is the median over rounds of the per-round ratios with a 95% bootstrap interval
(:mod:`benchmarks._stats`), and other processes' share of the CPUs over the rounds is recorded
(:mod:`benchmarks._cpu`). Below 1: compiling pays.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any

from benchmarks import _cpu
from benchmarks._fit import Shape, batch, train_step
from benchmarks._format import ci, table
from benchmarks._stats import interleaved, ratio_ci
from lightning_sp.model.compile import CompileOptions, compile_layers
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.state import ParallelState


@dataclasses.dataclass(frozen=True)
class CompileShape(Shape):
    """The GPT of the ``compile`` section and its rounds."""

    s: int = 256
    h: int = 256
    layers: int = 4
    heads: int = 8
    vocab: int = 257
    b: int = 4
    policies: tuple[str, ...] = ("none", "selective")
    dropouts: tuple[float, ...] = (0.0,)
    warmup: int = 2
    rounds: int = 12


COMPILE_FULL = CompileShape()
COMPILE_SMOKE = CompileShape(s=32, h=32, layers=1, heads=2, b=2, policies=("none",), warmup=1,
                             rounds=3)  # fmt: skip


def compile_case(shape: CompileShape, recompute: str, dropout: float) -> dict[str, Any]:
    """One (policy, dropout): the compiled model's first step, then interleaved rounds."""
    config = shape.config(recompute, dropout)
    ids, labels = batch(shape.vocab, shape.b, shape.s)
    models = {name: GPT(config, ParallelState.single()) for name in ("eager", "compiled")}
    compile_layers(models["compiled"].layers, CompileOptions())
    first = time.perf_counter()
    train_step(models["compiled"], ids, labels)  # compiles forward and backward
    first = time.perf_counter() - first
    steps = {
        name: functools.partial(train_step, model, ids, labels) for name, model in models.items()
    }
    interleaved(steps, 0, shape.warmup)
    before = _cpu.sample()
    times = interleaved(steps, 0, shape.rounds)
    return {
        "recompute": recompute,
        "dropout": dropout,
        "first_compiled_step_seconds": first,
        "eager_seconds": statistics.median(times["eager"]),
        "compiled_seconds": statistics.median(times["compiled"]),
        "compiled_over_eager": ratio_ci(times["compiled"], times["eager"]),
        "foreign_share": _cpu.foreign_share(before, _cpu.sample()),
    }


def compile_markdown(result: dict[str, Any]) -> str:
    header = ["recompute", "dropout", "compiled / eager (95% CI)", "eager s", "compiled s",
              "first compiled step s", "others' CPU share"]  # fmt: skip
    rows = [
        [
            c["recompute"],
            c["dropout"],
            ci(c["compiled_over_eager"]),
            f"{c['eager_seconds']:.3f}",
            f"{c['compiled_seconds']:.3f}",
            f"{c['first_compiled_step_seconds']:.1f}",
            f"{100 * c['foreign_share']:.0f}%",
        ]
        for c in result["cases"]
    ]
    s, loadavg = result["meta"]["shape"], result["meta"]["loadavg"]
    return (
        f"Compiled (inductor, per layer) vs eager forward + backward, one CPU process, fp32, "
        f"GPT s={s['s']} h={s['h']} L={s['layers']} a={s['heads']} v={s['vocab']} b={s['b']}, "
        f"{s['rounds']} interleaved rounds; load average at start {loadavg}.\n\n"
        + table(header, rows)
    )
