"""The fit loop against the bare step, and compiled against eager layers, on the CPU:
``python -m benchmarks.fit_overhead [--smoke] [--rounds N] [--only fit,compile] [--out DIR]``.

One process, one CPU rank (``t = 1``), fp32, the same GPT on the same batches. Three steps:

* **fit**: ``trainer.fit`` as a configured run has it, built by the CLI's own class
  (``GPTCLI``: its parser, defaults, loggers and :class:`~lightning_sp.ProgressBar`), strategy
  ``megatron_sp``, ``gradient_clip_val: 1.0``, the :class:`~lightning_sp.ActivationMemoryMonitor`
  and :class:`~lightning_sp.MFUMonitor`, ``log_every_n_steps: 10``, no checkpoints, no
  validation: Lightning's loop and hooks, data loading, the strategy's gradient finalisation,
  the non-finite guard, clipping, logging, the monitors and the bar;
* **bare**: the plain loop of :func:`benchmarks._fit.plain_step` on a second copy of the model (same
  seed, so the same weights): forward, backward, ``optimizer.step()`` (the same
  :func:`~lightning_sp.optim.adamw.configure_adamw`), scheduler step, ``zero_grad``, on the
  batch the fit step just received;
* **forward + backward**: what ``benchmarks.gpu`` times for its model rows (no optimizer).

Timing, interleaved: a callback runs one bare step and one forward + backward at the start of
every fit step (each timed on its own) and times the fit step as the wall time from the end of
those to the start of the next fit step (so it holds everything the loop does between two
steps, data loading and the callbacks included). Each round gives one ratio fit / bare and
bare / (forward + backward); the reported ratios are the medians over rounds with 95%
bootstrap intervals (:mod:`benchmarks._stats`), so the machine's load, which drifts over
seconds, hits both sides of a ratio alike. Other processes' share of the CPUs over the timed
rounds is recorded (:mod:`benchmarks._cpu`).

Then, untimed: **host reads of device values** per step (``aten._local_scalar_dense``, what
``.item()``, ``bool(t)``, ``float(t)`` and ``tensor.tolist()`` run, each of which waits for
the device on a GPU), counted with a dispatch mode over a few fit steps and bare steps, each
read named by where it comes from. On a GPU every such read in the step drains the device's
queue, so Lightning's per-step CPU work stops overlapping the device's: the count, not the
CPU seconds, is what decides the fit loop's overhead there. The reads of the AdamW step
counters (``torch/optim``) are of host tensors under CUDA's fused AdamW and are listed apart.

Then a **profile** (``cProfile``) of a few fit steps, split into the step's parts: forward,
backward, gradient finalisation, the guard, clipping, the optimizer update, the callbacks,
logging, data loading, and the rest (Lightning's loop and hooks). Its seconds are inflated by
the profiler (Python-heavy parts most); only the shares are reported.

The ``compile`` section (only when named; ``compile_cpu.md``/``.json``): each transformer layer
compiled with inductor against eager, forward + backward (:mod:`benchmarks._compile`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks import _format
from benchmarks._compile import (
    COMPILE_FULL,
    COMPILE_SMOKE,
    CompileShape,
    compile_case,
    compile_markdown,
)
from benchmarks._fit import fit_argv, plain_step, profile_parts
from benchmarks._fit_rounds import FitShape, Rounds
from benchmarks._format import ci, table
from benchmarks._stats import device_sync, ratio_ci
from lightning_sp.data import TextDataModule
from lightning_sp.training.gpt_module import GPTModule

FULL = FitShape()
CPU = torch.device("cpu")
SMOKE = FitShape(s=32, b=2, h=32, layers=1, heads=2, warmup=2, rounds=4, profiled_steps=2)


# -- the run -----------------------------------------------------------------------------------


def measure(
    shape: FitShape, device: torch.device = CPU, precision: str = "32-true", dropout: float = 0.0
) -> dict[str, Any]:
    """Run the fit on ``device`` (one CPU rank, or one GPU: :mod:`benchmarks.gpu`'s ``fit``
    section) with :class:`Rounds` inside it; everything measured."""
    from lightning_sp.cli.fit import GPTCLI

    total = shape.warmup + shape.rounds + shape.counted_steps + shape.profiled_steps
    config = shape.config(shape.recompute, dropout)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    bare = plain_step(config, total, device, dtype)  # each its own copy of the seeded model
    fwd_bwd = plain_step(config, total, device, dtype, optimizer_step=False)
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    args = fit_argv(shape, shape.recompute, dropout, accelerator, precision, total)
    args += [f"--data.max_documents={shape.max_documents}", "--trainer.gradient_clip_val=1.0"]
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:  # the CLI's logs go here
        os.chdir(tmp)
        try:
            cli = GPTCLI(GPTModule, TextDataModule, args=args, run=False)
            rounds = Rounds(shape, bare, fwd_bwd, device_sync(device))
            cli.trainer.callbacks.insert(0, rounds)  # type: ignore[attr-defined]
            started = time.perf_counter()
            cli.trainer.fit(cli.model, cli.datamodule)
            seconds = time.perf_counter() - started
        finally:
            os.chdir(cwd)
    n = min(len(rounds.fit), len(rounds.bare_seconds))
    fit, bare_s, fb = rounds.fit[:n], rounds.bare_seconds[:n], rounds.fwd_bwd_seconds[:n]
    fit_reads = [sum(r.reads.values()) for r in rounds.fit_reads]
    origins: collections.Counter[str] = collections.Counter()
    for r in rounds.fit_reads:
        origins.update(r.reads)
    steps = max(1, len(rounds.fit_reads))
    return {
        "rounds": n,
        "seconds": seconds,
        "fit_seconds": fit,
        "bare_seconds": bare_s,
        "fwd_bwd_seconds": fb,
        "foreign_share": rounds.foreign[:n],
        "fit_over_bare": ratio_ci(fit, bare_s),
        "bare_over_fwd_bwd": ratio_ci(bare_s, fb),
        "fit_over_fwd_bwd": ratio_ci(fit, fb),
        "median_seconds": {
            "fit": statistics.median(fit),
            "bare": statistics.median(bare_s),
            "fwd_bwd": statistics.median(fb),
        },
        "host_reads_per_step": {
            "fit": statistics.mean(fit_reads) if fit_reads else 0.0,
            "bare": statistics.mean(sum(r.reads.values()) for r in rounds.bare_reads),
            "fit_optimizer_counters": statistics.mean(
                r.optimizer_counters for r in rounds.fit_reads
            ),
            "fit_origins": {k: v / steps for k, v in origins.most_common()},
        },
        "profile_seconds_per_step": profile_parts(
            rounds.profile, max(1, rounds.profiled), rounds.profiled_seconds
        ),
    }


def _markdown(result: dict[str, Any]) -> str:
    meta, m = result["meta"], result["measured"]
    shape = meta["shape"]
    origins = m["host_reads_per_step"]["fit_origins"]
    lines = [
        f"fit step vs bare step, one CPU rank, fp32, GPT s={shape['s']} h={shape['h']} "
        f"L={shape['layers']} a={shape['heads']} v={shape['vocab']} b={shape['b']} "
        f"({shape['recompute']}); {m['rounds']} interleaved rounds; other processes used "
        f"{100 * statistics.median(m['foreign_share']):.0f}% of the CPUs (median over rounds); "
        f"load average at start {meta['loadavg']}.\n",
        table(
            ["ratio (median over rounds, 95% CI)", "value"],
            [
                ["fit / bare (forward, backward, AdamW)", ci(m["fit_over_bare"])],
                ["bare / forward + backward", ci(m["bare_over_fwd_bwd"])],
                ["fit / forward + backward", ci(m["fit_over_fwd_bwd"])],
            ],
        ),
        "",
        table(
            ["host reads of tensor values per step", "count"],
            [
                ["fit (device syncs on a GPU)", f"{m['host_reads_per_step']['fit']:.2f}"],
                ["bare", f"{m['host_reads_per_step']['bare']:.2f}"],
                *[[f"fit: {k}", f"{v:.2f}"] for k, v in origins.items()],
            ],
        ),
        "",
    ]
    profile = m["profile_seconds_per_step"]
    step = profile["step"]
    lines.append(
        table(
            ["part of a fit step (cProfile)", "share"],
            [[k, f"{100 * v / step:.1f}%"] for k, v in profile.items() if k != "step"],
        )
    )
    return "\n".join(lines) + "\n"


SECTIONS = ("fit", "compile")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sections; ``{"meta": ..., "measured": ... (fit), "cases": ... (compile)}``."""
    parser = _format.parser(__doc__, "tiny shapes, a few rounds (seconds)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (40; compile 12)")
    _format.add_only(parser, SECTIONS, ["fit"])
    args = parser.parse_args(argv)
    meta = {
        "command": _format.command("benchmarks.fit_overhead", argv),
        **_format.stamp(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "smoke": args.smoke,
    }
    out, found = _format.out_dir(args.out, args.smoke), {}  # fmt: skip
    for section, shape in (("fit", SMOKE if args.smoke else FULL),
                           ("compile", COMPILE_SMOKE if args.smoke else COMPILE_FULL)):  # fmt: skip
        if section not in args.only:
            continue
        if args.rounds is not None:
            shape = dataclasses.replace(shape, rounds=args.rounds)
        result: dict[str, Any] = {"meta": {**meta, "shape": dataclasses.asdict(shape)}}
        if isinstance(shape, FitShape):
            result["measured"] = measure(shape)
            _format.write(out, "fit_overhead", result, _markdown(result))
        else:
            assert isinstance(shape, CompileShape)
            result["cases"] = [compile_case(shape, p, d) for p in shape.policies
                               for d in shape.dropouts]  # fmt: skip
            _format.write(out, "compile_cpu", result, compile_markdown(result))
        found.update(result)
    return found


if __name__ == "__main__":
    main()
