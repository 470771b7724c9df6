"""``dpo.reference: precomputed`` (TRL's ``precompute_ref_log_probs``): one pass of the starting
policy over the prepared preference data stores each sample's reference log-probabilities with
the prepared tokens; the samples then carry them, equal (float64, 1e-12) to the live reference
forward of the same weights on the same batches; data that is not prepared preference data
is refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_dpo_trainer import pairs

from lightning_sp.data import TextDataModule
from lightning_sp.data.preference import REFERENCE, REFERENCE_FILE
from lightning_sp.errors import ConfigError
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.training.dpo import PreferenceSteps
from lightning_sp.training.preference import DPOConfig

from corpora import chat_tokenizer, jsonl
from hf_models import llama_config

SEQ = 64


def test_precomputed_reference_equals_live(tmp_path: Path) -> None:
    data = TextDataModule(paths=str(jsonl(tmp_path / "pairs.jsonl", pairs(24))),
                          chat_template_dir=str(chat_tokenizer(tmp_path)),
                          prepared_dir=str(tmp_path / "p"), seq_length=SEQ, batch_size=2,
                          val_fraction=0.25, preference=True)  # fmt: skip
    data.prepare_data()
    data.setup("fit")
    config = llama_config(vocab_size=128, seq_length=SEQ, hidden_size=32, num_layers=1,
                          ffn_hidden_size=64)  # fmt: skip
    torch.manual_seed(0)
    policy = Pipeline(config, ParallelState.single(), num_microbatches=1, dtype=torch.float64)
    stored = PreferenceSteps(DPOConfig(reference="precomputed"), lora=False)
    stored.precompute(policy, data, batch_size=3)  # batches unlike the loaders' 2
    live = PreferenceSteps(DPOConfig(reference="copy"), lora=False)
    live.use_copy(policy)
    for split, loader in (("train", data.train_dataloader()), ("val", data.val_dataloader())):
        assert os.path.exists(tmp_path / "p" / split / REFERENCE_FILE), f"{split}: not stored"
        seen = 0
        for batch in loader:
            assert REFERENCE in batch, f"{split}: samples do not carry {REFERENCE}"
            targets, ids, target, packing = live._inputs(batch, policy.state)
            want = live._reference(policy, batch, targets, (ids, target, packing))
            got = stored._reference(policy, batch, targets, (ids, target, packing))
            assert want.abs().sum() > 0, f"{split}: the live reference is empty"
            torch.testing.assert_close(
                got, want, rtol=0, atol=1e-12,
                msg=lambda m, split=split, seen=seen: (
                    f"{split} batch {seen}: the stored reference log-probabilities differ from "
                    f"the live reference's: {m}"
                ),
            )  # fmt: skip
            seen += 1
        assert seen > 0, f"{split}: no batches"


def test_precomputed_refuses_plain_data(tmp_path: Path) -> None:
    config = llama_config(vocab_size=128, seq_length=SEQ, hidden_size=32, num_layers=1,
                          ffn_hidden_size=64)  # fmt: skip
    policy = Pipeline(config, ParallelState.single(), num_microbatches=1, dtype=torch.float64)
    steps = PreferenceSteps(DPOConfig(reference="precomputed"), lora=False)
    with pytest.raises(ConfigError, match="needs the prepared preference data") as err:
        steps.precompute(policy, object())
    assert "\n" not in str(err.value), "one line"
