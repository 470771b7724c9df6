"""``last.ckpt`` continues a run exactly: the checkpoint written when ``max_steps`` ends a run
mid-epoch resumes with the next unseen batch of the same epoch (not the next epoch), and the
final step is saved even when ``every_n_train_steps`` does not divide ``max_steps``."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sp import ModelCheckpoint
from lightning_sp.training.checkpoint import read_full

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
