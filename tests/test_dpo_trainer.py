"""DPO under a real Lightning Trainer (one process): ``GPTModule(dpo=...)`` on preference
data prepared by ``TextDataModule(preference=True)``, with a frozen copy as the reference
and with LoRA (adapters off as the reference): TRL's metrics are logged for training and
validation, the first step's rewards are 0 (policy = reference), and training on the pairs
raises the held-out reward accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_sp import GPTModule, OptimizerConfig
from lightning_sp.data import TextDataModule
from lightning_sp.model.lora import LoRAConfig
from lightning_sp.training.preference import METRICS, DPOConfig

from corpora import chat_tokenizer, jsonl
from hf_models import llama_config

SEQ = 96
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def pairs(n: int) -> list[dict[str, Any]]:
    """Right against wrong answers to small sums."""
    rows = []
    for i in range(n):
        a, b = i % 5, (i * 7) % 5
        prompt = [{"role": "user", "content": f"{WORDS[a]} plus {WORDS[b]} ?"}]
        right, wrong = WORDS[a + b], WORDS[(a + b + 1 + i % 3) % 10]
        rows.append({"prompt": prompt,
                     "chosen": [{"role": "assistant", "content": right}],
                     "rejected": [{"role": "assistant", "content": wrong}]})  # fmt: skip
    return rows


class Logged(Callback):
    def __init__(self) -> None:
        self.train: list[dict[str, float]] = []
        self.val: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.train.append({k: float(v) for k, v in trainer.callback_metrics.items()
                           if k.startswith("train/")})  # fmt: skip

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.val.append({k: float(v) for k, v in trainer.callback_metrics.items()
                         if k.startswith("val/")})  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["copy", "lora"])
def test_dpo_run_logs_trl_metrics_and_learns(tmp_path: Path, lora: bool) -> None:
    tokenizer_dir = chat_tokenizer(tmp_path)
    rows = jsonl(tmp_path / "pairs.jsonl", pairs(60))
    data = TextDataModule(paths=str(rows), chat_template_dir=str(tokenizer_dir),
                          prepared_dir=str(tmp_path / "p"), seq_length=SEQ, batch_size=4,
                          val_fraction=0.2, preference=True)  # fmt: skip
    config = llama_config(vocab_size=128, seq_length=SEQ, hidden_dropout=0.0,
                          attention_dropout=0.0)  # fmt: skip
    module = GPTModule(
        config, OptimizerConfig(lr=3e-3, min_lr=3e-3, warmup_steps=0, weight_decay=0.0),
        lora=LoRAConfig(r=8, target_modules=["all-linear"]) if lora else None,
        dpo=DPOConfig(beta=0.5),
    )  # fmt: skip
    logged = Logged()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_steps=40,
        val_check_interval=20, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        accumulate_grad_batches=2,
        callbacks=[logged],
    )  # fmt: skip
    trainer.validate(module, datamodule=data)
    before = dict(logged.val[-1])
    trainer.fit(module, datamodule=data)
    after = logged.val[-1]
    what = "lora" if lora else "copy"
    for name in ("loss", *METRICS):
        assert f"val/{name}" in before, f"{what}: val/{name} not logged: {sorted(before)}"
        assert f"train/{name}" in logged.train[-1] or name == "loss", f"{what}: train/{name}"
    assert before["val/rewards/margins"] == 0.0, f"{what}: policy = reference, margin {before}"
    assert abs(before["val/loss"] - 0.6931471805599453) < 1e-6, f"{what}: log 2 at the start"
    assert after["val/rewards/accuracies"] > 0.8, f"{what}: held-out accuracy {after}"
    assert after["val/rewards/margins"] > 0.5, f"{what}: held-out margins {after}"
