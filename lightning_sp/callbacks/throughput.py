"""``MFUMonitor``: tokens/s, model / hardware FLOPs utilization (paper Table 5) of training
steps, timed without a host-device synchronisation outside logging steps."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_sp.callbacks.monitoring import batch_shape, check_every, gpt_of, is_due
from lightning_sp.callbacks.progress import si_format
from lightning_sp.errors import finite_number
from lightning_sp.memory.flops import (
    causal_half_model_flops_per_iteration,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    peak_flops,
)
from lightning_sp.model.gpt import GPT

__all__ = ["MFUMonitor"]


class _StepClock:
    """Busy time of training steps, without a host-device synchronisation per step.

    CPU: ``time.perf_counter()`` at batch start and end. CUDA: timing events recorded on the
    current stream at batch start and end (what the device spent from the step's first kernel
    to its last), read only in :meth:`drain`, which waits for the last one: the single
    synchronisation, on a logging step.
    """

    def __init__(self) -> None:
        self._start: float | torch.cuda.Event | None = None
        self._pending: list[float | tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._start = event
        else:
            self._start = time.perf_counter()

    def stop(self) -> bool:
        """End the step begun by :meth:`start`; ``False`` if none was begun."""
        start, self._start = self._start, None
        if start is None:
            return False
        if isinstance(start, float):
            self._pending.append(time.perf_counter() - start)
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((start, end))
        return True

    def drain(self) -> list[float]:
        """Seconds of every step stopped since the last drain, in order."""
        pending, self._pending = self._pending, []
        if pending and not isinstance(pending[-1], float):
            pending[-1][1].synchronize()
        return [p if isinstance(p, float) else p[0].elapsed_time(p[1]) / 1e3 for p in pending]


class MFUMonitor(Callback):
    """Tokens/s, model TFLOP/s per device, MFU and HFU of the training steps.

    Built on :class:`lightning.fabric.utilities.throughput.Throughput`, Lightning's windowed
    rate computation, rather than by subclassing
    :class:`lightning.pytorch.callbacks.ThroughputMonitor`: that callback reads a single
    ``flops_per_batch`` attribute from the module (one FLOPs count, so no HFU), runs only on
    rank zero, sends metrics straight to the logger through a private connector (they reach
    neither the progress bar nor ``trainer.callback_metrics``) and times from
    ``on_train_start``, so data loading counts as step time. Here two ``Throughput`` windows
    share the same timings, one fed model FLOPs and one hardware FLOPs (from
    :mod:`lightning_sp.memory.flops`), and the results are logged with ``pl_module.log``.

    Timing: from ``on_train_batch_start`` to ``on_train_batch_end``, so a step is forward,
    backward and optimizer step; data loading and the time between steps are excluded. On
    CPU ``time.perf_counter()``; on CUDA timing events on the current stream, read only on
    logging steps (one synchronisation there, none on the other steps). The window's "time"
    is the running sum of these step times. Rates are Lightning's: over the last
    ``window_size`` steps, the first of which only opens the window, so nothing is logged
    for the first ``window_size - 1`` steps (which also keeps the warm-up step out).

    FLOPs of a step: the global batch is ``b · gpt.state.data_parallel_size`` sequences of
    the batch's ``s`` tokens (the whole sequence: under context parallelism every CP rank sees
    the full batch and keeps its ``s/c`` chunks); each of the ``t·c·p·d`` devices does
    ``1/(t·c·p·d)`` of
    :func:`~lightning_sp.memory.flops.model_flops_per_iteration` (MFU) or
    :func:`~lightning_sp.memory.flops.hardware_flops_per_iteration` (HFU, adds what the recompute
    policy re-executes). Tokens per step are ``global batch · s``.

    Logged every ``log_every_n_steps`` steps (default: the trainer's) once the window is full,
    with ``prog_bar=False``; ``prog_bar`` puts ``MFU 38%`` and ``12.3k tok/s`` in
    :class:`~lightning_sp.ProgressBar`:

    * ``throughput/tokens_per_sec``: tokens of the global batch per second
    * ``throughput/model_tflops_per_sec``: model TFLOP/s per device
    * ``throughput/hardware_tflops_per_sec``: hardware TFLOP/s per device
    * ``throughput/mfu``: model FLOP/s per device / peak FLOP/s of a device
    * ``throughput/hfu``: hardware FLOP/s per device / peak FLOP/s of a device (>= mfu)
    * ``throughput/model_tflops_per_sec_causal_half``, ``throughput/mfu_causal_half``: the
      same with causal attention's cores counted at half
      (:func:`~lightning_sp.memory.flops.causal_half_model_flops_per_iteration`)

    Which FLOP convention: ``mfu``, ``hfu`` and the TFLOP/s without a suffix count attention
    **whole** (the paper's Appendix A, torchtitan's count, Megatron-Core's until 2025), as
    ``estimate``'s ``mfu`` does; Megatron-LM since 2025 and MaxText count causal attention at
    half, which is what the ``_causal_half`` metrics report (``estimate``'s ``½causal``
    columns, ``mfu_causal_half`` in its JSON). Compare a published MFU with the metric of the
    source's convention (docs/planner.md, "Two FLOP conventions").

    ``peak_flops_per_device=None`` resolves the peak once, at the first ``on_train_start``,
    with :func:`~lightning_sp.memory.flops.peak_flops` for the device and compute dtype (the
    parameters' dtype, or bf16 / fp16 under a ``*-mixed`` precision): Lightning's datasheet
    value on GPUs (A100 bf16: 312e12), a measured matmul rate on CPU. On CPU that rate is what
    one rank's threads reach *while every rank of the host multiplies at once*, as in
    training: all ranks measure together (a barrier before each of :attr:`PEAK_ROUNDS`
    rounds, each stopping within one 1024² matmul of the others), a round's value is the mean
    of the ranks' rates (on cores that share their vector units a rank left alone runs faster,
    the mean does not), and the best round is kept: other processes only ever lower a
    measurement, and on a shared machine one measurement samples its load (on this project's
    two cores, one thread per rank, single 0.5 s measurements read 29 to 204 GFLOP/s within
    minutes; two ranks at once 197 and 163 in the same half second). Rank zero's one
    measurement was used before: the main job read MFU 49% at 2.54k tok/s (a peak of 58
    GFLOP/s, measured under load) and 28% at 4.28k tok/s (171 GFLOP/s, near one core's fp32
    rate) on the same FLOPs count. The resolved
    value is kept in ``peak_flops_per_device``; the last metrics in ``last_metrics``.

    With :class:`ActivationMemoryMonitor` active on the same step, its saved-tensor hooks
    are inside the timed region (a small overhead on the measured steps).
    """

    PREFIX = "throughput/"
    PEAK_ROUNDS = 3
    """Measurements of the CPU peak at the start of training, the best kept."""

    def __init__(
        self,
        peak_flops_per_device: float | None = None,
        window_size: int = 20,
        log_every_n_steps: int | None = None,
        prog_bar: bool = True,
    ) -> None:
        super().__init__()
        if peak_flops_per_device is not None:
            finite_number("peak_flops_per_device", peak_flops_per_device,
                          "a finite number > 0 (FLOP/s of one device; null: measured)",
                          lambda v: v > 0)  # fmt: skip
        if not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"window_size={window_size!r} must be an integer >= 2")
        self.peak_flops_per_device = peak_flops_per_device
        self.window_size = window_size
        self.log_every_n_steps = check_every(log_every_n_steps)
        self.prog_bar = prog_bar
        self._model: Throughput | None = None
        self._hardware: Throughput | None = None
        self._half: Throughput | None = None  # model FLOPs, causal attention at half
        self._clock = _StepClock()
        # steps timed since the last logging step: (sequences, tokens, model, hardware,
        # causal-half model FLOPs)
        self._steps: list[tuple[int, int, float, float, float]] = []
        # each batch shape's counts (_step_counts), worked out once per fit
        self._counts: dict[tuple[int, int], tuple[int, int, float, float, float]] = {}
        self._step = 0
        self._busy_time = 0.0
        self._batches = 0
        self._samples = 0
        self._tokens = 0
        self.last_metrics: dict[str, float] = {}

    @staticmethod
    def _compute_dtype(trainer: Trainer, gpt: GPT) -> torch.dtype:
        precision = str(trainer.precision)
        if precision.endswith("-mixed"):
            return torch.bfloat16 if precision.startswith("bf16") else torch.float16
        return next(gpt.parameters()).dtype

    def _resolve_peak(self, trainer: Trainer, gpt: GPT) -> float:
        """:func:`~lightning_sp.memory.flops.peak_flops` of this device and compute dtype,
        :attr:`PEAK_ROUNDS` times, every rank at once after a barrier (CPU ranks sharing
        cores contend as in training); each round's value is the mean over the ranks (what
        the cores give each rank while all multiply: a rank the scheduler left out lets
        another run faster, the sum stays), the best round kept (other processes only ever
        lower it). One denominator, equal MFU on equal ranks."""
        device = next(gpt.parameters()).device
        dtype = self._compute_dtype(trainer, gpt)
        best = 0.0
        for _ in range(self.PEAK_ROUNDS):
            trainer.strategy.barrier()
            rate = torch.tensor(peak_flops(device, dtype), dtype=torch.float64, device=device)
            best = max(best, float(trainer.strategy.reduce(rate, reduce_op="mean")))
        return best

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        gpt = gpt_of(pl_module)
        if self.peak_flops_per_device is None:
            self.peak_flops_per_device = self._resolve_peak(trainer, gpt)
        world_size = gpt.state.world_size
        self._model, self._hardware, self._half = (
            Throughput(self.peak_flops_per_device, world_size, self.window_size) for _ in range(3)
        )
        self._clock = _StepClock()
        self._steps = []
        self._counts = {}
        self._busy_time = 0.0
        self._batches = self._samples = self._tokens = 0
        self.last_metrics = {}

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step  # the optimizer step this batch belongs to
        self._clock.start(pl_module.device)

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._clock.stop() or self._model is None or self._hardware is None:
            return
        assert self._half is not None
        b, s = batch_shape(batch)
        counts = self._counts.get((b, s))
        if counts is None:  # once per batch shape: the model does not change during a fit
            counts = self._counts[(b, s)] = self._step_counts(gpt_of(pl_module), b, s)
        self._steps.append(counts)
        if not is_due(trainer, self.log_every_n_steps, self._step):
            return
        self._update()
        model, hardware = self._model.compute(), self._hardware.compute()
        half = self._half.compute()
        if "device/mfu" not in model or "device/items_per_sec" not in model:
            return  # window not full yet
        metrics = {
            "tokens_per_sec": model["device/items_per_sec"],
            "model_tflops_per_sec": model["device/flops_per_sec"] / 1e12,
            "hardware_tflops_per_sec": hardware["device/flops_per_sec"] / 1e12,
            "mfu": model["device/mfu"],
            "hfu": hardware["device/mfu"],
            "model_tflops_per_sec_causal_half": half["device/flops_per_sec"] / 1e12,
            "mfu_causal_half": half["device/mfu"],
        }
        self.last_metrics = {k: float(v) for k, v in metrics.items()}
        for name, value in self.last_metrics.items():
            if not math.isfinite(value):
                continue
            pl_module.log(
                self.PREFIX + name,
                value,
                prog_bar=False,  # ProgressBar shows progress_bar_items() instead
                on_step=True,
                on_epoch=False,
                sync_dist=False,
                batch_size=b,
            )

    @staticmethod
    def _step_counts(gpt: GPT, b: int, s: int) -> tuple[int, int, float, float, float]:
        """A step's ``(sequences, tokens, model, hardware, causal-half model FLOPs per
        device)`` for a batch ``[b, s]`` of each data-parallel rank (see the class
        docstring)."""
        state = gpt.state
        global_batch = b * state.data_parallel_size
        config = gpt.config
        if s != config.seq_length:
            config = dataclasses.replace(config, seq_length=s)
        model_flops = model_flops_per_iteration(config, global_batch) / state.world_size
        hardware_flops = (
            hardware_flops_per_iteration(config, global_batch, layers_per_chunk=len(gpt.layers))
            / state.world_size
        )
        half_flops = causal_half_model_flops_per_iteration(config, global_batch) / state.world_size
        return global_batch, global_batch * s, model_flops, hardware_flops, half_flops

    def _update(self) -> None:
        """Feed the steps timed since the last logging step into the two windows (the clock's
        one synchronisation on CUDA happens here)."""
        assert self._model is not None and self._hardware is not None
        assert self._half is not None
        for seconds, (sequences, tokens, model_flops, hardware_flops, half_flops) in zip(
            self._clock.drain(), self._steps, strict=True
        ):
            # Throughput takes cumulative counts; these are global (the whole data-parallel
            # batch), so its "device/items_per_sec" is the global tokens/s. FLOPs are per
            # device (Throughput multiplies by world_size, then divides again for "device/").
            self._busy_time += seconds
            self._batches += 1
            self._samples += sequences
            self._tokens += tokens
            common = dict(
                time=self._busy_time, batches=self._batches, samples=self._samples,
                lengths=self._tokens,
            )  # fmt: skip
            self._model.update(**common, flops=model_flops)  # type: ignore[arg-type]
            self._hardware.update(**common, flops=hardware_flops)  # type: ignore[arg-type]
            self._half.update(**common, flops=half_flops)  # type: ignore[arg-type]
        self._steps = []

    def progress_bar_items(self) -> dict[str, str]:
        """The last rates, short: ``{"MFU": "38%", "tok/s": "12.3k"}``; empty before the
        window is full or with prog_bar off."""
        last = self.last_metrics
        if not self.prog_bar or "mfu" not in last:
            return {}
        return {"MFU": f"{100 * last['mfu']:.0f}%", "tok/s": si_format(last["tokens_per_sec"])}
