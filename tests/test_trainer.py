"""The strategy under a real Lightning Trainer: 2 spawned CPU ranks, real data, real logs,
real checkpoints."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_sp import ConfigError, GPTConfig, GPTModule, MegatronSPStrategy, OptimizerConfig
from lightning_sp.checkpoint import read_full
from lightning_sp.data import TextDataModule


class AssertReplicasInSync(Callback):
    """At the end of training every parameter equals its replicas: across DP ranks (all
    parameters) and across TP ranks (parameters replicated over TP)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        state = trainer.strategy.parallel_state
        for name, p in pl_module.stage_model().named_parameters():
            groups = [state.dp_group]
            if p.shard.dim is None:
                groups.append(state.tp_group)
            for group in groups:
                if group is None:
                    continue
                copies = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
                dist.all_gather(copies, p.detach().contiguous(), group=group)
                assert all(torch.equal(c, copies[0]) for c in copies), f"{name} diverged"


def model(**overrides: Any) -> GPTModule:
    fields = dict(
        vocab_size=257, seq_length=64, hidden_size=64, num_layers=2, num_heads=4,
        hidden_dropout=0.1, attention_dropout=0.1, recompute="selective", sequence_parallel=True,
    )  # fmt: skip
    fields.update(overrides)
    return GPTModule(GPTConfig(**fields), OptimizerConfig(lr=3e-3, warmup_steps=5, min_lr=3e-4))


LAYOUTS = {  # name -> (devices, strategy arguments)
    "tp2-sp": (2, {"tensor_parallel_size": 2}),
    "dp2": (2, {"tensor_parallel_size": 1}),
    "dp2-zero1": (
        2,
        {"tensor_parallel_size": 1, "distributed_optimizer": True, "bucket_size": 5000},
    ),
    "single": (1, {"tensor_parallel_size": 1}),
    "pp2-interleaved": (
        2,
        {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "num_microbatches": 4},
    ),
}


def trainer(tmp_path: Path, name: str, layout: str, max_steps: int, **kwargs: Any) -> L.Trainer:
    devices, strategy = LAYOUTS[layout]
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=MegatronSPStrategy(**strategy, start_method="spawn"),
        max_steps=max_steps,
        logger=CSVLogger(tmp_path, name=name, version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        **kwargs,
    )


def logged(tmp_path: Path, name: str, key: str) -> dict[int, float]:
    """``{step: value}`` of one metric from the CSV logs."""
    with open(tmp_path / name / "version_0" / "metrics.csv") as fh:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(fh) if r.get(key)}


def data(corpus: Path, batch_size: int = 4) -> TextDataModule:
    return TextDataModule(paths=str(corpus), seq_length=64, batch_size=batch_size, val_fraction=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-sp", "dp2"])
def test_training_reduces_loss_and_keeps_replicas_in_sync(
    tmp_path: Path, corpus: Path, layout: str
) -> None:
    trainer(tmp_path, "run", layout, max_steps=40, callbacks=[AssertReplicasInSync()],
            enable_checkpointing=False).fit(model(), data(corpus))  # fmt: skip
    losses = logged(tmp_path, "run", "train/loss")
    first, last = losses[min(losses)], losses[max(losses)]
    assert max(losses) == 39
    assert last < 0.6 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2-interleaved", "dp2-zero1"])
def test_resume_is_exact(tmp_path: Path, corpus: Path, layout: str) -> None:
    """8 steps straight equal 4 + resume + 4 (the resume past the warm-up's end, step 5)."""
    every_4 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1,
                               filename="{step}")  # fmt: skip
    trainer(tmp_path, "straight", layout, max_steps=8, callbacks=[every_4]).fit(
        model(num_layers=4), data(corpus)
    )
    at_4, at_8 = tmp_path / "ckpt" / "step=4.ckpt", tmp_path / "ckpt" / "step=8.ckpt"
    assert at_4.is_dir() and at_8.is_dir()

    again = ModelCheckpoint(dirpath=tmp_path / "resumed", every_n_train_steps=4, save_top_k=-1,
                            filename="{step}")  # fmt: skip
    trainer(tmp_path, "resumed", layout, max_steps=8, callbacks=[again]).fit(
        model(num_layers=4), data(corpus), ckpt_path=str(at_4)
    )
    straight, resumed = (
        logged(tmp_path, "straight", "train/loss"),
        logged(tmp_path, "resumed", "train/loss"),
    )
    assert min(resumed) == 4, "the resumed run did not start at step 4"
    for step in range(4, 8):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6), f"step {step}"
    a, b = read_full(at_8), read_full(tmp_path / "resumed" / "step=8.ckpt")

    def tensors_of(full: dict) -> set[str]:
        return {k for k in full if k.startswith(("model.", "optim.")) and torch.is_tensor(full[k])}

    tensors = tensors_of(a)
    assert tensors and tensors == tensors_of(b)
    for key in tensors:
        assert torch.equal(a[key], b[key]), f"{key} differs after resume"


