"""``prepare``: shards (uint16 / uint32), index and metadata, document split, atomicity, reuse,
``num_proc``; the ``cli.py prepare`` subcommand."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from lightning_sp.data import (
    PackedSamples,
    PrepareSettings,
    Source,
    TokenizerInfo,
    TokenSplit,
    check_prepared,
    prepare,
    read_metadata,
    resolve_paths,
    tokenizer_info,
)
from lightning_sp.errors import ConfigError

from cli_runs import ROOT, run_many
from corpora import bpe_tokenizer, document, jsonl, text_files, word_tokenizer


def _source(paths: str | list[str], **kwargs) -> Source:
    return Source(tuple(resolve_paths(paths)), None, kwargs.pop("text_field", "text"),
                  kwargs.pop("max_documents", None), kwargs.pop("seed", 0))  # fmt: skip


def _run(tmp_path: Path, source: Source, info: TokenizerInfo, name: str = "out", **settings):
    settings = {"val_fraction": 0.25, "seed": 3, **settings}
    out = tmp_path / name
    meta = prepare(source, info, str(out), PrepareSettings(**settings), str(tmp_path / "cache"),
                   log=lambda _: None)  # fmt: skip
    return out, meta


def _split_stream(out: Path, split: str) -> np.ndarray:
    tokens = TokenSplit(str(out), split)
    return tokens.read(0, tokens.num_tokens)


def test_metadata_index_and_document_split(tmp_path: Path) -> None:
    docs = text_files(tmp_path, n=8, words=30)
    texts = [p.read_text() for p in sorted(docs.iterdir())]
    path = bpe_tokenizer(tmp_path / "tok")
    info = tokenizer_info(str(path))
    tok = Tokenizer.from_file(str(path))
    encoded = [[*tok.encode(t, add_special_tokens=False).ids, info.eos_id] for t in texts]
    out, meta = _run(tmp_path, _source(str(docs)), info)

    assert meta == read_metadata(str(out)) == check_prepared(str(out), info)
    assert meta["tokenizer"]["digest"] == info.digest and meta["tokenizer"]["eos_id"] == info.eos_id
    assert meta["dtype"] == "uint16" and meta["documents"] == 8
    assert meta["splits"]["val"]["documents"] == 2  # round(0.25 * 8) documents, whole
    assert meta["tokens"] == sum(len(e) for e in encoded)
    seen: list[list[int]] = []
    for split in ("train", "val"):
        stream = _split_stream(out, split).tolist()
        ends = np.fromfile(out / split / "documents.idx", dtype=np.uint64).tolist()
        starts = [0, *ends[:-1]]
        pieces = [stream[a:b] for a, b in zip(starts, ends, strict=True)]
        assert all(p in encoded for p in pieces)  # every document whole, in one split
        assert pieces == [e for e in encoded if e in pieces]  # in corpus order
        seen += pieces
        index = json.loads((out / split / "index.json").read_text())
        assert index["tokens"] == len(stream) == meta["splits"][split]["tokens"]
    assert sorted(map(tuple, seen)) == sorted(map(tuple, encoded))


def test_uint32_shards_when_the_vocabulary_exceeds_uint16(tmp_path: Path) -> None:
    big = tokenizer_info(str(word_tokenizer(tmp_path, 70_000)))
    small = tokenizer_info(str(word_tokenizer(tmp_path, 300)))
    assert (big.dtype(), small.dtype()) == (np.dtype(np.uint32), np.dtype(np.uint16))
    ids = [5, 65_535, 65_536, 69_990, 12, 299]
    corpus = jsonl(tmp_path / "c.jsonl", [{"text": " ".join(f"w{i}" for i in ids)}] * 3)
    out, meta = _run(tmp_path, _source(str(corpus)), big, val_fraction=0.0)
    assert meta["dtype"] == "uint32"
    assert (out / "train" / "00000.bin").stat().st_size == 4 * 3 * (len(ids) + 1)
    assert _split_stream(out, "train").tolist() == [*ids, big.eos_id] * 3
    out16, meta16 = _run(tmp_path, _source(str(corpus)), small, "small", val_fraction=0.0)
    unk = small.vocab_size - 2  # words past the small vocabulary are [UNK]
    expected = [i if i < 298 else unk for i in ids]
    assert meta16["dtype"] == "uint16"
    assert (out16 / "train" / "00000.bin").stat().st_size == 2 * 3 * (len(ids) + 1)
    assert _split_stream(out16, "train").tolist() == [*expected, small.eos_id] * 3


def test_shards_and_samples_across_them(tmp_path: Path) -> None:
    docs = text_files(tmp_path, n=4, words=12)
    info = tokenizer_info(None)
    whole, _ = _run(tmp_path, _source(str(docs)), info, "whole", val_fraction=0.0)
    sharded, _ = _run(tmp_path, _source(str(docs)), info, "sharded", val_fraction=0.0,
                      shard_tokens=7)  # fmt: skip
    index = json.loads((sharded / "train" / "index.json").read_text())
    assert len(index["shards"]) > 10 and all(s["tokens"] <= 7 for s in index["shards"])
    stream = _split_stream(whole, "train")
    assert np.array_equal(_split_stream(sharded, "train"), stream)
    samples = PackedSamples([TokenSplit(str(sharded), "train")], seq_length=10)
    assert len(samples) == len(stream) // 11
    for i in range(len(samples)):  # many samples straddle two shards
        assert np.array_equal(samples.tokens(i), stream[i * 11 : (i + 1) * 11])


def test_num_proc_2_writes_the_same_shards(tmp_path: Path) -> None:
    corpus = jsonl(tmp_path / "c.jsonl", [{"text": document(i, 20)} for i in range(40)])
    info = tokenizer_info(str(bpe_tokenizer(tmp_path / "tok")))
    one, meta1 = _run(tmp_path, _source(str(corpus)), info, "one", num_proc=1)
    two, meta2 = _run(tmp_path, _source(str(corpus)), info, "two", num_proc=2)
    for split in ("train", "val"):
        assert (one / split / "00000.bin").read_bytes() == (two / split / "00000.bin").read_bytes()
    assert meta1["splits"] == meta2["splits"]


def test_atomic_reuse_and_conflicts(tmp_path: Path) -> None:
    docs = text_files(tmp_path, n=4, words=10)
    info = tokenizer_info(None)
    # a failure mid-way (tokenizer missing in the workers) leaves nothing behind
    broken = TokenizerInfo(path=str(tmp_path / "gone.json"), digest="0" * 64, eos_id=0,
                           vocab_size=10)  # fmt: skip
    with pytest.raises(Exception):  # noqa: B017 (the tokenizers library's own error)
        _run(tmp_path, _source(str(docs)), broken)
    assert sorted(os.listdir(tmp_path)) == ["cache", "docs"]
    # a directory without metadata (e.g. a copy cut short) is not a prepared corpus
    (tmp_path / "partial" / "train").mkdir(parents=True)
    with pytest.raises(ConfigError, match="is not a complete prepared corpus"):
        check_prepared(str(tmp_path / "partial"), info)
    with pytest.raises(ConfigError, match="exists and is not a prepared corpus"):
        _run(tmp_path, _source(str(docs)), info, "partial")

    out, meta = _run(tmp_path, _source(str(docs)), info)
    stamp = (out / "metadata.json").stat().st_mtime_ns
    _, meta_again = _run(tmp_path, _source(str(docs)), info)  # up to date: reused
    assert meta_again == meta and (out / "metadata.json").stat().st_mtime_ns == stamp
    with pytest.raises(ConfigError, match="already holds a corpus prepared from another"):
        _run(tmp_path, _source(str(docs), max_documents=2), info)
    other = tokenizer_info(str(bpe_tokenizer(tmp_path / "tok")))
    with pytest.raises(ConfigError, match=r"differs from the tokenizer prepared_dir=") as e:
        check_prepared(str(out), other)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_cli_prepare_reads_the_fit_config_and_overrides(tmp_path: Path) -> None:
    corpus = jsonl(tmp_path / "c.jsonl", [{"body": document(i, 20)} for i in range(30)])
    tok = bpe_tokenizer(tmp_path / "tok")
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--data.paths", str(corpus),
            "--data.text_field", "body", "--data.tokenizer", str(tok),
            "--data.prepared_dir", str(tmp_path / "prepared"), "--data.num_proc", "2"]  # fmt: skip
    # a tokenizer larger than the model's vocabulary fails before any work, in one line: the
    # two runs at once (independent; each process's imports take one core)
    big = word_tokenizer(tmp_path, 1000)
    prepare = [str(ROOT / "cli.py"), "prepare"]
    done, bad = run_many([[*prepare, *args], [*prepare, *args[:-6], "--data.tokenizer", str(big),
                          "--data.prepared_dir", str(tmp_path / "never")]],
                         tmp_path, timeout=300, env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens/s" in done.stdout + done.stderr
    meta = read_metadata(str(tmp_path / "prepared"))
    assert meta is not None and meta["documents"] == 30
    assert meta["tokenizer"]["digest"] == tokenizer_info(str(tok)).digest
    assert bad.returncode != 0
    assert "model.config.vocab_size=257 is smaller than the tokenizer's vocabulary of 1000" in (
        bad.stderr
    )
    assert not (tmp_path / "never").exists()


def _prepared_bytes(tmp_path: Path) -> Path:
    """A byte-level corpus (vocabulary 257, uint16 shards) prepared into ``tmp_path/p``."""
    out, _ = _run(tmp_path, _source(str(text_files(tmp_path / "src", n=6, words=40))),
                  tokenizer_info(None), name="p")  # fmt: skip
    return out


def test_a_token_id_outside_the_vocabulary_is_named_where_it_is_read(tmp_path: Path) -> None:
    """Issue 40: ids above the vocabulary written into ``train/00000.bin`` trained at a
    plausible loss (the vocabulary-parallel embedding and loss drop ids outside every rank's
    range). Reading the sample now raises one line naming the shard, the id and its offset, in
    the main process and through a DataLoader worker alike."""
    import torch

    from lightning_sp.data import TextDataModule
    from lightning_sp.data.tokens import CorruptShardError

    out = _prepared_bytes(tmp_path)
    shard = out / "train" / "00000.bin"
    ids = np.memmap(shard, dtype=np.uint16, mode="r+")
    ids[70] = 300  # in sample 70 // 17 = 4 at seq_length 16
    ids.flush()
    del ids
    data = TextDataModule(prepared_dir=str(out), seq_length=16, batch_size=1)
    data.setup("fit")  # opening reads no token
    assert data.train_dataset is not None
    data.train_dataset[3]  # a whole sample before it
    expected = (
        rf"^{shard}: token id 300 \(first bad id at token 70 of the shard\) is outside the "
        r"tokenizer's vocabulary of 257 ids; the prepared corpus is damaged: prepare it again$"
    )
    try:
        data.train_dataset[4]
        message = None
    except CorruptShardError as error:
        message = str(error)
    assert message is not None, (
        "sample 4 holds token id 300 of a vocabulary of 257 and was read without a word (ids "
        "not checked where read)"
    )
    assert re.match(expected, message), message
    loader = torch.utils.data.DataLoader(data.train_dataset, sampler=[4], num_workers=1)
    with pytest.raises(CorruptShardError, match=expected):
        next(iter(loader))


def test_damaged_prepared_files_are_one_line_at_open(tmp_path: Path) -> None:
    """Issue 40: a cut ``.bin`` failed at the first batch (101 lines), a deleted one at open
    (105), a cut ``index.json`` in 67 lines. Each is one line naming the file when the data
    module is built (before any rank starts under the command line), without reading a
    token."""
    from jsonargparse import Namespace

    from lightning_sp.cli.checks import check_prepared_files
    from lightning_sp.data import TextDataModule

    out = _prepared_bytes(tmp_path)
    whole = {p: p.read_bytes() for p in (out / "train").iterdir()}
    shard, index = out / "train" / "00000.bin", out / "train" / "index.json"
    tokens = json.loads(index.read_text())["shards"][0]["tokens"]
    cases = [
        (lambda: shard.write_bytes(whole[shard][:-6]),
         rf"^{shard} holds {2 * tokens - 6} bytes, index.json says {tokens} tokens of 2 "
         rf"byte\(s\) = {2 * tokens} bytes \(cut or overwritten\); the prepared corpus is "
         r"damaged: prepare it again$"),
        (lambda: shard.unlink(),
         rf"^{shard} is missing \({tokens} tokens by index.json\); the prepared corpus is "
         r"damaged"),
        (lambda: index.write_bytes(whole[index][:40]),
         rf"^{index} is not a prepared split's index \(JSONDecodeError: .*\); the prepared "
         r"corpus is damaged: prepare it again$"),
        (lambda: index.unlink(), rf"^{index} cannot be read \(No such file or directory\)"),
    ]  # fmt: skip
    for damage, match in cases:
        for path, content in whole.items():
            path.write_bytes(content)
        damage()
        with pytest.raises(ConfigError, match=match) as error:
            TextDataModule(prepared_dir=str(out), seq_length=16, batch_size=1)
        assert "\n" not in str(error.value), str(error.value)
        # fit's pre-launch check, before Lightning seeds (no "Seed set to" line before it)
        with pytest.raises(ConfigError, match=match):
            check_prepared_files(Namespace(prepared_dir=str(out), paths=None, blend=None,
                                           dataset_name=None))  # fmt: skip


@pytest.mark.slow
def test_a_corrupt_sample_only_rank_1_reads_ends_the_run_with_its_line(tmp_path: Path) -> None:
    """``cli.py fit`` on 2 data-parallel ranks, a token id outside the vocabulary in the first
    sample rank 1 reads (and in none rank 0 reads): exit 2 and one line, printed by rank 0,
    naming the shard, the id and rank 1 (before: rc 0 and a plausible loss)."""
    from lightning_sp.data import TextDataModule
    from lightning_sp.data.order import SampleOrder
    from lightning_sp.data.sampler import ResumableSampler

    from cli_runs import SMALL, TINY, error_lines, run

    seq, batch = 64, 4
    data = TextDataModule(paths=str(text_files(tmp_path / "src", n=12, words=60)),
                          prepared_dir=str(tmp_path / "p"), seq_length=seq, batch_size=batch,
                          val_fraction=0.1)  # fmt: skip
    data.prepare_corpus(log=lambda _: None)
    data.setup("fit")
    assert data.train_dataset is not None
    order = SampleOrder(data.train_dataset.counts, None, data.seed)
    first = [list(ResumableSampler(data.train_dataset, order, 2, r))[:batch] for r in (0, 1)]
    sample = first[1][0]
    assert sample not in first[0]
    ids = np.memmap(tmp_path / "p" / "train" / "00000.bin", dtype=np.uint16, mode="r+")
    ids[sample * (seq + 1) + 5] = 999
    ids.flush()
    del ids
    args = [str(ROOT / "cli.py"), "fit", "--config", TINY, *SMALL,
            "--data.prepared_dir", str(tmp_path / "p"), "--data.max_documents", "null",
            "--trainer.strategy.init_args.tensor_parallel_size", "1",
            "--model.config.sequence_parallel", "false", "--trainer.max_steps", "2",
            "--trainer.callbacks", "null", "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    done = run(args, tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = error_lines(done.stderr)
    shard = tmp_path / "p" / "train" / "00000.bin"
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith(f"error: {shard}: token id 999 (first bad id at token "), errors
    assert "prepare it again (found by rank 1)" in errors[0], errors[0]


def test_a_token_id_equal_to_the_vocabulary_size_is_outside_it(tmp_path: Path) -> None:
    """The vocabulary of 257 ids is ids 0 .. 256: id 257 (the size itself) is outside it and
    named where read, like any larger id; 256 (the last id) is read as is."""
    from lightning_sp.data.tokens import CorruptShardError

    out = _prepared_bytes(tmp_path)
    shard = out / "train" / "00000.bin"
    ids = np.memmap(shard, dtype=np.uint16, mode="r+")
    ids[5], ids[40] = 256, 257
    ids.flush()
    del ids
    split = TokenSplit(str(out), "train", vocab_size=257)
    assert split.read(0, 17)[5] == 256, "the last id of the vocabulary not read as is"
    try:
        split.read(34, 17)
        message = None
    except CorruptShardError as error:
        message = str(error)
    assert message is not None, (
        "token id 257 of a vocabulary of 257 ids (0 .. 256) was read without a word: the check "
        "lets the vocabulary size itself through"
    )
    assert "token id 257 (first bad id at token 40 of the shard)" in message, message


def test_a_prepared_corpus_is_not_reused_for_another_source_or_split(tmp_path: Path) -> None:
    """A prepared directory is reused only for the source and split it was prepared from: a
    source file edited in place to the same size (its contents changed, its size not), or
    another ``val_fraction`` or ``seed``, is refused in one line, not trained on as stale
    tokens or another split."""
    docs = text_files(tmp_path, n=4, words=10)
    info = tokenizer_info(None)
    _run(tmp_path, _source(str(docs)), info)
    changed = {
        "val_fraction 0.5 for 0.25": lambda: _run(tmp_path, _source(str(docs)), info,
                                                  val_fraction=0.5),
        "seed 4 for 3": lambda: _run(tmp_path, _source(str(docs)), info, seed=4),
    }  # fmt: skip
    first = docs / "doc00.txt"
    text = first.read_text()
    stamp = first.stat().st_mtime_ns

    def edit() -> None:  # the same number of bytes, the first word another
        first.write_text(text.replace(text.split()[2], text.split()[2][::-1], 1))
        assert first.stat().st_size == len(text.encode()) and first.read_text() != text
        os.utime(first, ns=(stamp + 10**9, stamp + 10**9))  # a later modification time
        _run(tmp_path, _source(str(docs)), info)

    changed["a source file edited to the same size"] = edit
    for what, again in changed.items():
        try:
            again()
            line = None
        except ConfigError as error:
            line = str(error)
        assert line is not None, (
            f"{what}: the prepared corpus was reused as up to date (its identity does not hold it)"
        )
        assert "already holds a corpus prepared from another" in line and "\n" not in line, line
