"""``TextDataModule`` under Lightning: fit from prepared and blended corpora, the checks made
before any work, and exact mid-epoch resume with two data-parallel ranks."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_sp import ConfigError, GPTConfig, GPTModule, MegatronSPStrategy, OptimizerConfig
from lightning_sp.checkpoint import read_full
from lightning_sp.data import TextDataModule, TokenSplit

from corpora import bpe_tokenizer, text_files


def _prepare(tmp_path: Path, name: str, n: int = 8, words: int = 80, **kwargs) -> str:
    """Prepare ``n`` documents into ``tmp_path/name``; returns the directory."""
    out = str(tmp_path / name)
    docs = text_files(tmp_path / f"{name}-src", n=n, words=words)
    if kwargs.pop("numbered", False):  # no two samples alike: numbered lines
        for i, path in enumerate(sorted(docs.iterdir())):
            path.write_text("".join(f"doc {i} line {j:04d}\n" for j in range(words)))
    dm = TextDataModule(paths=str(docs), prepared_dir=out, cache_dir=str(tmp_path / "c"),
                        val_fraction=0.2, **kwargs)  # fmt: skip
    dm.prepare_corpus(log=lambda _: None)
    return out


def _one_line(match: str, **kwargs: Any) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        TextDataModule(**kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_checks_before_any_work(tmp_path: Path) -> None:
    prepared = _prepare(tmp_path, "bytes")
    tok = bpe_tokenizer(tmp_path / "tok")
    # the tokenizer differs from the one the data was prepared with
    message = _one_line("differs from the tokenizer", prepared_dir=prepared, tokenizer=str(tok))
    assert prepared in message and "bytes" in message
    # the tokenizer's vocabulary is larger than the model's
    bpe = TextDataModule(paths=str(tmp_path / "bytes-src"), tokenizer=str(tok),
                         cache_dir=str(tmp_path / "c"))  # fmt: skip
    v = bpe.vocab_size
    assert 257 != v == bpe.info.vocab_size
    with pytest.raises(ConfigError, match=rf"vocab_size={v - 1} is smaller than the tokenizer's "
                       rf"vocabulary of {v} tokens"):  # fmt: skip
        bpe.check_model_vocab(v - 1)
    bpe.check_model_vocab(v)
    # blend weights
    _one_line(r"blend\[0\]=0 is not a weight > 0", blend=[0, prepared])
    _one_line(r"blend\[2\]=-1 is not a weight > 0", blend=[1, prepared, -1, prepared])
    _one_line("a blend reads prepared directories only", blend=[1, prepared], paths="x")
    _one_line("is not a complete prepared corpus", blend=[1, prepared, 1, str(tmp_path)])
    for field, value in (("seq_length", 0), ("batch_size", 0), ("num_proc", 0)):
        _one_line(f"{field}=0 must be a positive integer", **{field: value})
    _one_line(r"val_fraction=1\.0 is invalid", val_fraction=1.0)


def test_help_documents_every_argument() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(TextDataModule, "data")
    text = " ".join(parser.format_help().split())
    for needle in ("Local files", "Megatron-LM style", "Tokenizing processes", "Tokens per"):
        assert needle in text
    doc = TextDataModule.__doc__ or ""
    params = list(inspect.signature(TextDataModule).parameters)
    missing = [p for p in params if f"        {p}: " not in doc]
    assert params and not missing, f"TextDataModule arguments without a docstring entry: {missing}"


class _TinyLM(pl.LightningModule):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, vocab_size)
        self.rows: list[list[int]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.rows += batch["input_ids"].tolist()
        logits = self.head(self.embed(batch["input_ids"]))  # [b, s, v]
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _quiet_trainer(tmp_path: Path, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), **kwargs)  # fmt: skip


def test_fit_from_a_blend_with_workers(tmp_path: Path) -> None:
    """Two prepared directories blended 3:1; DataLoader workers map the shards themselves."""
    a, b = _prepare(tmp_path, "a", n=6), _prepare(tmp_path, "b", n=6, words=60)
    dm = TextDataModule(blend=[3, a, 1, b], seq_length=16, batch_size=4, num_workers=1)
    model = _TinyLM(dm.vocab_size)
    _quiet_trainer(tmp_path, max_steps=6, limit_val_batches=2, val_check_interval=3).fit(
        model, datamodule=dm
    )
    assert len(model.rows) >= 24 and all(len(r) == 16 for r in model.rows)
    n_a = dm.train_dataset.counts[0]
    a_rows = {tuple(dm.train_dataset.tokens(i)[:-1].tolist()) for i in range(n_a)}
    from_a = sum(tuple(r) in a_rows for r in model.rows[:24])
    assert 10 <= from_a <= 24  # ~18 of 24 expected (weight 0.75); 5-sigma band clipped at 24
    assert dm.state_dict()["sampler"]["consumed_samples"] == 24
    assert dm.num_tokens == sum(
        TokenSplit(d, s).num_tokens for d in (a, b) for s in ("train", "val")
    )


# --------------------------------------------------------------------------------------------
# Exact mid-epoch resume, 2 data-parallel ranks (spawned by the strategy)


class _RecordBatches(Callback):
    """Append ``[step, rows]`` of every training batch to ``<folder>/rank<r>.txt``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        with open(Path(self.folder) / f"rank{trainer.global_rank}.txt", "a") as f:
            f.write(json.dumps([trainer.global_step, batch["input_ids"].tolist()]) + "\n")


