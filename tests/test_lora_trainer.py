"""A LoRA run under a real Lightning Trainer (2 spawned CPU ranks, t = 2 + SP with the bucketed
gradient buffer, and d = 2 with the distributed optimizer): the base weights stay
bit-identical, only adapters have gradient buffers and optimizer state, the adapters move and
the loss falls."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_sp import GPTConfig, GPTModule, OptimizerConfig
from lightning_sp.model.lora import LoRAConfig, lora_parameters
from lightning_sp.optim.adamw import grad_buffer_of

from test_trainer import data, logged, trainer


class AssertOnlyAdaptersTrain(Callback):
    """Base weights at the end equal those at the start; the optimizer and gradient buffer
    hold the adapters only; every adapter moved."""

    def on_train_start(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        self.start = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_end(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        adapters = lora_parameters(pl_module)
        assert adapters, "no adapters"
        optimizer = trainer.optimizers[0]
        buffer = grad_buffer_of(optimizer)
        if buffer is not None:
            held = {id(p) for p in buffer.params}
            assert held == {id(p) for p in adapters.values()}, "the buffer holds base weights"
        for name, param in pl_module.named_parameters():
            if name in adapters:
                assert not torch.equal(param, self.start[name]), f"adapter {name} did not move"
            else:
                assert not param.requires_grad, f"{name} trains"
                assert torch.equal(param, self.start[name]), f"frozen {name} changed"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-sp", "dp2-zero1"])
def test_lora_run_trains_adapters_only(tmp_path: Path, corpus: Path, layout: str) -> None:
    config = GPTConfig.of(
        "llama", vocab_size=257, seq_length=64, hidden_size=64, num_layers=2, num_heads=4,
        ffn_hidden_size=128, recompute="selective", sequence_parallel=layout == "tp2-sp",
    )  # fmt: skip
    module = GPTModule(
        config,
        OptimizerConfig(lr=1e-2, warmup_steps=2, min_lr=1e-3),
        lora=LoRAConfig(r=4, lora_alpha=8, target_modules=["all-linear"], lora_dropout=0.1),
    )
    trainer(tmp_path, "run", layout, max_steps=12, callbacks=[AssertOnlyAdaptersTrain()],
            enable_checkpointing=False).fit(module, data(corpus))  # fmt: skip
    losses = logged(tmp_path, "run", "train/loss")
    assert losses[max(losses)] < losses[min(losses)], f"loss did not fall: {losses}"
