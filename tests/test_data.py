"""TextDataModule: packing, tokenizers, determinism, inputs, errors, and a real Lightning fit."""

from __future__ import annotations

import inspect
import json
import os
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn

from lightning_sp.errors import ConfigError
from lightning_sp.training.data import BYTE_EOS_ID, TextDataModule

EOS = BYTE_EOS_ID


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _corpus(root: Path, n: int = 6, words: int = 80) -> Path:
    """``n`` small English-ish documents under ``root/docs``."""
    vocab = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "hums"]
    for i in range(n):
        text = " ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(words))
        _write(root / "docs" / f"doc{i:02d}.txt", f"document {i}: {text}\n")
    return root / "docs"


def _module(tmp_path: Path, **kwargs) -> TextDataModule:
    kwargs.setdefault("cache_dir", str(tmp_path / "cache"))
    dm = TextDataModule(**kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _stream(dm: TextDataModule) -> np.ndarray:
    """All packed tokens in corpus order (train and val samples share one array)."""
    return dm.train_dataset.samples.reshape(-1)


def _batches(dm: TextDataModule, n: int) -> list[torch.Tensor]:
    it = iter(dm.train_dataloader())
    return [next(it)["input_ids"] for _ in range(n)]


# --------------------------------------------------------------------------------------------
# Packing and tokenization


def test_packing_exact(tmp_path: Path) -> None:
    a = _write(tmp_path / "data" / "a.txt", "abc")
    b = _write(tmp_path / "data" / "b.txt", "hello")
    # stream: a b c EOS h e l l o EOS = 10 tokens -> 3 samples of 3 tokens, 1 token dropped
    dm = _module(tmp_path, paths=[str(b), str(a)], seq_length=2, batch_size=1, val_fraction=0)
    assert dm.num_tokens == 10
    assert len(dm.train_dataset) + len(dm.val_dataset) == 3
    assert len(dm.val_dataset) == 1  # at least one validation sample even for val_fraction=0
    expected = [[97, 98, 99], [EOS, 104, 101], [108, 108, 111]]
    assert dm.train_dataset.samples.tolist() == expected
    items = [dm.train_dataset[i] for i in range(2)] + [dm.val_dataset[0]]
    rows = sorted(torch.cat([it["input_ids"][:1], it["labels"]]).tolist() for it in items)
    assert rows == sorted(expected)
    for item in items:
        assert item["input_ids"].dtype == torch.int64 and item["labels"].dtype == torch.int64
        assert item["input_ids"].shape == (2,) and item["labels"].shape == (2,)
        assert torch.equal(item["input_ids"][1:], item["labels"][:-1])


def test_sample_count_and_shift(tmp_path: Path) -> None:
    docs = _corpus(tmp_path, n=5)
    texts = [p.read_bytes() for p in sorted(docs.iterdir())]
    total = sum(len(t) + 1 for t in texts)
    s = 16
    dm = _module(tmp_path, paths=str(docs), seq_length=s, batch_size=4, val_fraction=0.1)
    n = total // (s + 1)
    assert dm.num_tokens == total
    assert len(dm.train_dataset) + len(dm.val_dataset) == n
    assert len(dm.val_dataset) == round(0.1 * n)
    expected = np.concatenate(
        [np.frombuffer(t + b"\x00", np.uint8).astype(np.int64) for t in texts]
    )
    expected[np.cumsum([len(t) + 1 for t in texts]) - 1] = EOS
    assert np.array_equal(_stream(dm), expected[: n * (s + 1)])
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, s) and batch["labels"].shape == (4, s)
    assert batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


def test_byte_round_trip(tmp_path: Path) -> None:
    text = "héllo wörld ✓ 🚀 — naïve café\n" * 10
    path = _write(tmp_path / "data" / "u.txt", text)
    _write(tmp_path / "data" / "v.txt", "second document\n" * 10)
    dm = _module(tmp_path, paths=str(path.parent), seq_length=8, batch_size=1)
    assert dm.vocab_size == 257 and dm.tokenizer_id == "bytes" and dm.eos_token_id == 256
    stream = _stream(dm).tolist()
    first = stream[: stream.index(EOS)]
    assert bytes(first).decode("utf-8") == text
    assert max(stream) == EOS and min(stream) >= 0


