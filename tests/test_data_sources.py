"""Sources through ``datasets`` loaders: text files, JSONL, Parquet, CSV, ``save_to_disk``;
the prepared token stream is exactly the documents' tokens, each followed by EOS."""

from __future__ import annotations

import os
import re
from pathlib import Path

import datasets
import numpy as np
import pytest

from lightning_sp.data import BYTE_EOS_ID, TextDataModule, TokenSplit
from lightning_sp.errors import ConfigError

from corpora import document, jsonl, text_files, write

EOS = BYTE_EOS_ID


def _prepared(tmp_path: Path, **kwargs) -> TextDataModule:
    kwargs.setdefault("cache_dir", str(tmp_path / "cache"))
    kwargs.setdefault("val_fraction", 0.0)
    dm = TextDataModule(**kwargs)
    dm.prepare_data()
    return dm


def _stream(dm: TextDataModule, split: str = "train") -> list[int]:
    tokens = TokenSplit(dm.directories[0], split)
    return tokens.read(0, tokens.num_tokens).tolist()


def _bytes_with_eos(texts: list[str]) -> list[int]:
    out: list[int] = []
    for t in texts:
        out += [*t.encode("utf-8"), EOS]
    return out


def test_text_files_pack_exactly(tmp_path: Path) -> None:
    a = write(tmp_path / "data" / "a.txt", "abc")
    b = write(tmp_path / "data" / "b.txt", "hello")
    # stream: a b c EOS h e l l o EOS = 10 tokens -> 3 samples of 3 tokens, 1 token dropped
    dm = _prepared(tmp_path, paths=[str(b), str(a)], seq_length=2, batch_size=1)
    dm.setup("fit")
    assert dm.num_tokens == 10 and len(dm.train_dataset) == 3
    rows = [dm.train_dataset.tokens(i).tolist() for i in range(3)]
    assert rows == [[97, 98, 99], [EOS, 104, 101], [108, 108, 111]]
    item = dm.train_dataset[1]
    assert item["input_ids"].tolist() == [EOS, 104] and item["labels"].tolist() == [104, 101]


def test_jsonl_with_a_text_field(tmp_path: Path) -> None:
    rows = [{"content": document(i, 10 + i), "id": i} for i in range(12)]
    path = jsonl(tmp_path / "corpus" / "part.jsonl", rows)
    dm = _prepared(tmp_path, paths=str(path), text_field="content", seq_length=8)
    assert _stream(dm) == _bytes_with_eos([r["content"] for r in rows])  # not JSON syntax


def test_parquet_and_csv_with_a_text_field(tmp_path: Path) -> None:
    texts = [document(i, 5 + i) for i in range(10)]
    table = datasets.Dataset.from_dict({"body": texts, "n": list(range(10))})
    (tmp_path / "corpus").mkdir()
    table.to_parquet(str(tmp_path / "corpus" / "a.parquet"))
    table.to_csv(str(tmp_path / "corpus" / "b.csv"), index=False)
    dm = _prepared(tmp_path, paths=str(tmp_path / "corpus"), text_field="body", seq_length=8)
    assert _stream(dm) == _bytes_with_eos(texts + texts)  # a.parquet, then b.csv


def test_save_to_disk_and_mixed_entries(tmp_path: Path) -> None:
    texts = [document(i, 6) for i in range(8)]
    saved = tmp_path / "corpus" / "saved"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(saved))
    write(tmp_path / "corpus" / "z.txt", "plain file")
    dm = _prepared(tmp_path, paths=str(tmp_path / "corpus"), seq_length=8)
    assert [os.path.basename(e) for e in dm.files] == ["saved", "z.txt"]
    assert _stream(dm) == _bytes_with_eos([*texts, "plain file"])
    dict_saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:2]})}).save_to_disk(
        str(dict_saved)
    )
    assert _stream(_prepared(tmp_path, paths=str(dict_saved), seq_length=4)) == _bytes_with_eos(
        texts[:2]
    )


