"""The fit loop against the bare step: ``python -m benchmarks.fit_overhead [--smoke] [--out DIR]``.

One process, one CPU rank (``t = 1``), fp32, the same GPT on the same batches. Three steps:

* **fit**: ``trainer.fit`` as a configured run has it, built by the CLI's own class
  (``GPTCLI``: its parser, defaults, loggers and :class:`~lightning_sp.ProgressBar`), strategy
  ``megatron_sp``, ``gradient_clip_val: 1.0``, the :class:`~lightning_sp.ActivationMemoryMonitor`
  and :class:`~lightning_sp.MFUMonitor`, ``log_every_n_steps: 10``, no checkpoints, no
  validation: Lightning's loop and hooks, data loading, the strategy's gradient finalisation,
  the non-finite guard, clipping, logging, the monitors and the bar;
* **bare**: the plain loop of :mod:`benchmarks._gpu_fit` on a second copy of the model (same
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
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import datetime
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from benchmarks import _cpu
from benchmarks._format import add_out_argument, ci, command, out_dir, table, write
from benchmarks._stats import median_ci
from lightning_sp.data import TextDataModule
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.optim.adamw import configure_adamw
from lightning_sp.testing.host_reads import HostReads
from lightning_sp.training.gpt_module import GPTModule


@dataclasses.dataclass(frozen=True)
class FitShape:
    """The GPT and run measured (small, so that the loop's own time shows beside the model's)."""

    s: int = 128
    b: int = 4
    h: int = 128
    layers: int = 2
    heads: int = 4
    vocab: int = 257
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

    def config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab, seq_length=self.s, hidden_size=self.h,
            num_layers=self.layers, num_heads=self.heads,
            recompute=RecomputePolicy.parse(self.recompute),
            hidden_dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip


FULL = FitShape()
SMOKE = FitShape(s=32, b=2, h=32, layers=1, heads=2, warmup=2, rounds=4, profiled_steps=2)


# -- the profile's parts -----------------------------------------------------------------------

PARTS: dict[str, tuple[str, ...]] = {
    "forward": ("training_step",),
    "backward": ("backward",),
    "gradient finalisation": ("finalize_grads",),
    "non-finite guard": ("check",),
    "clipping": ("configure_gradient_clipping",),
    "routing metrics / token mean": ("on_before_optimizer_step",),
    "data loading": ("__next__",),
    "logging": ("log", "on_batch_end", "update_train_step_metrics"),
}
"""Each part: function names whose cumulative time it is, matched with the file below."""

_FILES: dict[str, tuple[str, ...]] = {
    "forward": ("lightning_sp/training/gpt_module.py",),
    "backward": ("lightning_sp/training/gpt_module.py",),
    "gradient finalisation": ("lightning_sp/pipeline/stages.py", "lightning_sp/parallel/grads.py"),
    "non-finite guard": ("lightning_sp/runtime/guard.py",),
    "clipping": ("lightning_sp/training/gpt_module.py",),
    "routing metrics / token mean": ("lightning_sp/training/gpt_module.py",),
    "data loading": ("lightning/pytorch/loops/fetchers.py",),
    "logging": ("lightning/pytorch/core/module.py", "logger_connector/logger_connector.py"),
}
"""Where each part's functions live (path fragments, ``/``-separated)."""
_CALLBACKS = ("lightning_sp/callbacks/", "lightning/pytorch/callbacks/progress/")


def _in_callbacks(filename: str) -> bool:
    return any(c in filename.replace(os.sep, "/") for c in _CALLBACKS)


