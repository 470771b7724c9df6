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

The ``compile`` section (only when named; ``compile_cpu.md``/``.json``): one process, ``t = 1``,
fp32, forward + backward of the same seeded GPT, each transformer layer eager or compiled with
inductor (:func:`lightning_sp.model.compile.compile_layers`, default options), per recompute
policy and dropout. Rounds are interleaved (eager step, compiled step, ...) after the compiled
model's warm-up (its compilation is timed apart); the ratio compiled / eager is the median over
rounds of the per-round ratios with a 95% bootstrap interval (:mod:`benchmarks._stats`), and
other processes' share of the CPUs over the rounds is recorded (:mod:`benchmarks._cpu`).
Below 1: compiling pays.
"""

from __future__ import annotations

import collections
import cProfile
import dataclasses
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from benchmarks import _cpu, _format
from benchmarks._fit import Shape, batch, fit_argv, plain_step, profile_parts, train_step
from benchmarks._format import ci, table
from benchmarks._stats import device_sync, interleaved, ratio_ci
from lightning_sp.data import TextDataModule
from lightning_sp.model.compile import CompileOptions, compile_layers
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing.host_reads import HostReads
from lightning_sp.training.gpt_module import GPTModule


@dataclasses.dataclass(frozen=True)
class FitShape(Shape):
    """The GPT and run measured (small, so that the loop's own time shows beside the model's)."""

    s: int = 128
    h: int = 128
    layers: int = 2
    heads: int = 4
    vocab: int = 257
    b: int = 4
    recompute: str = "selective"
    warmup: int = 5
    """Fit steps before the timed rounds (compilation of nothing, caches, the monitors' first
    window)."""
    rounds: int = 40
    """Timed rounds: each one fit step, one bare step, one forward + backward."""
    counted_steps: int = 3
    """Steps whose host reads are counted (after the timed rounds)."""
    profiled_steps: int = 10
    """Fit steps under ``cProfile`` (after the counted ones)."""
    max_documents: int = 60


FULL = FitShape()
CPU = torch.device("cpu")
SMOKE = FitShape(s=32, b=2, h=32, layers=1, heads=2, warmup=2, rounds=4, profiled_steps=2)


# -- the run -----------------------------------------------------------------------------------


_SKIP = ("fit_overhead.py", "_fit.py")
"""The benchmark's own frames, skipped when naming where a host read comes from."""


class Rounds(Callback):
    """At each fit step's start: one bare step and one forward + backward, timed; the fit
    step is timed from the end of those to the next fit step's start. Then counts host
    reads, then profiles (see the module docstring)."""

    def __init__(
        self, shape: FitShape, bare: Callable[[Any], None], fwd_bwd: Callable[[Any], None],
        sync: Callable[[], None],
    ):  # fmt: skip
        self.shape, self.sync = shape, sync
        self.bare, self.fwd_bwd = bare, fwd_bwd
        self.fit: list[float] = []
        self.bare_seconds: list[float] = []
        self.fwd_bwd_seconds: list[float] = []
        self.foreign: list[float] = []
        self.fit_reads: list[HostReads] = []
        self.bare_reads: list[HostReads] = []
        self.profile = cProfile.Profile()
        self.profiled = 0
        self.profiled_seconds = 0.0
        self._profile_start = 0.0
        self._mark: tuple[float, float, float] | None = None
        self._mode: HostReads | None = None
        self._profiling = False

    def _phase(self, step: int) -> str:
        s = self.shape
        if step < s.warmup:
            return "warmup"
        if step < s.warmup + s.rounds:
            return "timed"
        if step < s.warmup + s.rounds + s.counted_steps:
            return "counted"
        return "profiled"

    def _close(self) -> None:
        """End whatever the previous fit step was measured by."""
        if self._mark is not None:
            self.sync()
            now = _cpu.sample()
            self.fit.append(now[0] - self._mark[0])
            self.foreign.append(_cpu.foreign_share(self._mark, now))
            self._mark = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.fit_reads.append(self._mode)
            self._mode = None
        if self._profiling:
            self.profile.disable()
            self.profiled_seconds += time.perf_counter() - self._profile_start
            self.profiled += 1
            self._profiling = False

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._close()
        phase = self._phase(trainer.global_step)
        if phase == "timed":
            for fn, seconds in (
                (self.bare, self.bare_seconds),
                (self.fwd_bwd, self.fwd_bwd_seconds),
            ):
                self.sync()
                start = time.perf_counter()
                fn(batch)
                self.sync()
                seconds.append(time.perf_counter() - start)
            self._mark = _cpu.sample()
        elif phase == "counted":
            reads = HostReads(skip=_SKIP)
            with reads:
                self.bare(batch)
            self.bare_reads.append(reads)
            self._mode = HostReads(skip=_SKIP)
            self._mode.__enter__()
        elif phase == "profiled":
            self._profiling = True
            self._profile_start = time.perf_counter()
            self.profile.enable()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()


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


# -- compiled vs eager layers -------------------------------------------------------------------


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


def _compile_markdown(result: dict[str, Any]) -> str:
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
            _format.write(out, "compile_cpu", result, _compile_markdown(result))
        found.update(result)
    return found


if __name__ == "__main__":
    main()
