"""The fit step measured from inside the fit (:mod:`benchmarks.fit_overhead`, also
:mod:`benchmarks.gpu`'s ``fit`` section): the GPT and run measured (:class:`FitShape`) and the
callback in the fit (:class:`Rounds`) that times a bare step and a forward + backward at each
fit step's start and the fit step between them, then counts host reads, then profiles."""

from __future__ import annotations

import cProfile
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from benchmarks import _cpu
from benchmarks._fit import Shape
from lightning_sp.testing.host_reads import HostReads


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


_SKIP = ("fit_overhead.py", "_fit.py", "_fit_rounds.py")
"""The benchmark's own frames, skipped when naming where a host read comes from."""


class Rounds(Callback):
    """At each fit step's start: one bare step and one forward + backward, timed; the fit
    step is timed from the end of those to the next fit step's start. Then counts host
    reads, then profiles (see :mod:`benchmarks.fit_overhead`)."""

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