def test_directory_and_glob_inputs(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write(root / "a.txt", "alpha " * 20)
    write(root / "sub" / "b.txt", "beta " * 20)
    write(root / "sub" / "deeper" / "c.md", "gamma " * 20)
    write(root / ".hidden" / "x.txt", "hidden")
    write(root / ".secret.txt", "hidden")
    names = lambda dm: [os.path.relpath(f, root) for f in dm.files]  # noqa: E731
    kwargs = {"cache_dir": str(tmp_path / "c")}
    by_dir = TextDataModule(paths=str(root), **kwargs)
    assert names(by_dir) == ["a.txt", "sub/b.txt", "sub/deeper/c.md"]
    by_glob = TextDataModule(paths=str(root / "**" / "*.txt"), **kwargs)
    assert names(by_glob) == ["a.txt", "sub/b.txt"]
    mixed = TextDataModule(paths=[str(root / "sub"), str(root / "*.txt"), str(root / "a.txt")])
    assert names(mixed) == ["a.txt", "sub/b.txt", "sub/deeper/c.md"]  # deduplicated, sorted


def test_max_documents_is_a_seeded_sample(tmp_path: Path) -> None:
    docs = text_files(tmp_path, n=10, words=4)
    texts = [p.read_text() for p in sorted(docs.iterdir())]

    def picked(seed: int) -> list[str]:
        dm = _prepared(tmp_path, paths=str(docs), max_documents=4, seed=seed, seq_length=4)
        stream = bytes(t for t in _stream(dm) if t != EOS).decode()
        return [t for t in texts if t in stream]

    assert picked(1) == picked(1) and len(picked(1)) == 4 and picked(1) != picked(2)


def _one_line_error(match: str, tmp_path: Path, **kwargs) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        _prepared(tmp_path, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_jsonl_row_without_the_field_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two"}\n{"title": "no text"}\n')
    message = _one_line_error(r"text_field='text'", tmp_path, paths=str(path))
    assert f"{path} line 4 has no such field" in message  # the blank line 2 is counted
    other = jsonl(tmp_path / "other.jsonl", [{"body": "x"}])
    message = _one_line_error(r"text_field='text' is not a field", tmp_path, paths=str(other))
    assert f"{other} line 1" in message and "['body']" in message
    nested = jsonl(tmp_path / "num.jsonl", [{"text": 3}])
    # the file, the row and the JSON type (was "holds int64, not text", naming neither: issue 32)
    _one_line_error(re.escape(f"{nested} line 1 holds an integer, not a string"), tmp_path,
                    paths=str(nested))  # fmt: skip


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path: Path) -> None:
    """Issue 40: a Latin-1 byte in a JSONL text field ended prepare in a 61-line traceback at
    tokenizing; now one line naming the file and line, before any token is written."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "one"}\n\n{"text": "caf\xe9"}\n')
    message = _one_line_error(r"text_field='text'", tmp_path, paths=str(path))
    assert message.startswith(
        f"text_field='text': {path} line 3 is not UTF-8 text (byte 0xe9 at 3: unexpected "
        "end of data); save the file as UTF-8"
    ), message


def test_missing_paths_and_empty_corpus(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"paths='/nope/\*\.txt' matches no file"):
        TextDataModule(paths="/nope/*.txt")
    with pytest.raises(ConfigError, match=r"paths\[1\]="):
        TextDataModule(paths=[str(write(tmp_path / "a.txt", "x")), str(tmp_path / "missing")])
    write(tmp_path / "empty" / "a.txt", "")
    write(tmp_path / "empty" / "b.txt", "")
    message = _one_line_error("the corpus is empty", tmp_path, paths=str(tmp_path / "empty"))
    assert "2 documents and no text" in message
    assert not (tmp_path / "cache" / "prepared").exists() or not any(
        (tmp_path / "cache" / "prepared").iterdir()
    )  # nothing half-written


def test_stdlib_default_corpus(tmp_path: Path) -> None:
    dm = _prepared(tmp_path, max_documents=5, seq_length=32, batch_size=2, val_fraction=0.2)
    dm.setup("fit")
    assert all(f.endswith(".py") and "site-packages" not in f for f in dm.files)
    meta_docs = sum(TokenSplit(dm.directories[0], s).num_documents for s in ("train", "val"))
    assert meta_docs == 5
    assert int(np.max(dm.train_dataset.tokens(0))) <= EOS


def test_dataset_name_through_load_dataset(tmp_path: Path) -> None:
    """``dataset_name`` goes through ``datasets.load_dataset`` (a Hub name when online); a
    local folder works offline."""
    rows = [{"content": f"row {i} " * 5, "id": i} for i in range(12)]
    folder = tmp_path / "hub_like"
    jsonl(folder / "train.jsonl", rows)
    dm = _prepared(tmp_path, dataset_name=str(folder), text_field="content", seq_length=8)
    assert _stream(dm) == _bytes_with_eos([r["content"] for r in rows])
    message = _one_line_error(r"text_field='text' is not a field", tmp_path,
                              dataset_name=str(folder))  # fmt: skip
    assert "'content'" in message
