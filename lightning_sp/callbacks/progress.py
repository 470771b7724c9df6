"""``ProgressBar``: Lightning's TQDM bar with short names and units.

``loss=2.531, act=17.0 sbh (paper 17.0), MFU=38%, tok/s=12.3k`` instead of raw metric names
and numbers. The loggers keep the raw metrics: the lightning_sp monitors log them with
``prog_bar=False`` and offer formatted values through ``progress_bar_items()``, which this bar
collects from every callback that has it.

Reading logged tensors for display synchronises host and device (``.item()``), so the items
are refreshed on logging steps only (every trainer ``log_every_n_steps``) and at the end of
validation; between them the bar shows the last values. Lightning converts every metric logged
with ``prog_bar=True`` at the end of *every* step, so ``GPTModule`` logs ``train/loss`` without
it and this bar reads it (:data:`PULLED`) from ``trainer.callback_metrics`` on its refresh steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

__all__ = ["ProgressBar"]


@dataclass(frozen=True)
class Shown:
    """How one logged metric appears in the bar: a short label and a formatter."""

    label: str
    format: Callable[[float], str]


SHOWN: dict[str, Shown] = {
    "train/loss": Shown("loss", "{:.3f}".format),
    "val/loss": Shown("val loss", "{:.3f}".format),
    "val/ppl": Shown("ppl", "{:.1f}".format),
    "train/grad_norm": Shown("|g|", "{:.2f}".format),
}
"""Metrics logged with ``prog_bar=True`` that the bar renames; others pass through as logged."""

PULLED = ("train/loss",)
"""Metrics logged without ``prog_bar`` (so that no step reads them to the host) that the bar
shows anyway, read from ``trainer.callback_metrics`` when it refreshes."""


def si_format(value: float) -> str:
    """``12345.0 -> '12.3k'``: three significant figures with k / M / G."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


class ProgressBar(TQDMProgressBar):
    """A :class:`~lightning.pytorch.callbacks.TQDMProgressBar` that shows short names and
    units (see module docstring). Arguments as TQDMProgressBar's."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self._items: dict[str, Any] = {}
        self._refreshed_step: int | None = None

    def _due(self, trainer: Trainer) -> bool:
        if not trainer.training or trainer.sanity_checking:
            return True  # end of validation / other stages: not the training hot path
        step = trainer.global_step
        if step == self._refreshed_step:
            return False
        # global_step counts finished optimizer steps: step - 1 is the one that just ended
        return (step - 1) % max(1, getattr(trainer, "log_every_n_steps", 1)) == 0 or not self._items

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        if not self._due(trainer):
            return self._items
        self._refreshed_step = trainer.global_step if trainer.training else None
        items: dict[str, Any] = {}
        metrics = super().get_metrics(trainer, pl_module)
        logged = trainer.callback_metrics
        for name in PULLED:
            if name not in metrics and name in logged:
                metrics[name] = float(logged[name])
        for name, value in metrics.items():
            shown = SHOWN.get(name)
            if shown is not None and isinstance(value, int | float):
                items[shown.label] = shown.format(value)
            else:
                items[name] = value
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            describe = getattr(callback, "progress_bar_items", None)
            if callable(describe):
                items.update(describe())
        self._items = items
        return items
