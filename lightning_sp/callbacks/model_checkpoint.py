"""``lightning_sp.ModelCheckpoint``: Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` always
continues the run exactly.

Lightning saves on ``every_n_train_steps`` only; when ``max_steps`` is not a multiple of it
the last steps of a run are never saved (every 2, max 5: ``last.ckpt`` holds step 4), and a
save at the end of training records the epoch as finished, so a resume from it skips the rest
of the epoch. This subclass also saves (top-k and ``last``) at the end of the step that ends
the run, from ``on_train_batch_end`` like any scheduled save, so the checkpoint holds the
mid-epoch position and the resumed run continues with the next unseen batch. "The step that
ends the run" is ``max_steps`` or a stop requested during the step (``trainer.should_stop``,
as a preemption signal sets it: :mod:`lightning_sp.runtime.shutdown`).

It also says what Lightning does silently: when ``dirpath`` already holds a file of this
run's name (an earlier run wrote into the same directory), Lightning names this run's files
``-v1`` (``last-v1.ckpt``); one line says so, once. And in ``setup`` every rank checks that
``dirpath`` can be written, agreed by all ranks (:mod:`lightning_sp.runtime.agree`): one
line, once, instead of a traceback per rank at the first save.

``cli.py`` uses this class wherever a config names Lightning's ``ModelCheckpoint``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_sp.errors import check_writable
from lightning_sp.runtime.agree import ranks_agree

if TYPE_CHECKING:
    import lightning.pytorch as pl


def ends_the_run(trainer: pl.Trainer) -> bool:
    """Whether the optimizer step just finished is the last of this ``fit``."""
    return trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments) that also saves the step that ends the
    run, says when its names get ``-vN`` versions, and checks ``dirpath`` on every rank (see
    the module docstring)."""

    _versioned_notice = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        with ranks_agree():
            if self.dirpath is not None and stage == "fit":
                check_writable("ModelCheckpoint dirpath", str(self.dirpath))

    @override
    def format_checkpoint_name(
        self,
        metrics: dict[str, Tensor],
        filename: str | None = None,
        ver: int | None = None,
        prefix: str | None = None,
    ) -> str:
        name = super().format_checkpoint_name(metrics, filename, ver, prefix)
        if ver is not None and not self._versioned_notice:  # Lightning found a name clash
            self._versioned_notice = True
            taken = os.path.basename(
                super().format_checkpoint_name(metrics, filename, None, prefix)
            )
            rank_zero_info(
                f"ModelCheckpoint: {self.dirpath} already holds {taken} from another run; "
                f"this run's checkpoints get -vN names ({os.path.basename(name)}); give a "
                "fresh dirpath, or continue that run with --ckpt_path"
            )
        return name

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
