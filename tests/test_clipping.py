"""Gradient clipping under a real Trainer clips by the global norm in every optimizer layout:
data parallelism with the distributed optimizer (each rank holds 1/d of the reduced gradient)
trains and logs exactly as plain data parallelism, with a clip value small enough to bite at
every step."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_sp import MegatronSPStrategy

from test_trainer import LAYOUTS, data, logged, model

CLIP = 0.05
STEPS = 6


def _run(tmp_path: Path, corpus: Path, layout: str) -> tuple[dict[int, float], dict[int, float]]:
    devices, strategy = LAYOUTS[layout]
    trainer = L.Trainer(
        accelerator="cpu", devices=devices,
        strategy=MegatronSPStrategy(**strategy, start_method="spawn"),
        max_steps=STEPS, logger=CSVLogger(tmp_path, name=layout, version=0),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
        gradient_clip_val=CLIP,
    )  # fmt: skip
    trainer.fit(model(hidden_dropout=0.0, attention_dropout=0.0), data(corpus))
    return logged(tmp_path, layout, "train/loss"), logged(tmp_path, layout, "train/grad_norm")


@pytest.mark.slow
def test_distributed_optimizer_clips_by_the_global_norm(tmp_path: Path, corpus: Path) -> None:
    losses, norms = _run(tmp_path, corpus, "dp2")
    zero_losses, zero_norms = _run(tmp_path, corpus, "dp2-zero1")
    assert sorted(norms) == sorted(zero_norms) == list(range(STEPS))
    assert all(norm > 2 * CLIP for norm in norms.values()), f"clipping does not bite: {norms}"
    for step in range(STEPS):
        assert zero_norms[step] == pytest.approx(norms[step], rel=1e-5), (
            f"step {step}: the distributed optimizer logged train/grad_norm "
            f"{zero_norms[step]:.6g}, plain data parallelism {norms[step]:.6g} "
            "(not the global norm)"
        )
        assert zero_losses[step] == pytest.approx(losses[step], rel=1e-5), (
            f"step {step}: the distributed optimizer's loss {zero_losses[step]:.6g} differs from "
            f"plain data parallelism's {losses[step]:.6g} (clipped by another norm)"
        )