def _train_tokenizer(tmp_path: Path, files: list[str], eos: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]"] + ([eos] if eos else [])
    tok.train(files, trainers.BpeTrainer(vocab_size=120, special_tokens=special))
    out = tmp_path / "tok" / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def test_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    docs = _corpus(tmp_path, n=4)
    files = sorted(str(p) for p in docs.iterdir())
    path = _train_tokenizer(tmp_path, files, "<|endoftext|>")
    tok = Tokenizer.from_file(str(path))
    dm = _module(tmp_path, paths=str(docs), tokenizer=str(path), seq_length=8, batch_size=2)
    eos = tok.token_to_id("<|endoftext|>")
    assert dm.vocab_size == tok.get_vocab_size() != 257
    assert dm.eos_token_id == eos
    assert dm.tokenizer_id.startswith("tokenizers:") and len(dm.tokenizer_id) == 11 + 16
    expected: list[int] = []
    for f in files:
        expected += [*tok.encode(Path(f).read_text(), add_special_tokens=False).ids, eos]
    n = len(expected) // 9
    assert dm.num_tokens == len(expected)
    assert _stream(dm).tolist() == expected[: n * 9]
    assert int(_stream(dm).max()) < dm.vocab_size

    byte_dm = _module(tmp_path, paths=str(docs), seq_length=8, batch_size=2)
    assert byte_dm.num_tokens > dm.num_tokens  # BPE merges bytes into fewer tokens

    # A different tokenizer.json gives a different id.
    other = _train_tokenizer(tmp_path / "other", files[:1], "</s>")
    assert TextDataModule(paths=str(docs), tokenizer=str(other)).tokenizer_id != dm.tokenizer_id


def test_tokenizer_without_eos(tmp_path: Path) -> None:
    docs = _corpus(tmp_path, n=2)
    path = _train_tokenizer(tmp_path, [str(p) for p in docs.iterdir()], None)
    message = _raises("tokenizer=", paths=str(docs), tokenizer=str(path))
    assert str(path) in message and "<|endoftext|>" in message


# --------------------------------------------------------------------------------------------
# Determinism, splits, caching


