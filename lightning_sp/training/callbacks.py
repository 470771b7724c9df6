"""Lightning callbacks that report what the paper measures: activation memory per layer
(Table 2) and model / hardware FLOPs utilization (Table 5).

Both expect a LightningModule whose model shard is a :class:`lightning_sp.pipeline.Pipeline`
of GPT chunks returned by ``stage_model()`` (the
:class:`~lightning_sp.training.protocol.ParallelModule` protocol; ``GPTModule`` does this),
or, for a module of your own, a :class:`lightning_sp.GPT` held as ``pl_module.gpt``; both are
built in ``configure_model``. Batches are ``{"input_ids": LongTensor[b, s], "labels":
LongTensor[b, s]}``. Parallel sizes come from the GPT's ``state``; nothing here reads
process-group globals.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lightning_sp.errors import positive_int
from lightning_sp.memory.flops import (
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    peak_flops,
)
from lightning_sp.memory.formulas import activation_bytes_per_layer, layers_in_flight
from lightning_sp.memory.saved import ActivationReport, LiveActivationTracker, SavedTensorTracker
from lightning_sp.model.gpt import GPT
from lightning_sp.model.shape import ActivationShape
from lightning_sp.pipeline import Pipeline
from lightning_sp.training.protocol import stage_model_of

__all__ = ["ActivationMemoryMonitor", "MFUMonitor"]


def _pipeline(pl_module: LightningModule) -> Pipeline | None:
    """The module's stage model when it is a :class:`Pipeline` (e.g. ``GPTModule``)."""
    stage = stage_model_of(pl_module)
    return stage if isinstance(stage, Pipeline) else None


def _schedule(pl_module: LightningModule) -> Pipeline | None:
    """The module's pipeline when its schedule runs forward and backward inside the step."""
    pipeline = _pipeline(pl_module)
    return pipeline if pipeline is not None and pipeline.runs_backward else None


def _gpt(pl_module: LightningModule) -> GPT:
    """The module's GPT: its pipeline's first model chunk (every chunk has the same config
    and parallel state), or the bare ``gpt`` of a module of one's own."""
    pipeline = _pipeline(pl_module)
    if pipeline is not None:
        return pipeline.models[0]
    gpt = getattr(pl_module, "gpt", None)
    if not isinstance(gpt, GPT):
        raise AttributeError(
            f"{type(pl_module).__name__} has neither a stage_model() that is a lightning_sp "
            "Pipeline nor an attribute `gpt` holding a lightning_sp.GPT; the lightning_sp "
            "callbacks need one (build it in configure_model)"
        )
    return gpt


