"""What the training callbacks (:mod:`~lightning_sp.callbacks.memory`,
:mod:`~lightning_sp.callbacks.throughput`) read from a run: the module's GPT or pipeline, a
batch's shape, and whether a step is one they measure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from lightning_sp.errors import positive_int
from lightning_sp.model.gpt import GPT
from lightning_sp.pipeline import Pipeline
from lightning_sp.training.protocol import stage_model_of


def pipeline_of(pl_module: LightningModule) -> Pipeline | None:
    """The module's stage model when it is a :class:`Pipeline` (e.g. ``GPTModule``)."""
    stage = stage_model_of(pl_module)
    return stage if isinstance(stage, Pipeline) else None


def scheduled_pipeline_of(pl_module: LightningModule) -> Pipeline | None:
    """The module's pipeline when its schedule runs forward and backward inside the step."""
    pipeline = pipeline_of(pl_module)
    return pipeline if pipeline is not None and pipeline.runs_backward else None


def gpt_of(pl_module: LightningModule) -> GPT:
    """The module's GPT: its pipeline's first model chunk (every chunk has the same config
    and parallel state), or the bare ``gpt`` of a module of one's own."""
    pipeline = pipeline_of(pl_module)
    if pipeline is not None:
        return pipeline.chunks[0]
    gpt = getattr(pl_module, "gpt", None)
    if not isinstance(gpt, GPT):
        raise AttributeError(
            f"{type(pl_module).__name__} has neither a stage_model() that is a lightning_sp "
            "Pipeline nor an attribute `gpt` holding a lightning_sp.GPT; the lightning_sp "
            "callbacks need one (build it in configure_model)"
        )
    return gpt


def batch_shape(batch: Any) -> tuple[int, int]:
    """``(b, s)`` of a batch ``{"input_ids": [b, s], ...}``."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(
            "expected a batch {'input_ids': LongTensor[b, s], 'labels': LongTensor[b, s]}, "
            f"got {type(batch).__name__}"
        )
    b, s = batch["input_ids"].shape
    return int(b), int(s)


def check_every(log_every_n_steps: int | None) -> int | None:
    """A callback's ``log_every_n_steps`` argument: ``None`` (the trainer's) or positive."""
    if log_every_n_steps is None:
        return None
    return positive_int("log_every_n_steps", log_every_n_steps)


def is_due(trainer: Trainer, log_every_n_steps: int | None, step: int) -> bool:
    """Whether optimizer step ``step`` is measured: every ``log_every_n_steps`` steps
    (``None``: the trainer's ``log_every_n_steps``)."""
    every: int = (  # the Trainer sets log_every_n_steps on itself
        log_every_n_steps if log_every_n_steps else int(getattr(trainer, "log_every_n_steps", 1))
    )
    return step % max(1, every) == 0