def test_determinism(tmp_path: Path) -> None:
    docs = _corpus(tmp_path, n=8)
    kwargs = dict(paths=str(docs), seq_length=16, batch_size=4)
    a = _batches(_module(tmp_path, seed=7, **kwargs), 3)
    b = _batches(_module(tmp_path, seed=7, **kwargs), 3)
    c = _batches(_module(tmp_path, seed=8, **kwargs), 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    # A new epoch (Lightning calls set_epoch) reshuffles, reproducibly.
    dm = _module(tmp_path, seed=7, **kwargs)
    loader = dm.train_dataloader()
    first = next(iter(loader))["input_ids"]
    loader.sampler.set_epoch(1)
    second = next(iter(loader))["input_ids"]
    assert torch.equal(first, a[0]) and not torch.equal(first, second)


def test_data_parallel_replicas_read_disjoint_samples(tmp_path: Path) -> None:
    from lightning_sp.training.data import ResumableDistributedSampler

    dm = _module(tmp_path, paths=str(_corpus(tmp_path, n=8)), seq_length=16, batch_size=2)
    shards = [
        list(
            ResumableDistributedSampler(
                dm.train_dataset, num_replicas=2, rank=r, seed=7, drop_last=True
            )
        )
        for r in range(2)
    ]
    assert not set(shards[0]) & set(shards[1])
    assert len(shards[0]) == len(shards[1]) == len(dm.train_dataset) // 2


def test_resumed_sampler_skips_consumed_samples_once(tmp_path: Path) -> None:
    from lightning_sp.training.data import ResumableDistributedSampler

    dm = _module(tmp_path, paths=str(_corpus(tmp_path, n=8)), seq_length=16, batch_size=2)
    whole = list(ResumableDistributedSampler(dm.train_dataset, num_replicas=1, rank=0, seed=7))
    resumed = ResumableDistributedSampler(
        dm.train_dataset, num_replicas=1, rank=0, seed=7, skip_samples=6
    )
    assert list(resumed) == whole[6:]
    assert list(resumed) == whole  # the next pass over the same epoch is whole again


def test_train_val_disjoint(tmp_path: Path) -> None:
    docs = _corpus(tmp_path, n=8)
    dm = _module(tmp_path, paths=str(docs), seq_length=8, batch_size=2, val_fraction=0.25)
    train, val = set(dm.train_dataset.indices.tolist()), set(dm.val_dataset.indices.tolist())
    n = len(dm.train_dataset.samples)
    assert not train & val and train | val == set(range(n))
    assert len(val) == round(0.25 * n)
    val_rows = torch.cat([b["input_ids"] for b in dm.val_dataloader()])
    assert val_rows.shape == (len(val), 8)  # val keeps its last incomplete batch
    assert len(dm.train_dataloader()) == len(train) // 2  # train drops it


def test_cache_reused_and_invalidated(tmp_path: Path) -> None:
    docs = _corpus(tmp_path, n=3)
    first = TextDataModule(paths=str(docs), seq_length=8, cache_dir=str(tmp_path / "cache"))
    again = TextDataModule(paths=str(docs), seq_length=8, cache_dir=str(tmp_path / "cache"))
    before = first._tokenized().cache_files
    assert again._tokenized().cache_files == before
    # Editing a file (size and mtime change) re-reads it.
    target = docs / "doc00.txt"
    target.write_text("changed " * 100)
    os.utime(target, ns=(1, 1))
    edited = _module(tmp_path, paths=str(docs), seq_length=8, batch_size=1)
    assert edited._tokenized().cache_files != before
    assert bytes(_stream(edited)[:8].tolist()) == b"changed "


# --------------------------------------------------------------------------------------------
# Inputs


def test_directory_and_glob_inputs(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _write(root / "a.txt", "alpha " * 20)
    _write(root / "sub" / "b.txt", "beta " * 20)
    _write(root / "sub" / "deeper" / "c.md", "gamma " * 20)
    _write(root / ".hidden" / "x.txt", "hidden")
    _write(root / ".secret.txt", "hidden")
    names = lambda dm: [os.path.relpath(f, root) for f in dm.files]  # noqa: E731

    by_dir = TextDataModule(paths=str(root))
    assert names(by_dir) == ["a.txt", "sub/b.txt", "sub/deeper/c.md"]
    by_glob = TextDataModule(paths=str(root / "**" / "*.txt"))
    assert names(by_glob) == ["a.txt", "sub/b.txt"]
    mixed = TextDataModule(paths=[str(root / "sub"), str(root / "*.txt"), str(root / "a.txt")])
    assert names(mixed) == ["a.txt", "sub/b.txt", "sub/deeper/c.md"]  # deduplicated, sorted
    dm = _module(tmp_path, paths=str(root), seq_length=8, batch_size=2)
    assert dm.num_tokens == 6 * 20 + 5 * 20 + 6 * 20 + 3


def test_max_documents_is_a_seeded_sample(tmp_path: Path) -> None:
    docs = _corpus(tmp_path, n=10)
    a = TextDataModule(paths=str(docs), max_documents=4, seed=1)
    b = TextDataModule(paths=str(docs), max_documents=4, seed=1)
    c = TextDataModule(paths=str(docs), max_documents=4, seed=2)
    assert a.files == b.files == sorted(a.files) and len(a.files) == 4
    assert a.files != c.files
    assert len(TextDataModule(paths=str(docs), max_documents=50).files) == 10


def test_default_stdlib_corpus(tmp_path: Path) -> None:
    dm = _module(tmp_path, max_documents=20, seq_length=64, batch_size=4)
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    assert len(dm.files) == 20
    assert all(f.endswith(".py") and os.path.realpath(f).startswith(stdlib) for f in dm.files)
    assert not any("site-packages" in f for f in dm.files)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (4, 64) and batch["labels"].shape == (4, 64)
    assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"].shape[1] == 64


def test_local_dataset_via_dataset_name(tmp_path: Path) -> None:
    """``dataset_name`` goes through ``datasets.load_dataset``; a local folder works offline."""
    folder = tmp_path / "hub_like"
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"content": f"row {i} " * 10, "id": i}) + "\n")
    dm = _module(
        tmp_path, dataset_name=str(folder), text_column="content", seq_length=16, batch_size=2
    )
    assert dm.num_tokens == sum(len(f"row {i} " * 10) + 1 for i in range(30))
    assert bytes(_stream(dm)[:6].tolist()) == b"row 0 "
    message = _raises(
        "text_column='text'", stage=True, dataset_name=str(folder), cache_dir=str(tmp_path / "c")
    )
    assert "'content'" in message


