"""Packed documents through the data path: what a sample carries (document ids from the
end-of-document tokens, positions restarting per document, the loss mask at those tokens),
and a one-process Trainer step that consumes them."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from lightning_sp import GPTConfig, GPTModule, OptimizerConfig
from lightning_sp.data import TextDataModule
from lightning_sp.data.documents import DocumentOptions, annotate

from corpora import text_files

EOD = 9


def test_annotate_follows_megatrons_three_flags() -> None:
    row = torch.tensor([1, 2, EOD, 3, 4, 5, EOD, 6, 7])  # s + 1 = 9 tokens
    sample = annotate(row, EOD, DocumentOptions(True, True, True))
    assert sample["input_ids"].tolist() == [1, 2, EOD, 3, 4, 5, EOD, 6]
    assert sample["labels"].tolist() == [2, EOD, 3, 4, 5, EOD, 6, 7]
    assert sample["documents"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2], (  # EOD ends its document
        f"documents {sample['documents'].tolist()}: an end-of-document token belongs to the "
        "document it ends"
    )
    assert sample["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert sample["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1, 0, 1], (  # no loss from an EOD input
        f"loss_mask {sample['loss_mask'].int().tolist()}: masked where the input (not the "
        "label) is the end-of-document token"
    )
    plain = annotate(row, EOD, DocumentOptions())
    assert set(plain) == {"input_ids", "labels"}
    only_positions = annotate(row, EOD, DocumentOptions(reset_position_ids=True))
    assert set(only_positions) == {"input_ids", "labels", "positions"}


def test_trainer_step_with_document_masks(tmp_path: Path) -> None:
    """A byte-level corpus of short documents (several per sample), every option on: the
    batches carry documents, positions and loss masks, and one process trains two steps on
    them (loss finite, logged as the global token mean)."""
    docs = text_files(tmp_path / "src", n=8, words=12)
    data = TextDataModule(
        paths=str(docs), prepared_dir=str(tmp_path / "prepared"), seq_length=64, batch_size=2,
        val_fraction=0.2, document_mask=True, reset_position_ids=True, eod_mask_loss=True,
    )  # fmt: skip
    data.prepare_corpus(log=lambda _: None)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "documents", "positions", "loss_mask"}
    assert int(batch["documents"].max()) >= 1, "no sample holds two documents"
    config = GPTConfig.of(
        "llama", vocab_size=257, seq_length=64, hidden_size=32, num_layers=2, num_heads=4,
        num_query_groups=2, ffn_hidden_size=48, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    module = GPTModule(config, OptimizerConfig(lr=1e-3, warmup_steps=0))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    loss = trainer.callback_metrics["train/loss"]
    assert torch.isfinite(loss) and 2.0 < float(loss) < 8.0, loss
