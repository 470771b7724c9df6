"""``cli.py fit`` against a plain loop over the same ``GPTModule`` (for :mod:`benchmarks.gpu`).

Both train the same model (``recompute: selective``, bf16 weights with fp32 master AdamW) on the
same batches of :class:`~lightning_sp.data.TextDataModule` (the standard-library
corpus, byte-level). The Trainer side is built by the CLI's own class (``GPTCLI``: its parser,
defaults and loggers), with ``strategy: megatron_sp``, ``precision: bf16-true``, the
ActivationMemoryMonitor, the MFUMonitor and the ProgressBar, as a configured run has them. The
loop side: forward, backward, ``optimizer.step()``, scheduler step, ``zero_grad``. Each is
timed from the start of step ``warmup`` to the end of the last step, synchronised only there.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_sp.data import TextDataModule
from lightning_sp.optim.adamw import configure_adamw
from lightning_sp.training.gpt_module import GPTModule


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepWindow(Callback):
    """Wall time from the start of training step ``warmup`` to the end of the last one."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.warmup and self.start is None:
            _synchronize(pl_module.device)
            self.start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self.start is not None:
            self.steps += 1
        if trainer.global_step == trainer.max_steps:
            _synchronize(pl_module.device)
            self.end = time.perf_counter()


def _fit_tokens_per_sec(shape: Any, args: argparse.Namespace, total: int) -> float:
    from lightning_sp.cli.fit import GPTCLI

    accelerator = "gpu" if args.device == "cuda" else "cpu"
    argv = [
        f"--model.config.vocab_size={shape.vocab}", f"--model.config.seq_length={shape.s}",
        f"--model.config.hidden_size={shape.h}", f"--model.config.num_layers={shape.layers}",
        f"--model.config.num_heads={shape.heads}", "--model.config.recompute=selective",
        f"--model.config.hidden_dropout={args.dropout}",
        f"--model.config.attention_dropout={args.dropout}",
        f"--data.batch_size={shape.b}", f"--trainer.accelerator={accelerator}",
        "--trainer.devices=1", "--trainer.strategy=megatron_sp",
        "--trainer.precision=bf16-true", f"--trainer.max_steps={total}",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_checkpointing=false", "--trainer.log_every_n_steps=10",
        "--trainer.callbacks+=lightning_sp.ActivationMemoryMonitor",
        "--trainer.callbacks+=lightning_sp.MFUMonitor",
    ]  # fmt: skip
    cli = GPTCLI(GPTModule, TextDataModule, args=argv, run=False)
    window = StepWindow(args.warmup)
    cli.trainer.callbacks.append(window)  # type: ignore[attr-defined]
    cli.trainer.fit(cli.model, cli.datamodule)
    assert window.start is not None and window.end is not None
    return window.steps * shape.b * shape.s / (window.end - window.start)


def _loop_tokens_per_sec(shape: Any, args: argparse.Namespace, total: int) -> float:
    device = torch.device(args.device)
    config = shape.config(
        recompute="selective", hidden_dropout=args.dropout, attention_dropout=args.dropout
    )
    module = GPTModule(config).to(device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as precision="bf16-true" builds it
    try:
        module.configure_model()
    finally:
        torch.set_default_dtype(default)
    (gpt,) = module.chunks  # t = p = 1: one GPT chunk
    optimizers = configure_adamw(gpt, module.optimizer_config, total)
    optimizer, schedule = optimizers["optimizer"], optimizers["lr_scheduler"]
    scheduler = schedule["scheduler"] if isinstance(schedule, dict) else schedule
    data = TextDataModule(seq_length=shape.s, batch_size=shape.b)
    data.prepare_data()
    data.setup("fit")
    start = None
    for step, batch in enumerate(data.train_dataloader()):
        if step == args.warmup:
            _synchronize(device)
            start = time.perf_counter()
        if step == total:
            break
        ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        gpt(ids, labels).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    _synchronize(device)
    assert start is not None, "the corpus has fewer batches than the benchmark's steps"
    return (total - args.warmup) * shape.b * shape.s / (time.perf_counter() - start)


def fit_section(shape: Any, args: argparse.Namespace) -> dict[str, Any]:
    """tokens/s of ``cli.py fit`` and of the plain loop, and their ratio."""
    total = args.warmup + args.steps
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:  # the CLI's logs and saved config go here
        os.chdir(tmp)
        try:
            fit = _fit_tokens_per_sec(shape, args, total)
        finally:
            os.chdir(cwd)
    loop = _loop_tokens_per_sec(shape, args, total)
    return {
        "recompute": "selective",
        "fit_tokens_per_sec": fit,
        "loop_tokens_per_sec": loop,
        "ratio": fit / loop,
    }