# --------------------------------------------------------------------------------------------
# Errors: one line, naming the field and the value


def _raises(match: str, stage: bool = False, **kwargs) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        dm = TextDataModule(**kwargs)
        if stage:
            dm.setup("fit")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_error_path_matches_nothing(tmp_path: Path) -> None:
    message = _raises(r"paths='/nope/\*\.txt' matches no file", paths="/nope/*.txt")
    assert "glob" in message
    _write(tmp_path / "a.txt", "x")
    message = _raises(r"paths\[1\]=", paths=[str(tmp_path / "a.txt"), str(tmp_path / "missing")])
    assert str(tmp_path / "missing") in message
    (tmp_path / "empty").mkdir()
    _raises("matches no file", paths=str(tmp_path / "empty"))
    _raises(r"paths=\[\]", paths=[])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_length": 0}, r"seq_length=0 .*>= 1"),
        ({"batch_size": 0}, r"batch_size=0 .*>= 1"),
        ({"val_fraction": 1.0}, r"val_fraction=1\.0 .*\[0, 1\)"),
        ({"val_fraction": -0.1}, r"val_fraction=-0\.1 .*\[0, 1\)"),
        ({"max_documents": 0}, r"max_documents=0 .*>= 1"),
        ({"num_workers": -1}, r"num_workers=-1 .*>= 0"),
        ({"tokenizer": "/nope/tokenizer.json"}, r"tokenizer='/nope/tokenizer\.json' is not a file"),
        ({"dataset_name": "wikitext"}, r"paths=.* and dataset_name='wikitext' are both set"),
    ],
)
def test_constructor_errors(tmp_path: Path, kwargs: dict, match: str) -> None:
    _write(tmp_path / "a.txt", "some text")
    kwargs = {"paths": str(tmp_path / "a.txt"), **kwargs}
    _raises(match, **kwargs)


def test_error_invalid_tokenizer_file(tmp_path: Path) -> None:
    bad = _write(tmp_path / "tokenizer.json", "{not json")
    _raises(f"tokenizer='{bad}' is not a valid", tokenizer=str(bad))


def test_error_corpus_too_small(tmp_path: Path) -> None:
    path = _write(tmp_path / "tiny.txt", "x" * 99)  # 100 tokens with EOS
    message = _raises(
        "seq_length=64 needs at least 130 tokens",
        stage=True,
        paths=str(path),
        seq_length=64,
        cache_dir=str(tmp_path / "cache"),
    )
    assert "has 100 tokens" in message


def test_error_batch_larger_than_train_split(tmp_path: Path) -> None:
    path = _write(tmp_path / "small.txt", "x" * 99)  # 100 tokens -> 11 samples of 9
    message = _raises(
        "batch_size=32 is larger than the 10 training samples",
        stage=True,
        paths=str(path),
        seq_length=8,
        batch_size=32,
        cache_dir=str(tmp_path / "cache"),
    )
    assert "seq_length=8" in message


def test_help_documents_every_argument() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(TextDataModule, "data")
    text = " ".join(parser.format_help().split())
    for needle in ("Local text files", "Hugging Face Hub dataset", "Tokens per sample"):
        assert needle in text
    doc = TextDataModule.__doc__ or ""
    params = list(inspect.signature(TextDataModule).parameters)
    assert len(params) == 11 and all(f"        {p}: " in doc for p in params)


# --------------------------------------------------------------------------------------------
# Lightning integration


class _TinyLM(pl.LightningModule):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, vocab_size)
        self.shapes: list[tuple[int, ...]] = []

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.head(self.embed(batch["input_ids"]))  # [b, s, v]
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.shapes.append(tuple(batch["input_ids"].shape))
        return self._loss(batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_fit(tmp_path: Path) -> None:
    docs = _corpus(tmp_path, n=6)
    dm = TextDataModule(
        paths=str(docs), seq_length=16, batch_size=4, cache_dir=str(tmp_path / "cache")
    )
    model = _TinyLM(dm.vocab_size)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        val_check_interval=2,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2
    assert model.shapes == [(4, 16), (4, 16)]
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
