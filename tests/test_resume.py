"""``last.ckpt`` continues a run exactly: the checkpoint written when ``max_steps`` ends a run
mid-epoch resumes with the next unseen batch of the same epoch (not the next epoch), and the
final step is saved even when ``every_n_train_steps`` does not divide ``max_steps``."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_sp import GPTConfig, GPTModule, MegatronSPStrategy, ModelCheckpoint, OptimizerConfig
from lightning_sp.checkpoint import read_full
from lightning_sp.optim.adamw import lr_multiplier

from test_trainer import data, logged, model, trainer

EVERY, FIRST, TOTAL = 2, 5, 9  # 2 does not divide 5; all of it inside epoch 0


def _checkpoints(folder: Path) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=folder, every_n_train_steps=EVERY, save_last=True, filename="{step}"
    )


@pytest.mark.slow
def test_last_checkpoint_of_a_finished_run_continues_it_exactly(
    tmp_path: Path, corpus: Path
) -> None:
    trainer(tmp_path, "straight", "dp2", max_steps=TOTAL,
            callbacks=[_checkpoints(tmp_path / "s")]).fit(model(), data(corpus))  # fmt: skip
    trainer(tmp_path, "first", "dp2", max_steps=FIRST,
            callbacks=[_checkpoints(tmp_path / "a")]).fit(model(), data(corpus))  # fmt: skip
    last = tmp_path / "a" / "last.ckpt"
    saved = read_full(last)["lightning"]
    assert saved["global_step"] == FIRST, (
        f"the final step {FIRST} was not saved: last.ckpt holds step {saved['global_step']}"
    )
    trainer(tmp_path, "resumed", "dp2", max_steps=TOTAL,
            callbacks=[_checkpoints(tmp_path / "b")]).fit(
        model(), data(corpus), ckpt_path=str(last)
    )  # fmt: skip
    straight = logged(tmp_path, "straight", "train/loss")
    resumed = logged(tmp_path, "resumed", "train/loss")
    epochs = logged(tmp_path, "resumed", "epoch")
    assert min(resumed) == FIRST and max(resumed) == TOTAL - 1, sorted(resumed)
    assert all(epoch == 0 for epoch in epochs.values()), f"the resume left epoch 0: {epochs}"
    for step in range(FIRST, TOTAL):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6), (
            f"step {step}: resumed from last.ckpt {resumed[step]:.6f}, straight "
            f"{straight[step]:.6f}"
        )


# -- resume with other optimizer settings (lightning_sp.optim.resume) --------------------


class FirstStepSettings(Callback):
    """The optimizer's and scheduler's settings as the first step of a fit uses them."""

    def __init__(self) -> None:
        self.seen: dict[str, list] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if self.seen is None:
            scheduler = trainer.lr_scheduler_configs[0].scheduler
            groups = trainer.optimizers[0].param_groups
            self.seen = {
                "lr": [g["lr"] for g in groups],
                "weight_decay": [g["weight_decay"] for g in groups],
                "betas": [g["betas"] for g in groups],
                "base_lrs": list(scheduler.base_lrs),  # type: ignore[attr-defined]
            }


class Notices(logging.Handler):
    """The lines Lightning's ``rank_zero_info`` logs while installed (``with Notices() as n``),
    wherever its logger's records would otherwise go (stderr, or pytest's log capture)."""

    LOGGER = "lightning.pytorch.utilities.rank_zero"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> Notices:
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)

    def containing(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]


def _one_process(tmp_path: Path, name: str, max_steps: int, callbacks: list) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronSPStrategy(tensor_parallel_size=1),
        max_steps=max_steps, logger=CSVLogger(tmp_path, name=name, version=0),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )  # fmt: skip


def _module(optimizer: OptimizerConfig) -> GPTModule:
    config = GPTConfig(vocab_size=257, seq_length=64, hidden_size=32, num_layers=1, num_heads=2)
    return GPTModule(config, optimizer)


@pytest.mark.slow
def test_resume_applies_the_command_lines_optimizer_settings(tmp_path: Path, corpus: Path) -> None:
    saved = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.1)
    changed = dataclasses.replace(saved, lr=1e-3, weight_decay=0.01, beta2=0.9)
    # decay_steps unset: the schedule decays over max_steps, 3 in the run that saved, 5 after;
    # the resumed step's learning rate must be recomputed for the losses to equal the straight run's
    k, total = 3, 5
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, save_top_k=0)
    _one_process(tmp_path, "straight", total, []).fit(_module(saved), data(corpus))
    _one_process(tmp_path, "first", k, [checkpoints]).fit(_module(saved), data(corpus))
    last = str(tmp_path / "ck" / "last.ckpt")

    same = FirstStepSettings()
    with Notices() as notices:
        _one_process(tmp_path, "same", total, [same]).fit(
            _module(saved), data(corpus), ckpt_path=last
        )
    assert not notices.containing("differ from the checkpoint"), notices.lines
    straight, resumed = (
        logged(tmp_path, "straight", "train/loss"),
        logged(tmp_path, "same", "train/loss"),
    )
    assert sorted(resumed) == list(range(k, total))
    for step in resumed:
        assert resumed[step] == straight[step], f"step {step}: {resumed[step]} != {straight[step]}"

    other = FirstStepSettings()
    with Notices() as notices:
        _one_process(tmp_path, "other", total, [other]).fit(
            _module(changed), data(corpus), ckpt_path=last
        )
    lines = notices.containing("differ from the checkpoint")
    assert len(lines) == 1, notices.lines
    notice = lines[0]
    for field in ("lr 0.003 -> 0.001", "weight_decay 0.1 -> 0.01", "beta2 0.95 -> 0.9"):
        assert field in notice, notice
    assert "min_lr" not in notice and f"step {k}" in notice, notice
    factor = lr_multiplier(k, changed.lr, changed.min_lr, changed.warmup_steps, total)
    before = {key: saved_value for key, saved_value in (same.seen or {}).items()}
    assert other.seen is not None and before
    assert other.seen["base_lrs"] == [changed.lr] * len(other.seen["lr"])
    assert other.seen["lr"] == [changed.lr * factor] * len(other.seen["lr"])
    assert other.seen["weight_decay"] == [changed.weight_decay, 0.0]
    assert other.seen["betas"] == [(changed.beta1, changed.beta2)] * 2
    # the same resume with the checkpoint's settings used the checkpoint's: what changed is ours
    assert before["lr"] == [saved.lr * lr_multiplier(k, saved.lr, saved.min_lr, 2, total)] * 2
    assert before["weight_decay"] == [saved.weight_decay, 0.0]


@pytest.mark.slow
def test_a_second_run_into_one_checkpoint_directory_is_named(tmp_path: Path, corpus: Path) -> None:
    optimizer = OptimizerConfig(lr=3e-3, warmup_steps=1)
    lines = []
    for run in ("a", "b"):
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, save_top_k=0)
        with Notices() as notices:
            _one_process(tmp_path, run, 1, [checkpoints]).fit(_module(optimizer), data(corpus))
        lines.append(notices.containing("from another run"))
    assert lines[0] == [], lines
    assert len(lines[1]) == 1 and "already holds last.ckpt" in lines[1][0], lines
    assert "last-v1.ckpt" in lines[1][0], lines
    names = sorted(p.name for p in (tmp_path / "ck").iterdir() if not p.name.startswith("."))
    assert names == ["last-v1.ckpt", "last.ckpt"]  # hidden: the checkpoints' data directories
