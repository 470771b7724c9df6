"""Lightning callbacks that report what the paper measures: activation memory per layer
(Table 2) here, and model / hardware FLOPs utilization (Table 5) in
:mod:`lightning_sp.callbacks.throughput`.

Both expect a LightningModule whose model shard is a :class:`lightning_sp.pipeline.Pipeline`
of GPT chunks returned by ``stage_model()`` (the
:class:`~lightning_sp.training.protocol.ParallelModule` protocol; ``GPTModule`` does this),
or, for a module of your own, a :class:`lightning_sp.GPT` held as ``pl_module.gpt``; both are
built in ``configure_model``. Batches are ``{"input_ids": LongTensor[b, s], "labels":
LongTensor[b, s]}``. Parallel sizes come from the GPT's ``state``; nothing here reads
process-group globals.

Both stay off the hot path: they measure on due steps only (every ``log_every_n_steps``,
by default the trainer's), never synchronise host and device on the other steps, and log the
raw metrics for the loggers with ``prog_bar=False``; :class:`~lightning_sp.ProgressBar` shows
them formatted (``progress_bar_items``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lightning_sp.callbacks.monitoring import (
    batch_shape,
    check_every,
    gpt_of,
    is_due,
    scheduled_pipeline_of,
)
from lightning_sp.memory.formulas import activation_bytes_per_layer, layers_in_flight
from lightning_sp.memory.saved import ActivationReport, LiveActivationTracker, SavedTensorTracker
from lightning_sp.model.gpt import GPT

__all__ = ["ActivationMemoryMonitor"]


class ActivationMemoryMonitor(Callback):
    """Measure the activation bytes autograd saves in the forward pass and compare them with
    the paper's Table 2.

    On a due step (``trainer.global_step % log_every_n_steps == 0``; by default the trainer's
    ``log_every_n_steps``, so the hooks cost nothing on the other steps) a
    :class:`~lightning_sp.memory.saved.SavedTensorTracker` is entered in
    ``on_train_batch_start`` and left in ``on_before_backward``, so exactly the tensors the
    forward saves are counted, not what recomputation materialises during backward. The
    tracker is always left: in ``on_before_backward``, else in ``on_train_batch_end`` (a
    step without backward logs nothing), ``on_exception`` or ``teardown``.

    Logged (per rank, ``sync_dist=False``; ranks of the same role measure the same bytes):

    * ``memory/activation_bytes_per_layer``: mean over this rank's layers, as measured
    * ``memory/activation_bytes_per_layer_formula``: Table 2 for the running layout (``s``,
      ``b`` from the batch, ``h``, ``a``, FFN width and dropouts from the config, ``t`` and
      ``c`` from ``gpt.state``, each layer's recompute policy), generalised to the parameters'
      element size (Table 2 itself assumes 2-byte activations; fp32 runs count 4). Under
      context parallelism ``s`` is the batch's whole sequence and the formula is this rank's
      ``1/c`` of it (:func:`~lightning_sp.memory.formulas.activation_bytes_per_layer`). A batch
      with ``documents`` (a document mask) is counted with the attention part's document
      terms (``sdpa``'s concatenated context).
    * ``memory/activation_bytes_ratio``: measured / formula
    * ``memory/activation_bytes_total``: everything saved, including embedding and head
    * ``memory/peak_allocated_bytes``: on CUDA, ``torch.cuda.max_memory_allocated`` over the
      step (peak stats are reset when the measurement starts), logged at batch end.

    The last measurement stays in ``last_per_layer`` (bytes of each layer of this shard),
    ``last_formula``, ``last_total`` and ``last_report``, and ``last_sbh`` (``s·b·h`` of that
    step, ``s`` the whole sequence, so a CP rank shows about ``1/c`` of c = 1's sbh).
    ``prog_bar``: show ``act <measured> sbh (paper <formula>)`` in
    :class:`~lightning_sp.ProgressBar` (the metrics are logged with ``prog_bar=False``).
    """

    PREFIX = "memory/"

    def __init__(self, log_every_n_steps: int | None = None, prog_bar: bool = True) -> None:
        super().__init__()
        self.log_every_n_steps = check_every(log_every_n_steps)
        self.prog_bar = prog_bar
        self.last_sbh: int | None = None
        self.last_peak_allocated: int | None = None
        self._tracker: SavedTensorTracker | None = None
        self._shape: tuple[int, int] | None = None
        self._documents = False
        """Whether the measured batch carries ``documents`` (a document mask)."""
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
        if not is_due(trainer, self.log_every_n_steps, trainer.global_step):
            return
        gpt = gpt_of(pl_module)
        self._shape = batch_shape(batch)
        self._documents = "documents" in batch
        self._cuda_device = None
        device = next(gpt.parameters()).device
        if device.type == "cuda":
            self._cuda_device = device
            torch.cuda.reset_peak_memory_stats(device)
        pipeline = scheduled_pipeline_of(pl_module)
        if pipeline is not None:  # the schedule runs forward and backward inside the step
            modules = {
                f"chunks.{c}.layers.{i}": layer
                for c, chunk in enumerate(pipeline.chunks)
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
            peak = torch.cuda.max_memory_allocated(self._cuda_device)  # allocator stats: no sync
            self.last_peak_allocated = peak
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
            prog_bar=False,  # ProgressBar shows progress_bar_items() instead
            on_step=True,
            on_epoch=False,
            sync_dist=False,
            batch_size=batch_size,
        )

    def progress_bar_items(self) -> dict[str, str]:
        """The last measurement, short: ``{"act": "17.0 sbh (paper 17.0)"}``, the pipeline
        stage's peak and the CUDA peak in GB; empty before the first or with prog_bar off."""
        items: dict[str, str] = {}
        if not self.prog_bar:
            return items
        if self.last_per_layer and self.last_formula and self.last_sbh:
            measured = sum(self.last_per_layer) / len(self.last_per_layer) / self.last_sbh
            paper = self.last_formula / self.last_sbh
            items["act"] = f"{measured:.1f} sbh (paper {paper:.1f})"
        if self.last_stage_peak is not None and self.last_stage_formula:
            items["stage"] = (
                f"{self.last_stage_peak / 1e9:.3g} GB (paper {self.last_stage_formula / 1e9:.3g})"
            )
        if self.last_peak_allocated is not None:
            items["peak"] = f"{self.last_peak_allocated / 1e9:.3g} GB"
        return items

    def _record(self, pl_module: LightningModule, report: ActivationReport, b: int, s: int) -> None:
        gpt = gpt_of(pl_module)
        per_layer = [report.bytes_of(f"layers.{i}") for i in range(len(gpt.layers))]
        # the paper's formula for this model: its activation dtype, which dropouts exist, its
        # FFN width, and each layer's own policy (full, else recompute_rest past the split)
        formula = self._formula_per_layer(gpt, b, s)
        self.last_per_layer, self.last_formula = per_layer, formula
        self.last_sbh = s * b * gpt.config.hidden_size
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
        weight = next(gpt.parameters())
        shape = config.activation_shape(  # s: the whole sequence; a CP rank holds s/c of it
            state.layout,
            b,
            seq_length=s,
            documents=self._documents,
            activation_bytes=weight.element_size(),
            device=weight.device,  # CUDA's kernels save more than the CPU's terms
        )
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
        pipeline = scheduled_pipeline_of(pl_module)
        if pipeline is None or not pipeline.state.is_first_stage:
            return
        gpt, n = pipeline.chunks[0], pipeline.num_microbatches
        state = gpt.state
        in_flight = layers_in_flight(
            gpt.config.num_layers, state.pipeline_parallel_size, len(pipeline.chunks), n
        )
        formula = self._formula_per_layer(gpt, b // n, s) * in_flight
        self.last_stage_peak, self.last_stage_formula = peak_bytes, formula
        self._log(pl_module, "pipeline_stage_peak_formula", formula, b)
        self._log(pl_module, "pipeline_stage_peak_ratio", peak_bytes / formula, b)