def _batch_shape(batch: Any) -> tuple[int, int]:
    """``(b, s)`` of a batch ``{"input_ids": [b, s], ...}``."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(
            "expected a batch {'input_ids': LongTensor[b, s], 'labels': LongTensor[b, s]}, "
            f"got {type(batch).__name__}"
        )
    b, s = batch["input_ids"].shape
    return int(b), int(s)


def _check_every(log_every_n_steps: int) -> int:
    return positive_int("log_every_n_steps", log_every_n_steps)


class ActivationMemoryMonitor(Callback):
    """Measure the activation bytes autograd saves in the forward pass and compare them with
    the paper's Table 2.

    On a due step (``trainer.global_step % log_every_n_steps == 0``) a
    :class:`~lightning_sp.memory.saved.SavedTensorTracker` is entered in
    ``on_train_batch_start`` and left in ``on_before_backward``, so exactly the tensors the
    forward saves are counted, not what recomputation materialises during backward. The
    tracker is always left: in ``on_before_backward``, else in ``on_train_batch_end`` (a
    step without backward logs nothing), ``on_exception`` or ``teardown``.

    Logged (per rank, ``sync_dist=False``; ranks of the same role measure the same bytes):

    * ``memory/activation_bytes_per_layer``: mean over this rank's layers, as measured
    * ``memory/activation_bytes_per_layer_formula``: Table 2 for the running layout (``s``,
      ``b`` from the batch, ``h``, ``a``, FFN width and dropouts from the config, ``t`` from
      ``gpt.state``, each layer's recompute policy), generalised to the parameters' element
      size (Table 2 itself assumes 2-byte activations; fp32 runs count 4).
    * ``memory/activation_bytes_ratio``: measured / formula
    * ``memory/activation_bytes_total``: everything saved, including embedding and head
    * ``memory/peak_allocated_bytes``: on CUDA, ``torch.cuda.max_memory_allocated`` over the
      step (peak stats are reset when the measurement starts), logged at batch end.

    The last measurement stays in ``last_per_layer`` (bytes of each layer of this shard),
    ``last_formula``, ``last_total`` and ``last_report``.
    """

    PREFIX = "memory/"

    def __init__(self, log_every_n_steps: int = 1, prog_bar: bool = True) -> None:
        super().__init__()
        self.log_every_n_steps = _check_every(log_every_n_steps)
        self.prog_bar = prog_bar
        self._tracker: SavedTensorTracker | None = None
        self._shape: tuple[int, int] | None = None
        self._cuda_device: torch.device | None = None
        self.last_per_layer: list[int] = []
        self.last_formula: float | None = None
        self.last_total: int | None = None
        self.last_report: ActivationReport | None = None
        self.last_stage_peak: int | None = None
        self.last_stage_formula: float | None = None
        self._live: LiveActivationTracker | None = None

    # -- tracker lifetime -------------------------------------------------------------------

    @property
    def is_tracking(self) -> bool:
        """Whether a tracker is active (between batch start and backward of a due step)."""
        return self._tracker is not None

    def _stop(self) -> SavedTensorTracker | None:
        """Leave the active tracker, if any, and return it; safe to call at any time."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
        return tracker

    def _stop_all(self) -> None:
        """Leave both trackers (the forward one and, under a pipeline, the live one)."""
        self._stop()
        live, self._live = self._live, None
        if live is not None:
            live.__exit__(None, None, None)

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._stop_all()  # a previous step that never reached backward or batch end
        self._shape = None
        if trainer.global_step % self.log_every_n_steps:
            return
        gpt = _gpt(pl_module)
        self._shape = _batch_shape(batch)
        self._cuda_device = None
        device = next(gpt.parameters()).device
        if device.type == "cuda":
            self._cuda_device = device
            torch.cuda.reset_peak_memory_stats(device)
        pipeline = _schedule(pl_module)
        if pipeline is not None:  # the schedule runs forward and backward inside the step
            modules = {
                f"chunks.{c}.layers.{i}": layer
                for c, chunk in enumerate(pipeline.models)
                for i, layer in enumerate(chunk.layers)
            }
            live = LiveActivationTracker(modules, exclude=list(pipeline.parameters()))
            live.__enter__()
            self._live = live
            return
        tracker = SavedTensorTracker.for_model(gpt)
        tracker.__enter__()
        self._tracker = tracker

    @override
    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: Tensor
    ) -> None:
        tracker = self._stop()
        if tracker is None or self._shape is None:
            return
        self._record(pl_module, tracker.report, *self._shape)

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        live, self._live = self._live, None  # under a pipeline: the whole step was followed
        if live is not None:
            live.__exit__(None, None, None)
            if self._shape is not None:
                self.report_pipeline_stage_peak(pl_module, live.peak_bytes, *self._shape)
        self._stop()  # no backward ran (e.g. training_step returned None): nothing is logged
        if self._cuda_device is not None and self._shape is not None:
            peak = torch.cuda.max_memory_allocated(self._cuda_device)
            self._log(pl_module, "peak_allocated_bytes", float(peak), self._shape[0])
        self._cuda_device = None

    @override
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._stop_all()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_all()

    # -- reporting --------------------------------------------------------------------------

    def _log(self, pl_module: LightningModule, name: str, value: float, batch_size: int) -> None:
        pl_module.log(
            self.PREFIX + name,
            value,
            prog_bar=self.prog_bar,
            on_step=True,
            on_epoch=False,
            sync_dist=False,
            batch_size=batch_size,
        )

    def _record(self, pl_module: LightningModule, report: ActivationReport, b: int, s: int) -> None:
        gpt = _gpt(pl_module)
        per_layer = [report.bytes_of(f"layers.{i}") for i in range(len(gpt.layers))]
        # the paper's formula for this model: its activation dtype, which dropouts exist, its
        # FFN width, and each layer's own policy (recompute_num_layers mixes full/selective)
        formula = self._formula_per_layer(gpt, b, s)
        self.last_per_layer, self.last_formula = per_layer, formula
        self.last_total, self.last_report = report.total_bytes, report
        if per_layer:
            measured = sum(per_layer) / len(per_layer)
            self._log(pl_module, "activation_bytes_per_layer", measured, b)
            self._log(pl_module, "activation_bytes_per_layer_formula", formula, b)
            self._log(pl_module, "activation_bytes_ratio", measured / formula, b)
        self._log(pl_module, "activation_bytes_total", float(report.total_bytes), b)

    def _formula_per_layer(self, gpt: GPT, b: int, s: int) -> float:
        """Table 2 for this model, averaged over ``gpt``'s layers (see ``_record``)."""
        config, state = gpt.config, gpt.state
        shape = ActivationShape.from_config(
            config, state.tensor_parallel_size, b, seq_length=s,
            activation_bytes=next(gpt.parameters()).element_size(),
        )  # fmt: skip
        return sum(
            activation_bytes_per_layer(shape, config.layer_recompute(i))
            for i in range(len(gpt.layers))
        ) / len(gpt.layers)

    def report_pipeline_stage_peak(
        self, pl_module: LightningModule, peak_bytes: int, b: int, s: int
    ) -> None:
        """Log the peak of live saved activations on this pipeline stage during the step
        (``memory/pipeline_stage_peak_bytes``) and, on the first stage, the paper's value
        beside it: the per-layer bytes of one micro-batch times the layers' worth in flight
        (eq. 5, ``L``; interleaved ``L·(1 + (p-1)/(p·m))``), embedding extras left out."""
        self._log(pl_module, "pipeline_stage_peak_bytes", float(peak_bytes), b)
        pipeline = _schedule(pl_module)
        if pipeline is None or not pipeline.state.is_first_stage:
            return
        gpt, n = pipeline.models[0], pipeline.num_microbatches
        state = gpt.state
        in_flight = layers_in_flight(
            gpt.config.num_layers, state.pipeline_parallel_size, len(pipeline.models), n
        )
        formula = self._formula_per_layer(gpt, b // n, s) * in_flight
        self.last_stage_peak, self.last_stage_formula = peak_bytes, formula
        self._log(pl_module, "pipeline_stage_peak_formula", formula, b)
        self._log(pl_module, "pipeline_stage_peak_ratio", peak_bytes / formula, b)


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

    Timing: ``time.perf_counter()`` at ``on_train_batch_start`` and ``on_train_batch_end``
    (after ``torch.cuda.synchronize()`` on CUDA), so a step is forward, backward and
    optimizer step; data loading and the time between steps are excluded. The window's
    "time" is the running sum of these step times. Rates are Lightning's: over the last
    ``window_size`` steps, the first of which only opens the window, so nothing is logged
    for the first ``window_size - 1`` steps (which also keeps the warm-up step out).

    FLOPs of a step: the global batch is ``b · gpt.state.data_parallel_size`` sequences of
    the batch's ``s`` tokens; each of the ``t·p·d`` devices does ``1/(t·p·d)`` of
    :func:`~lightning_sp.memory.flops.model_flops_per_iteration` (MFU) or
    :func:`~lightning_sp.memory.flops.hardware_flops_per_iteration` (HFU, adds what the recompute
    policy re-executes). Tokens per step are ``global batch · s``.

    Logged every ``log_every_n_steps`` steps once the window is full, in the progress bar:

    * ``throughput/tokens_per_sec``: tokens of the global batch per second
    * ``throughput/model_tflops_per_sec``: model TFLOP/s per device
    * ``throughput/hardware_tflops_per_sec``: hardware TFLOP/s per device (not in the bar)
    * ``throughput/mfu``: model FLOP/s per device / peak FLOP/s of a device
    * ``throughput/hfu``: hardware FLOP/s per device / peak FLOP/s of a device (>= mfu)

    ``peak_flops_per_device=None`` resolves the peak once, at the first ``on_train_start``,
    with :func:`~lightning_sp.memory.flops.peak_flops` for the device and compute dtype (the
    parameters' dtype, or bf16 / fp16 under a ``*-mixed`` precision): Lightning's datasheet
    value on GPUs (A100 bf16: 312e12), a measured matmul rate on CPU (every rank measures,
    rank zero's value is broadcast). The resolved value is kept in ``peak_flops_per_device``;
    the last metrics in ``last_metrics``.

    With :class:`ActivationMemoryMonitor` active on the same step, its saved-tensor hooks
    are inside the timed region (a small overhead on the measured steps).
    """

    PREFIX = "throughput/"

    def __init__(
        self,
        peak_flops_per_device: float | None = None,
        window_size: int = 20,
        log_every_n_steps: int = 1,
        prog_bar: bool = True,
    ) -> None:
        super().__init__()
        if peak_flops_per_device is not None and not peak_flops_per_device > 0:
            raise ValueError(f"peak_flops_per_device={peak_flops_per_device!r} must be positive")
        if not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"window_size={window_size!r} must be an integer >= 2")
        self.peak_flops_per_device = peak_flops_per_device
        self.window_size = window_size
        self.log_every_n_steps = _check_every(log_every_n_steps)
        self.prog_bar = prog_bar
        self._model: Throughput | None = None
        self._hardware: Throughput | None = None
        self._t0: float | None = None
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

    @staticmethod
    def _synchronize(pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        gpt = _gpt(pl_module)
        if self.peak_flops_per_device is None:
            device = next(gpt.parameters()).device
            measured = peak_flops(device, self._compute_dtype(trainer, gpt))
            # every rank measures (so CPU ranks sharing cores contend as in training), rank
            # zero's value is used everywhere: one denominator, equal MFU on equal ranks
            self.peak_flops_per_device = float(trainer.strategy.broadcast(measured, src=0))
        world_size = gpt.state.world_size
        self._model, self._hardware = (
            Throughput(self.peak_flops_per_device, world_size, self.window_size) for _ in range(2)
        )
        self._t0 = None
        self._busy_time = 0.0
        self._batches = self._samples = self._tokens = 0
        self.last_metrics = {}

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step  # the optimizer step this batch belongs to
        self._synchronize(pl_module)
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._t0 is None or self._model is None or self._hardware is None:
            return
        self._synchronize(pl_module)
        self._busy_time += time.perf_counter() - self._t0
        self._t0 = None

        gpt = _gpt(pl_module)
        b, s = _batch_shape(batch)
        state = gpt.state
        global_batch = b * state.data_parallel_size
        config = gpt.config
        if s != config.seq_length:
            config = dataclasses.replace(config, seq_length=s)
        model_flops = model_flops_per_iteration(config, global_batch) / state.world_size
        hardware_flops = hardware_flops_per_iteration(config, global_batch) / state.world_size

        # Throughput takes cumulative counts; these are global (the whole data-parallel
        # batch), so its "device/items_per_sec" is the global tokens/s. FLOPs are per device
        # (Throughput multiplies by world_size, then divides again for "device/...").
        self._batches += 1
        self._samples += global_batch
        self._tokens += global_batch * s
        common = dict(
            time=self._busy_time, batches=self._batches, samples=self._samples,
            lengths=self._tokens,
        )  # fmt: skip
        self._model.update(**common, flops=model_flops)  # type: ignore[arg-type]
        self._hardware.update(**common, flops=hardware_flops)  # type: ignore[arg-type]

        if self._step % self.log_every_n_steps:
            return
        model, hardware = self._model.compute(), self._hardware.compute()
        if "device/mfu" not in model or "device/items_per_sec" not in model:
            return  # window not full yet
        metrics = {
            "tokens_per_sec": model["device/items_per_sec"],
            "model_tflops_per_sec": model["device/flops_per_sec"] / 1e12,
            "hardware_tflops_per_sec": hardware["device/flops_per_sec"] / 1e12,
            "mfu": model["device/mfu"],
            "hfu": hardware["device/mfu"],
        }
        self.last_metrics = {k: float(v) for k, v in metrics.items()}
        for name, value in self.last_metrics.items():
            if not math.isfinite(value):
                continue
            pl_module.log(
                self.PREFIX + name,
                value,
                prog_bar=self.prog_bar and name != "hardware_tflops_per_sec",
                on_step=True,
                on_epoch=False,
                sync_dist=False,
                batch_size=b,
            )