def _gpt() -> GPTModule:
    config = GPTConfig(vocab_size=257, seq_length=32, hidden_size=32, num_layers=1, num_heads=2)
    return GPTModule(config, OptimizerConfig(lr=1e-3, warmup_steps=1))


def _dp2(tmp_path: Path, name: str, max_steps: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=2, max_steps=max_steps, logger=False,
        strategy=MegatronSPStrategy(tensor_parallel_size=1, start_method="spawn"),
        callbacks=[_RecordBatches(str(tmp_path / name)), *callbacks], enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )  # fmt: skip


def _recorded(folder: Path, rank: int) -> dict[int, list]:
    lines = (folder / f"rank{rank}.txt").read_text().splitlines()
    return {step: rows for step, rows in map(json.loads, lines)}


@pytest.mark.slow
def test_exact_mid_epoch_resume_with_two_data_parallel_ranks(tmp_path: Path) -> None:
    prepared = _prepare(tmp_path, "corpus", n=8, words=60, numbered=True)
    data = lambda: TextDataModule(prepared_dir=prepared, seq_length=32, batch_size=2)  # noqa: E731
    probe = data()
    probe.setup("fit")
    assert len(probe.train_dataset) // 4 > 8, "the checkpoint must fall mid-epoch"
    at_4 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1,
                           filename="{step}")  # fmt: skip
    _dp2(tmp_path, "straight", 8, [at_4]).fit(_gpt(), data())
    lightning_state = read_full(tmp_path / "ckpt" / "step=4.ckpt")["lightning"]
    assert lightning_state["TextDataModule"] == {"sampler": {
        "epoch": 0, "consumed_samples": 4 * 2 * 2, "epoch_samples": len(probe.train_dataset),
        "seed": 1234}}  # fmt: skip
    resume_from = str(tmp_path / "ckpt" / "step=4.ckpt")
    _dp2(tmp_path, "resumed", 8, []).fit(_gpt(), data(), ckpt_path=resume_from)
    rows = {}
    for rank in range(2):
        straight = _recorded(tmp_path / "straight", rank)
        resumed = _recorded(tmp_path / "resumed", rank)
        assert sorted(straight) == list(range(8)) and sorted(resumed) == list(range(4, 8))
        assert all(resumed[s] == straight[s] for s in range(4, 8)), f"rank {rank}"
        rows[rank] = [tuple(r) for s in range(8) for r in straight[s]]
    assert not set(rows[0]) & set(rows[1]), "data-parallel ranks read the same samples"
