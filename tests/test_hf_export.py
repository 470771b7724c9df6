"""Hugging Face GPT-2 export (lightning_sp.training.hf_export, ``cli.py export``).

A Trainer run (t = 2 + SP started from an imported random GPT-2 with a tokenizer.json; p = 2
from the seeded init) trains 3 steps and checkpoints; ``cli.py export`` writes a directory
transformers loads, whose fp32 logits equal the run's own (gathered) logits within fp32
rounding (max |diff| <= 1e-5 · max |logit|), and ``model.generate`` runs. A bad checkpoint
fails with one line. The p = 2 checkpoint also generates in one process: greedy tokens equal
transformers' greedy tokens from the exported model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hf_models import (
    ROOT,
    SEQ,
    STEPS,
    VOCAB,
    full_logits,
    our_config,
    save_gpt2_with_reference,
    tokens,
    transformers,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_sp import GPTModule, MegatronSPStrategy, OptimizerConfig
from lightning_sp.model.generate import GenerationConfig
from lightning_sp.training.data import TextDataModule
from lightning_sp.training.hf_export import export_checkpoint


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A saved random GPT-2 and the float64 reference logits and loss on a fixed batch."""
    return save_gpt2_with_reference(tmp_path_factory.mktemp("gpt2"))


class SaveLogits(Callback):
    """At the end of training, the run's own logits on ``ids`` (eval mode), saved by the
    rank that holds them (last stage, first TP rank)."""

    def __init__(self, path: Path, ids: torch.Tensor) -> None:
        self.path, self.ids = path, ids

    def on_train_end(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        state = trainer.strategy.parallel_state
        pl_module.eval()
        with torch.no_grad():
            logits = full_logits(pl_module.chunks, state, self.ids)
        if logits is not None and state.tensor_parallel_rank == 0:
            torch.save(logits, self.path)


def _train_tokenizer(corpus: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    files = [str(p) for p in corpus.iterdir()]
    tok.train(files, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "<|endoftext|>"]))
    tok.save(str(out))
    return out


def _fit(tmp_path: Path, module: GPTModule, data: TextDataModule, strategy: dict) -> Path:
    """Train 3 steps under ``megatron_sp`` on 2 spawned ranks; the run's logits on a fixed
    batch go to ``logits.pt``; returns the checkpoint."""
    ids, _ = tokens(batch=2, vocab=module.config.vocab_size)
    L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MegatronSPStrategy(**strategy, start_method="spawn"),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[
            ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="final", every_n_train_steps=STEPS),
            SaveLogits(tmp_path / "logits.pt", ids),
        ],
    ).fit(module, data)
    return tmp_path / "ckpt" / "final.ckpt"


def _check_exported(directory: Path, run_logits: Path, vocab: int) -> Any:
    """The exported directory loads in transformers and gives the run's logits; returns it."""
    model = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    ids, _ = tokens(batch=2, vocab=vocab)
    expected = torch.load(run_logits)
    with torch.no_grad():
        logits = model(ids).logits
    error = (logits - expected).abs().max() / expected.abs().max()
    assert error <= 1e-5, f"exported logits differ from the run's by {error:.2e} (relative max)"
    print(f"{directory.name}: exported logits, max |diff| / max |logit| = {error:.2e}")
    generated = model.generate(ids[:, :8], max_new_tokens=8, do_sample=False)
    assert generated.shape == (2, 16) and torch.equal(generated[:, :8], ids[:, :8])
    return model


@pytest.mark.slow
def test_export_round_trip_tp2_sp_from_gpt2_with_tokenizer(
    tmp_path: Path, corpus: Path, gpt2: tuple[Path, Path]
) -> None:
    """t=2 + SP, started from the imported GPT-2, a tokenizer.json; exported by the CLI."""
    tokenizer = _train_tokenizer(corpus, tmp_path / "tokenizer.json")
    module = GPTModule(our_config(hidden_dropout=0.1, attention_dropout=0.1,
                                  sequence_parallel=True),
                       OptimizerConfig(lr=1e-3, warmup_steps=1),
                       init_from=str(gpt2[0]))  # fmt: skip
    data = TextDataModule(paths=str(corpus), tokenizer=str(tokenizer), seq_length=SEQ,
                          batch_size=4, val_fraction=0.1)  # fmt: skip
    ckpt = _fit(tmp_path, module, data, {"tensor_parallel_size": 2})
    out = tmp_path / "hf"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "export", "--ckpt_path", str(ckpt),
         "--output", str(out)],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    model = _check_exported(out, tmp_path / "logits.pt", VOCAB)
    trained = model.transformer.h[0].attn.c_attn.weight
    start = (
        transformers.GPT2LMHeadModel.from_pretrained(gpt2[0]).transformer.h[0].attn.c_attn.weight
    )
    assert not torch.equal(trained, start), "the export holds the untrained weights"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    assert hf_tokenizer.eos_token == "<|endoftext|>" and hf_tokenizer.eos_token_id == eos
    assert hf_tokenizer("def add")["input_ids"] == data_tokenizer_ids(tokenizer, "def add")


def data_tokenizer_ids(path: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).encode(text).ids


@pytest.mark.slow
def test_export_round_trip_pp2(tmp_path: Path, corpus: Path) -> None:
    """p=2 (1F1B, two micro-batches), seeded init, byte-level data (no tokenizer files)."""
    module = GPTModule(our_config(vocab_size=257, hidden_dropout=0.1, attention_dropout=0.1,
                                  sequence_parallel=True),
                       OptimizerConfig(lr=1e-3, warmup_steps=1))  # fmt: skip
    data = TextDataModule(paths=str(corpus), seq_length=SEQ, batch_size=4, val_fraction=0.1)
    ckpt = _fit(tmp_path, module, data, {"pipeline_parallel_size": 2, "num_microbatches": 2})
    out = export_checkpoint(ckpt, tmp_path / "hf")
    model = _check_exported(out, tmp_path / "logits.pt", 257)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256

    # the p=2 checkpoint generates in one process (resharded on load): greedy decoding gives
    # transformers' greedy tokens from the exported model
    prompt = "def add"
    greedy = GenerationConfig(max_new_tokens=8, temperature=0.0)
    generator = GPTModule(our_config(vocab_size=257), generation=greedy)
    prompts = TextDataModule(paths=str(corpus), seq_length=SEQ, prompts=[prompt])
    predicted = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MegatronSPStrategy(sequence_parallel=False),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).predict(generator, prompts, ckpt_path=str(ckpt))
    assert predicted is not None
    ours: list[int] = predicted[0]["token_ids"]  # type: ignore[index]
    ids = torch.tensor([list(prompt.encode())])
    theirs = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert ours and ours == theirs[: len(ours)], f"generated {ours}, transformers {theirs}"


@pytest.mark.slow
def test_export_bad_checkpoint_fails_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "export", "--ckpt_path", str(tmp_path / "nope"),
         "--output", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: ckpt_path={str(tmp_path / 'nope')!r} does not exist"
    ]
