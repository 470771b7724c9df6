"""Host reads of tensor values in a training step (:mod:`lightning_sp.testing.host_reads`): on a
GPU each is a host-device synchronisation, after which Lightning's per-step CPU work stops
overlapping the device's. A ``fit`` step with the monitors and the progress bar makes one (the
non-finite guard's decision) outside logging steps; the counter sees ``.item()`` and ``bool``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_sp import (
    ActivationMemoryMonitor,
    GPTConfig,
    GPTModule,
    MegatronSPStrategy,
    MFUMonitor,
    ProgressBar,
)
from lightning_sp.testing.host_reads import HostReads

STEPS, LOG_EVERY = 7, 5


class Tokens(torch.utils.data.Dataset):
    """``length`` seeded random samples ``{"input_ids": [s], "labels": [s]}``."""

    def __init__(self, length: int, config: GPTConfig) -> None:
        generator = torch.Generator().manual_seed(0)
        shape = (length, config.seq_length + 1)
        self.tokens = torch.randint(0, config.vocab_size, shape, generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index, :-1], "labels": self.tokens[index, 1:]}


def test_the_counter_sees_item_and_bool() -> None:
    x = torch.ones(3)
    with HostReads() as reads:
        x.sum().item()
        bool(x.all())
        y = x * 2  # no read
    assert reads.total == 2 and y.shape == (3,), f"counted {dict(reads.reads)}"


class StepReads(L.Callback):
    """A :class:`HostReads` from each step's start to the next one's."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, HostReads]] = []
        self._mode: HostReads | None = None

    def _close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._close()
        self._mode = HostReads()
        self._mode.__enter__()
        self.steps.append((trainer.global_step, self._mode))

    def on_train_end(self, *args: Any) -> None:
        self._close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_fit_step_reads_the_device_once_outside_logging_steps(
    tmp_path: Path, clip: float | None
) -> None:
    config = GPTConfig(vocab_size=64, seq_length=16, hidden_size=32, num_layers=2, num_heads=4,
                       recompute="selective")  # fmt: skip
    counter, bar = StepReads(), ProgressBar()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronSPStrategy(), max_steps=STEPS,
        logger=CSVLogger(tmp_path), log_every_n_steps=LOG_EVERY, enable_checkpointing=False,
        gradient_clip_val=clip, enable_model_summary=False,
        callbacks=[counter, bar, ActivationMemoryMonitor(), MFUMonitor(window_size=2)],
    )  # fmt: skip
    data = torch.utils.data.DataLoader(Tokens(2 * STEPS, config), batch_size=2)
    module = GPTModule(config)
    trainer.fit(module, data)
    shown = bar.get_metrics(trainer, module)
    assert "loss" in shown, f"the bar no longer shows the training loss: {shown}"
    # a step's reads: from its start to the next one's (the last step's are cut by on_train_end)
    quiet = [
        (step, reads)
        for step, reads in counter.steps[1:-1]
        if step % LOG_EVERY != 0 and (step + 1) % LOG_EVERY != 0
    ]
    assert quiet, "no step outside the logging steps was counted"
    for step, reads in quiet:
        assert reads.total == 1, f"step {step}: {reads.total} host reads, {dict(reads.reads)}"
        (where,) = reads.reads
        assert "guard.py" in where, f"step {step}: the one read is not the guard's: {where}"