def profile_parts(profile: cProfile.Profile, steps: int, wall: float) -> dict[str, float]:
    """Seconds per step of each part of :data:`PARTS`, the optimizer update (the optimizer's
    ``step`` less the closure it runs: Lightning's hooks before the step and clipping), the
    callbacks' hooks, and the rest of the whole step (``wall`` seconds over ``steps`` profiled
    steps)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    cumulative: dict[tuple[str, str], float] = collections.defaultdict(float)
    callbacks = 0.0
    for (filename, _line, name), (_cc, _nc, _tt, ct, callers) in stats.items():
        path = filename.replace(os.sep, "/")
        cumulative[(path, name)] += ct
        # a callback's hook, counted once: not again where another of these hooks called it
        hook = any(c in path for c in _CALLBACKS) and name.startswith("on_")
        if hook and not any(_in_callbacks(caller[0]) for caller in callers):
            callbacks += ct

    def seconds(fragment: str, name: str) -> float:
        return sum(v for (path, n), v in cumulative.items() if n == name and fragment in path)

    parts = {
        part: sum(seconds(f, n) for f in _FILES[part] for n in names)
        for part, names in PARTS.items()
    }
    parts["optimizer update"] = seconds("lightning_sp/optim/adamw.py", "step") - seconds(
        "lightning/pytorch/plugins/precision/precision.py", "_wrap_closure"
    )
    parts["callbacks"] = callbacks
    parts["rest (Lightning's loop and hooks)"] = wall - sum(parts.values())
    parts["step"] = wall
    return {k: v / steps for k, v in parts.items()}


# -- the run -----------------------------------------------------------------------------------


class Rounds(Callback):
    """At each fit step's start: one bare step and one forward + backward, timed; the fit
    step is timed from the end of those to the next fit step's start. Then counts host
    reads, then profiles (see the module docstring)."""

    def __init__(
        self, shape: FitShape, bare: Callable[[Any], None], fwd_bwd: Callable[[Any], None]
    ):
        self.shape = shape
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
                start = time.perf_counter()
                fn(batch)
                seconds.append(time.perf_counter() - start)
            self._mark = _cpu.sample()
        elif phase == "counted":
            reads = HostReads(skip=("fit_overhead.py",))
            with reads:
                self.bare(batch)
            self.bare_reads.append(reads)
            self._mode = HostReads(skip=("fit_overhead.py",))
            self._mode.__enter__()
        elif phase == "profiled":
            self._profiling = True
            self._profile_start = time.perf_counter()
            self.profile.enable()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()


def _bare_model(shape: FitShape, total: int) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
    """The bare step and forward + backward, each on its own copy of the seeded model."""
    steps = []
    for with_optimizer in (True, False):
        module = GPTModule(shape.config())
        module.configure_model()  # one process, the same seeded weights as the fit's
        (gpt,) = module.chunks
        configured = configure_adamw(gpt, module.optimizer_config, total)
        optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]
        scheduler = schedule["scheduler"] if isinstance(schedule, dict) else schedule

        def step(
            batch: Any,
            gpt: Any = gpt,
            optimizer: Any = optimizer,
            scheduler: Any = scheduler,
            with_optimizer: bool = with_optimizer,
        ) -> None:
            gpt(batch["input_ids"], batch["labels"]).backward()
            if with_optimizer:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            else:
                gpt.zero_grad(set_to_none=True)

        steps.append(step)
    return steps[0], steps[1]


def _trainer_args(shape: FitShape, total: int) -> list[str]:
    return [
        f"--model.config.vocab_size={shape.vocab}", f"--model.config.seq_length={shape.s}",
        f"--model.config.hidden_size={shape.h}", f"--model.config.num_layers={shape.layers}",
        f"--model.config.num_heads={shape.heads}", f"--model.config.recompute={shape.recompute}",
        "--model.config.hidden_dropout=0.0", "--model.config.attention_dropout=0.0",
        f"--data.batch_size={shape.b}", f"--data.max_documents={shape.max_documents}",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=megatron_sp",
        "--trainer.precision=32-true", f"--trainer.max_steps={total}",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_checkpointing=false", "--trainer.log_every_n_steps=10",
        "--trainer.gradient_clip_val=1.0",
        "--trainer.callbacks+=lightning_sp.ActivationMemoryMonitor",
        "--trainer.callbacks+=lightning_sp.MFUMonitor",
    ]  # fmt: skip


def measure(shape: FitShape) -> dict[str, Any]:
    """Run the fit with :class:`Rounds` inside it; everything measured."""
    from lightning_sp.cli.fit import GPTCLI

    total = shape.warmup + shape.rounds + shape.counted_steps + shape.profiled_steps
    bare, fwd_bwd = _bare_model(shape, total)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:  # the CLI's logs go here
        os.chdir(tmp)
        try:
            cli = GPTCLI(GPTModule, TextDataModule, args=_trainer_args(shape, total), run=False)
            rounds = Rounds(shape, bare, fwd_bwd)
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
        "fit_over_bare": median_ci([f / b for f, b in zip(fit, bare_s, strict=True)]),
        "bare_over_fwd_bwd": median_ci([b / f for b, f in zip(bare_s, fb, strict=True)]),
        "fit_over_fwd_bwd": median_ci([f / g for f, g in zip(fit, fb, strict=True)]),
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fit_overhead", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shape, a few rounds (seconds)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 40)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else FULL
    if args.rounds is not None:
        shape = dataclasses.replace(shape, rounds=args.rounds)
    measured = measure(shape)
    result = {
        "meta": {
            "command": command("benchmarks.fit_overhead", argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "loadavg": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
            "cpus": os.cpu_count(),
            "shape": dataclasses.asdict(shape),
            "smoke": args.smoke,
        },
        "measured": measured,
    }
    write(out_dir(args.out, args.smoke), "fit_overhead", result, _markdown(result))
    return result


if __name__ == "__main__":
    main()
