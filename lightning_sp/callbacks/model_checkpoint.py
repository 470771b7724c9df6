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

No run replaces or deletes another run's checkpoint. Lightning restores, with the checkpoint
a run resumes from, the names of that run's files (``last_model_path``, the top-k), and then
overwrites ``last.ckpt`` and deletes the old top-k as its own, even when another run has
written them since (two runs resumed from one checkpoint into one directory: the second
deleted the first's only checkpoint). Here a resumed run keeps those names only when it
continues that run in place (it resumes from the checkpoint ``last.ckpt`` still points to, or
one of the restored top-k when there is no ``last``); otherwise it forgets them, so that its
files get names of their own (``-vN``, said in one line), and it deletes only files it wrote
itself or kept in place.

``cli.py`` uses this class wherever a config names Lightning's ``ModelCheckpoint``.
"""

from __future__ import annotations

import copy
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
    _clash: str | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._fresh = self._run_state()  # before a resume restores another run's names
        self._owned: set[str] = set()  # files this run may replace or delete
        with ranks_agree():
            if self.dirpath is not None and stage == "fit":
                check_writable("ModelCheckpoint dirpath", str(self.dirpath))

    def _run_state(self) -> dict[str, Any]:
        """The names and scores Lightning restores from a resumed checkpoint."""
        names = ("best_k_models", "kth_best_model_path", "kth_value", "best_model_path",
                 "best_model_score", "last_model_path")  # fmt: skip
        return {name: copy.copy(getattr(self, name)) for name in names}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep the restored names only if this run continues their run in place (the module
        docstring); agreed from rank 0's view of the directory."""
        super().on_train_start(trainer, pl_module)
        restored = [
            p for p in (self.last_model_path, *self.best_k_models, self.best_model_path) if p
        ]
        if not restored:
            return
        in_place = trainer.strategy.broadcast(self._continues_in_place(trainer), src=0)
        if in_place:
            self._owned.update(str(p) for p in restored)
            return
        for name, value in self._fresh.items():
            setattr(self, name, copy.copy(value))

    def _continues_in_place(self, trainer: pl.Trainer) -> bool:
        """Whether ``trainer.ckpt_path`` is the newest checkpoint of the restored run: the one
        its ``last`` name points to now (or, without ``last``, one of its top-k)."""
        if trainer.ckpt_path is None:
            return False
        resumed = os.path.realpath(trainer.ckpt_path)
        if self.last_model_path:
            last = self.last_model_path
            return os.path.lexists(last) and os.path.realpath(last) == resumed
        return any(os.path.realpath(p) == resumed for p in self.best_k_models)

    def _say_versioned(self, filepath: str) -> None:
        """Say once that Lightning gave ``filepath`` a ``-vN`` name (a clash was found)."""
        if self._clash is not None and not self._versioned_notice:
            self._versioned_notice = True
            rank_zero_info(
                f"ModelCheckpoint: {self.dirpath} already holds {self._clash} from another run; "
                f"this run's checkpoints get -vN names ({os.path.basename(filepath)}); give a "
                "fresh dirpath, or continue that run with --ckpt_path"
            )
        self._clash = None

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        self._owned.add(str(filepath))
        self._say_versioned(filepath)
        super()._save_checkpoint(trainer, filepath)

    @override
    def _save_last_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]
    ) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.last_model_path:  # written, or (save_last="link") linked: this run's
            self._owned.add(str(self.last_model_path))
            self._say_versioned(str(self.last_model_path))  # a link saves nothing itself

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Delete only a file this run wrote or continues (never another run's)."""
        if str(filepath) in self._owned:
            self._owned.discard(str(filepath))
            super()._remove_checkpoint(trainer, filepath)

    @override
    def format_checkpoint_name(
        self,
        metrics: dict[str, Tensor],
        filename: str | None = None,
        ver: int | None = None,
        prefix: str | None = None,
    ) -> str:
        name = super().format_checkpoint_name(metrics, filename, ver, prefix)
        if ver is not None and not self._versioned_notice and self._clash is None:
            self._clash = os.path.basename(  # said once the free name is found: _save_checkpoint
                super().format_checkpoint_name(metrics, filename, None, prefix)
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