@pytest.mark.slow
def test_bf16_run_logs_activation_bytes_equal_to_table2(tmp_path: Path, corpus: Path) -> None:
    """bf16 weights and activations (fp32 master weights in the optimizer), TP=2 + SP,
    selective recompute: the monitor's measured bytes per layer equal the paper's 34 sbh / t."""
    from lightning_sp.callbacks.memory import ActivationMemoryMonitor

    run = trainer(tmp_path, "bf16", "tp2-sp", max_steps=6, precision="bf16-true",
                  callbacks=[ActivationMemoryMonitor()], enable_checkpointing=False)  # fmt: skip
    run.fit(model(hidden_size=128), data(corpus))
    measured = logged(tmp_path, "bf16", "memory/activation_bytes_per_layer")
    formula = logged(tmp_path, "bf16", "memory/activation_bytes_per_layer_formula")
    s, b, h, t = 64, 4, 128, 2
    assert set(measured) == set(range(6))
    for step in measured:
        assert formula[step] == 34 * s * b * h / t  # Table 2, TP + SP + selective
        assert measured[step] == pytest.approx(formula[step], rel=0.01)
    losses = logged(tmp_path, "bf16", "train/loss")
    assert losses[5] < losses[0]


@pytest.mark.slow
def test_resume_with_another_vocabulary_fails_before_training(tmp_path: Path, corpus: Path) -> None:
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=2, filename="{step}"
    )
    trainer(tmp_path, "first", "tp2-sp", max_steps=2, callbacks=[checkpoints]).fit(
        model(), data(corpus)
    )
    with pytest.raises(
        Exception,
        match=r"model.config.vocab_size=384 but the checkpoint was trained with vocab_size=257",
    ):
        trainer(tmp_path, "second", "tp2-sp", max_steps=4, enable_checkpointing=False).fit(
            model(vocab_size=384), data(corpus), ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt")
        )
    assert not (tmp_path / "second" / "version_0" / "metrics.csv").exists(), "training started"


def test_unknown_strategy_argument_is_one_clear_line() -> None:
    with pytest.raises(ConfigError, match=r"unknown argument tensor_paralel_size=2; valid: "):
        MegatronSPStrategy(tensor_paralel_size=2)


@pytest.mark.slow
def test_pipeline_trains_exactly_like_one_process(tmp_path: Path, corpus: Path) -> None:
    """p=2 with m=2 interleaved chunks and 4 micro-batches against one process on the same
    batches (dropout 0, fp32): the same loss at every step; the activation monitor reports
    the first stage's peak beside eq. 5 x (1 + (p-1)/(p*m))."""
    from lightning_sp.callbacks.memory import ActivationMemoryMonitor

    def run(name: str, layout: str, callbacks: list) -> dict[int, float]:
        net = model(num_layers=4, hidden_dropout=0.0, attention_dropout=0.0)
        trainer(tmp_path, name, layout, max_steps=8, callbacks=callbacks,
                enable_checkpointing=False).fit(net, data(corpus))  # fmt: skip
        return logged(tmp_path, name, "train/loss")

    single = run("single", "single", [])
    piped = run("piped", "pp2-interleaved", [ActivationMemoryMonitor()])
    assert sorted(piped) == list(range(8))
    for step, loss in single.items():
        assert piped[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    ratio = logged(tmp_path, "piped", "memory/pipeline_stage_peak_ratio")
    assert ratio and all(r == pytest.approx(1.0, abs=0.05) for r in ratio.values()), ratio
