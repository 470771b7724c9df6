"""``lightning_sp.ModelCheckpoint``: Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` always
continues the run exactly.

Lightning saves on ``every_n_train_steps`` only; when ``max_steps`` is not a multiple of it
the last steps of a run are never saved (every 2, max 5: ``last.ckpt`` holds step 4), and a
save at the end of training records the epoch as finished, so a resume from it skips the rest
of the epoch. This subclass also saves (top-k and ``last``) at the end of the step that ends
the run, from ``on_train_batch_end`` like any scheduled save, so the checkpoint holds the
mid-epoch position and the resumed run continues with the next unseen batch. "The step that
ends the run" is ``max_steps`` or a stop requested during the step (``trainer.should_stop``,
as a preemption signal sets it: :mod:`lightning_sp.training.shutdown`).

``cli.py`` uses this class wherever a config names Lightning's ``ModelCheckpoint``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl


def ends_the_run(trainer: pl.Trainer) -> bool:
    """Whether the optimizer step just finished is the last of this ``fit``."""
    return trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments) that also saves the step that ends the
    run (see the module docstring)."""

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not ends_the_run(trainer) or self._should_skip_saving_checkpoint(trainer):
            return  # not the end, or saved at this step already
        candidates = self._monitor_candidates(trainer)
        if self.monitor is None or self.monitor in candidates:
            self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
