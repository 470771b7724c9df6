"""Corpus sources, read through ``datasets`` loaders into one ``text`` column.

A source is a list of local entries (text files, JSONL/JSON, Parquet and CSV files with a text
field, directories saved with ``Dataset.save_to_disk``), or a Hugging Face Hub dataset name.
Plain text files are one document each; every row of the other formats is one document.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import random
import sysconfig
from collections.abc import Iterator
from typing import TYPE_CHECKING

from lightning_sp.errors import ConfigError

if TYPE_CHECKING:  # imported where documents are loaded: `datasets` takes seconds to import
    import datasets
    import pyarrow as pa

KINDS = {  # file name ending -> datasets loader
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
"""Loader of a local file by its name's ending; any other file is plain text (one document)."""

_SKIP_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_python_files() -> list[str]:
    """The ``.py`` files of the running Python's standard library, sorted, without tests and
    third-party packages: the default corpus, present on every machine."""
    root = sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIP_STDLIB_DIRS and not d.startswith(".")]
        files.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
    return sorted(files)


def is_saved_dataset(path: str) -> bool:
    """Whether ``path`` is a directory written by ``Dataset(Dict).save_to_disk``."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json"))
        and os.path.isfile(os.path.join(path, "dataset_info.json"))
    )


def file_kind(path: str) -> str:
    """``json``, ``parquet``, ``csv``, ``saved`` (a ``save_to_disk`` directory) or ``text``."""
    if os.path.isdir(path):
        return "saved"
    name = path.lower()
    return next((kind for end, kind in KINDS.items() if name.endswith(end)), "text")


def _files_under(directory: str) -> list[str]:
    """Every regular file under ``directory``, recursively, skipping hidden names and caches;
    a ``save_to_disk`` directory counts as one entry."""
    if is_saved_dataset(directory):
        return [directory]
    found: list[str] = []
    for root, subdirs, names in os.walk(directory, followlinks=True):
        saved = [d for d in subdirs if is_saved_dataset(os.path.join(root, d))]
        found.extend(os.path.join(root, d) for d in saved)
        subdirs[:] = [
            d for d in subdirs if not d.startswith(".") and d != "__pycache__" and d not in saved
        ]
        files = (os.path.join(root, n) for n in names if not n.startswith("."))
        found.extend(f for f in files if os.path.isfile(f))
    return found


def resolve_paths(paths: str | list[str]) -> list[str]:
    """Expand files, directories (recursively) and glob patterns into a sorted list of entries
    (files, and ``save_to_disk`` directories).

    Raises:
        ConfigError: an entry matches nothing.
    """
    entries = [paths] if isinstance(paths, str) else list(paths)
    if not entries:
        raise ConfigError(
            "paths=[] names no file; give text/JSONL/Parquet/CSV files, directories or glob "
            "patterns, or leave paths unset for the standard-library corpus"
        )
    files: set[str] = set()
    for i, entry in enumerate(entries):
        field = "paths" if isinstance(paths, str) else f"paths[{i}]"
        path = os.path.expanduser(str(entry))
        if os.path.isfile(path):
            found = [path]
        elif os.path.isdir(path):
            found = _files_under(path)
        else:
            found = []
            for match in glob.glob(path, recursive=True):
                found.extend(_files_under(match) if os.path.isdir(match) else [match])
        if not found:
            raise ConfigError(
                f"{field}={entry!r} matches no file; give existing files, directories "
                "or glob patterns"
            )
        files.update(os.path.abspath(f) for f in found)
    return sorted(files)


@dataclasses.dataclass(frozen=True)
class Source:
    """Where the documents come from (one of ``entries`` or ``dataset_name``).

    Attributes:
        entries: Resolved local files and ``save_to_disk`` directories, sorted.
        dataset_name: A Hub dataset (its ``train`` split); needs network access.
        text_field: The field/column holding the text in every non-plain-text entry.
        max_documents: Keep a seeded sample of this many documents; ``None``: all.
        seed: Seed of that sample.
    """

    entries: tuple[str, ...]
    dataset_name: str | None
    text_field: str
    max_documents: int | None
    seed: int

    def fingerprint(self) -> str:
        """sha256 over what determines the documents: entries with their sizes and
        modification times (a save_to_disk directory by its state), the Hub name, the text
        field and the document sample. Computed from metadata only: nothing is read."""
        parts: list[object] = [self.dataset_name, self.text_field, self.max_documents, self.seed]
        for entry in self.entries:
            if os.path.isdir(entry):
                states = sorted(glob.glob(os.path.join(entry, "**", "*.json"), recursive=True))
                parts.append([entry, [(s, _read(s)) for s in states]])
            else:
                stat = os.stat(entry)
                parts.append([entry, stat.st_size, stat.st_mtime_ns])
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def describe(self) -> str:
        """One line naming the source, for metadata and logs."""
        if self.dataset_name is not None:
            return f"hub:{self.dataset_name}"
        head = ", ".join(self.entries[:3])
        return f"{len(self.entries)} entries ({head}{', ...' if len(self.entries) > 3 else ''})"


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _text_documents(files: list[str]) -> Iterator[dict[str, str]]:
    """``Dataset.from_generator`` source: one row per plain-text file."""
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield {"text": f.read()}


def _row_to_line(path: str, row: int) -> int:
    """1-based line of the ``row``-th (0-based) JSON record of a JSONL file (blank lines
    skipped, as the loader does)."""
    seen = -1
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            seen += bool(line.strip())
            if seen == row:
                return number
    return row + 1


def _check_text_field(ds: datasets.Dataset, where: str, path: str, kind: str, field: str) -> None:
    """Every row has a string ``field``, else one line naming the file and line (row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    hint = "set data.text_field to the field holding the text"
    if field not in ds.column_names:
        place = f"{where} line 1" if kind == "json" else where
        raise ConfigError(
            f"text_field={field!r} is not a field of {place}; its fields are "
            f"{ds.column_names}; {hint}"
        )
    column = ds.data.column(field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        row, kind_of = _first_non_text(column)
        place = f"line {_row_to_line(path, row)}" if kind == "json" else f"row {row}"
        raise ConfigError(
            f"text_field={field!r}: {where} {place} holds {kind_of}, not a string; each "
            "document's text must be a string"
        )
    invalid = _first_invalid_utf8(column)
    if invalid is not None:
        row, reason = invalid
        place = f"line {_row_to_line(path, row)}" if kind == "json" else f"row {row}"
        raise ConfigError(
            f"text_field={field!r}: {where} {place} is not UTF-8 text ({reason}); save the "
            "file as UTF-8"
        )
    nulls = pc.is_null(column)
    if pc.any(nulls).as_py():
        row = int(pc.index(nulls, True).as_py())
        place = f"line {_row_to_line(path, row)}" if kind == "json" else f"row {row}"
        raise ConfigError(f"text_field={field!r}: {where} {place} has no such field; {hint}")


def _first_invalid_utf8(column: pa.ChunkedArray) -> tuple[int, str] | None:
    """``(row, reason)`` of the first value of a string ``column`` that is not valid UTF-8
    (Arrow's JSON and CSV readers let such bytes through), else None."""
    import pyarrow as pa

    base = 0
    for chunk in column.chunks:
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid:
            for row, value in enumerate(chunk.cast(pa.binary()).to_pylist()):
                try:
                    (value or b"").decode("utf-8")
                except UnicodeDecodeError as error:
                    byte = value[error.start]
                    return base + row, f"byte {byte:#04x} at {error.start}: {error.reason}"
        base += len(chunk)
    return None


def _first_non_text(column: pa.ChunkedArray) -> tuple[int, str]:
    """``(row, JSON type name)`` of the first value of ``column`` that is not a string (a column
    of mixed JSON types arrives as ``extension<arrow.json>``, each value JSON-encoded)."""
    mixed = "json" in str(column.type)
    names = {bool: "a boolean", int: "an integer", float: "a number", list: "a list",
             dict: "an object", type(None): "null"}  # fmt: skip
    for row, value in enumerate(column.to_pylist()):
        if mixed and isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, str):
            return row, names.get(type(value), type(value).__name__)
    return 0, str(column.type)


def _load_entry(path: str, kind: str, field: str, cache_dir: str | None) -> datasets.Dataset:
    """One local file or saved directory as a ``text`` dataset."""
    import datasets

    try:
        if kind == "saved":
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ConfigError(
                        f"paths entry {path!r} is a saved DatasetDict without a 'train' "
                        f"split; its splits are {list(ds)}"
                    )
                ds = ds["train"]
        else:
            ds = datasets.load_dataset(kind, data_files=[path], split="train", cache_dir=cache_dir)
    except ConfigError:
        raise
    except Exception as e:
        reason = (str(e).splitlines() or [""])[0]
        raise ConfigError(
            f"paths entry {path!r} could not be read as {kind} ({type(e).__name__}: {reason})"
        ) from e
    _check_text_field(ds, path, path, kind, field)
    return _text_column(ds, field)


def _text_column(ds: datasets.Dataset, field: str) -> datasets.Dataset:
    """Only ``field``, renamed ``text``."""
    ds = ds.select_columns([field])
    return ds if field == "text" else ds.rename_column(field, "text")


def load_documents(source: Source, cache_dir: str | None = None) -> datasets.Dataset:
    """The source's documents as a ``datasets.Dataset`` with one string column ``text``, in
    entry order (then row order), after the seeded ``max_documents`` sample.

    Raises:
        ConfigError: an entry cannot be read, lacks the text field (file and line named), or
            the Hub dataset cannot be loaded.
    """
    import datasets

    parts: list[datasets.Dataset] = []
    if source.dataset_name is not None:
        try:
            ds = datasets.load_dataset(source.dataset_name, split="train", cache_dir=cache_dir)
        except Exception as e:
            reason = (str(e).splitlines() or [""])[0]
            raise ConfigError(
                f"dataset_name={source.dataset_name!r} could not be loaded "
                f"({type(e).__name__}: {reason}); check the name and network access, or give "
                "local files with paths"
            ) from e
        _check_text_field(ds, f"dataset {source.dataset_name!r}", "", "hub", source.text_field)
        parts.append(_text_column(ds, source.text_field))
    text_run: list[str] = []
    for entry in [*source.entries, None]:  # None flushes the last run of text files
        kind = file_kind(entry) if entry is not None else None
        if kind != "text" and text_run:
            parts.append(
                datasets.Dataset.from_generator(
                    _text_documents,
                    features=datasets.Features({"text": datasets.Value("string")}),
                    gen_kwargs={"files": list(text_run)},
                    cache_dir=cache_dir,
                    # keyed on paths, sizes and modification times: an edited file is re-read
                    fingerprint=Source(tuple(text_run), None, "text", None, 0).fingerprint(),
                )
            )
            text_run = []
        if entry is not None and kind == "text":
            text_run.append(entry)
        elif entry is not None and kind is not None:
            parts.append(_load_entry(entry, kind, source.text_field, cache_dir))
    text = datasets.Features({"text": datasets.Value("string")})
    parts = [p if p.features == text else p.cast(text) for p in parts]
    docs = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if source.max_documents is not None and source.max_documents < len(docs):
        rows = random.Random(source.seed).sample(range(len(docs)), source.max_documents)
        docs = docs.select(sorted(rows))
    return docs
