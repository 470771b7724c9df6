"""Compiled against eager layers on the CPU: ``python -m benchmarks.compile_cpu [--smoke]``.

One process, ``t = 1``, fp32: forward + backward of the same seeded GPT, each transformer layer
eager or compiled with inductor (:func:`lightning_sp.model.compile.compile_layers`, default
options), per recompute policy and dropout. Rounds are interleaved (eager step, compiled step,
...) after the compiled model's warm-up (its compilation is timed apart); the ratio
compiled / eager is the median over rounds of the per-round ratios with a 95% bootstrap
interval (:mod:`benchmarks._stats`), and other processes' share of the CPUs over the rounds is
recorded (:mod:`benchmarks._cpu`). Below 1: compiling pays.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import time
from typing import Any

import torch

from benchmarks import _cpu
from benchmarks._format import add_out_argument, ci, command, out_dir, table, write
from benchmarks._stats import median_ci
from lightning_sp.model.compile import CompileOptions, compile_layers
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.parallel.state import ParallelState


@dataclasses.dataclass(frozen=True)
class CompileShape:
    """The GPT measured and the rounds."""

    s: int = 256
    b: int = 4
    h: int = 256
    layers: int = 4
    heads: int = 8
    vocab: int = 257
    policies: tuple[str, ...] = ("none", "selective")
    dropouts: tuple[float, ...] = (0.0,)
    warmup: int = 2
    rounds: int = 12


FULL = CompileShape()
SMOKE = CompileShape(s=32, b=2, h=32, layers=1, heads=2, policies=("none",), dropouts=(0.0,),
                     warmup=1, rounds=3)  # fmt: skip


def measure_case(shape: CompileShape, recompute: str, dropout: float) -> dict[str, Any]:
    config = GPTConfig(
        vocab_size=shape.vocab, seq_length=shape.s, hidden_size=shape.h, num_layers=shape.layers,
        num_heads=shape.heads, recompute=RecomputePolicy.parse(recompute), hidden_dropout=dropout,
        attention_dropout=dropout,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab, (shape.b, shape.s + 1), generator=generator)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    models = {}
    for name in ("eager", "compiled"):
        model = GPT(config, ParallelState.single())
        if name == "compiled":
            compile_layers(model.layers, CompileOptions())
        models[name] = model

    def step(model: GPT) -> float:
        start = time.perf_counter()
        model(ids, labels).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    first = step(models["compiled"])  # compiles forward and backward
    for _ in range(shape.warmup):
        for model in models.values():
            step(model)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    before = _cpu.sample()
    for _ in range(shape.rounds):
        for name, model in models.items():
            times[name].append(step(model))
    foreign = _cpu.foreign_share(before, _cpu.sample())
    ratios = [c / e for c, e in zip(times["compiled"], times["eager"], strict=True)]
    return {
        "recompute": recompute,
        "dropout": dropout,
        "first_compiled_step_seconds": first,
        "eager_seconds": statistics.median(times["eager"]),
        "compiled_seconds": statistics.median(times["compiled"]),
        "compiled_over_eager": median_ci(ratios),
        "foreign_share": foreign,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_cpu", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shape, 3 rounds")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else FULL
    loadavg = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    cases = [measure_case(shape, p, d) for p in shape.policies for d in shape.dropouts]
    result = {
        "meta": {
            "command": command("benchmarks.compile_cpu", argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "loadavg_at_start": loadavg,
            "shape": dataclasses.asdict(shape),
            "smoke": args.smoke,
        },
        "cases": cases,
    }
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
        for c in cases
    ]
    s = shape
    markdown = (
        f"Compiled (inductor, per layer) vs eager forward + backward, one CPU process, fp32, "
        f"GPT s={s.s} h={s.h} L={s.layers} a={s.heads} v={s.vocab} b={s.b}, {s.rounds} "
        f"interleaved rounds; load average at start {loadavg}.\n\n" + table(header, rows)
    )
    write(out_dir(args.out, args.smoke), "compile_cpu", result, markdown)
    return result


if __name__ == "__main__":
    main()
