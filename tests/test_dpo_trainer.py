"""DPO under a real Lightning Trainer (one process): ``GPTModule(dpo=...)`` on preference
data prepared by ``TextDataModule(preference=True)``, with a frozen copy as the reference,
with LoRA (adapters off as the reference) and with the reference precomputed into the
prepared data: TRL's metrics are logged for training and
validation, the first step's rewards are 0 (policy = reference), and training on the pairs
raises the held-out reward accuracy; the trained policy's export generates in transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_sp import GPTModule, OptimizerConfig
from lightning_sp.data import TextDataModule
from lightning_sp.interop.hf_export import save_hf
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.lora import LoRAConfig
from lightning_sp.training.preference import METRICS, DPOConfig

from corpora import chat_tokenizer, jsonl
from hf_models import llama_config

SEQ = 96
STEPS, LR = 12, 1e-2  # optimizer steps (of two accumulated batches) and a constant rate
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


def run(module: GPTModule, data: TextDataModule) -> tuple[dict, dict, dict]:
    """Validate, train, validate: the held-out metrics before and after and the last training
    step's."""
    logged = Logged()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_steps=STEPS,
        val_check_interval=STEPS, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        accumulate_grad_batches=2, callbacks=[logged],
    )  # fmt: skip
    trainer.validate(module, datamodule=data)
    before = dict(logged.val[-1])
    trainer.fit(module, datamodule=data)
    return before, logged.val[-1], logged.train[-1]


@pytest.mark.slow
def test_dpo_run_logs_trl_metrics_and_learns(tmp_path: Path) -> None:
    """The three references (a frozen copy; LoRA with adapters off; log-probabilities
    precomputed into the prepared data) on one prepared data set."""
    tokenizer_dir = chat_tokenizer(tmp_path)
    rows = jsonl(tmp_path / "pairs.jsonl", pairs(60))
    data = TextDataModule(paths=str(rows), chat_template_dir=str(tokenizer_dir),
                          prepared_dir=str(tmp_path / "p"), seq_length=SEQ, batch_size=4,
                          val_fraction=0.2, preference=True)  # fmt: skip
    config = llama_config(vocab_size=128, seq_length=SEQ, hidden_size=32, num_layers=1,
                          ffn_hidden_size=64, hidden_dropout=0.0,
                          attention_dropout=0.0)  # fmt: skip
    for what in ("copy", "adapters", "precomputed"):
        L.seed_everything(0)
        lora = what == "adapters"
        module = GPTModule(
            config, OptimizerConfig(lr=LR, min_lr=LR, warmup_steps=0, weight_decay=0.0),
            lora=LoRAConfig(r=8, target_modules=["all-linear"]) if lora else None,
            dpo=DPOConfig(beta=0.5, reference=what),
        )  # fmt: skip
        before, after, train = run(module, data)
        for name in ("loss", *METRICS):
            assert f"val/{name}" in before, f"{what}: val/{name} not logged: {sorted(before)}"
            assert f"train/{name}" in train or name == "loss", f"{what}: train/{name}"
        assert before["val/rewards/margins"] == 0.0, f"{what}: policy = reference, margin {before}"
        assert abs(before["val/loss"] - 0.6931471805599453) < 1e-6, f"{what}: log 2 at the start"
        assert after["val/rewards/accuracies"] > 0.8, f"{what}: held-out accuracy {after}"
        assert after["val/rewards/margins"] > 0.5, f"{what}: held-out margins {after}"
        if what == "copy":
            generates_in_transformers(module, config, tokenizer_dir, tmp_path / "export")


def generates_in_transformers(
    module: GPTModule, config: GPTConfig, tokenizer_dir: Path, out: Path
) -> None:
    """The trained policy exported in Hugging Face format answers a chat prompt through
    transformers' ``apply_chat_template`` + ``generate``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chunk = module.chunks[0]
    tensors = (
        (chunk.global_name(name),
         p.detach()[: config.vocab_size] if getattr(p, "padded_vocab", False) else p.detach())
        for name, p in chunk.named_parameters()
    )  # fmt: skip
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    save_hf(config, tensors, out, eos_token_id=hf.eos_token_id,
            tokenizer_file=tokenizer_dir / "tokenizer.json", eos_token=hf.eos_token)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    prompt = tokenizer.apply_chat_template(
        pairs(1)[0]["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1], "the export generates nothing"
