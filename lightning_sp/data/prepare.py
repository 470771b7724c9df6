"""``prepare``: tokenize a corpus once into a directory of memory-mappable token shards.

Layout of a prepared directory (``FORMAT`` 1)::

    metadata.json          tokenizer (id, sha256, EOS id, vocabulary), dtype, source
                           fingerprint, split sizes; written last, so its presence means complete
    train/index.json       shards in order, with their token counts; token and document counts
    train/00000.bin ...    raw token ids (uint16 when the vocabulary fits, else uint32): every
                           document followed by EOS, documents concatenated
    train/documents.idx    uint64 end offset of every document in the split's token stream
    val/...                the same for the validation documents

A directory is written under a temporary sibling name and renamed into place at the end, so a
half-done prepare (killed, failed) is never taken for a complete one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_sp.data.sources import Source, load_documents
from lightning_sp.data.tokenizer import Tokenize, TokenizerInfo
from lightning_sp.errors import ConfigError

FORMAT = 1
"""Version of the prepared layout; a directory of another version is prepared again."""
METADATA = "metadata.json"
SPLITS = ("train", "val")
SHARD_TOKENS = 1 << 28
"""Tokens per shard file (512 MiB at uint16)."""

if TYPE_CHECKING:  # imported where a corpus is prepared: `datasets` takes seconds to import
    import datasets
    from tqdm.auto import tqdm


def _token_ids() -> datasets.Features:
    """The tokenized column's features: ``input_ids``, a list of int32."""
    import datasets

    int32_list = getattr(datasets, "List", None) or datasets.Sequence
    return datasets.Features({"input_ids": int32_list(datasets.Value("int32"))})


@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    """How a source is cut and tokenized (all part of the prepared directory's identity).

    Attributes:
        val_fraction: Fraction of the documents held out for validation, in [0, 1).
        seed: Seed of the document split.
        num_proc: Tokenizing processes (``datasets``' ``map(num_proc=...)``).
        shard_tokens: Tokens per shard file.
    """

    val_fraction: float
    seed: int
    num_proc: int = 1
    shard_tokens: int = SHARD_TOKENS


def read_metadata(directory: str) -> dict[str, Any] | None:
    """The metadata of a complete prepared directory of this ``FORMAT``, else ``None``."""
    try:
        with open(os.path.join(directory, METADATA), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if meta.get("format") == FORMAT else None


def check_prepared(directory: str, tokenizer: TokenizerInfo) -> dict[str, Any]:
    """The metadata of ``directory``, checked against the configured tokenizer.

    Raises:
        ConfigError: not a complete prepared directory, or prepared with another tokenizer.
    """
    meta = read_metadata(directory)
    if meta is None:
        raise ConfigError(
            f"prepared_dir={directory!r} is not a complete prepared corpus (no {METADATA} of "
            f"format {FORMAT}); run `python cli.py prepare --config <config>` first"
        )
    if meta["tokenizer"]["digest"] != tokenizer.digest:
        raise ConfigError(
            f"tokenizer={tokenizer.path or 'bytes'!r} (sha256 {tokenizer.digest[:16]}) differs "
            f"from the tokenizer prepared_dir={directory!r} was prepared with "
            f"({meta['tokenizer']['id']}); use that tokenizer or prepare again"
        )
    return meta


def _document_split(n: int, settings: PrepareSettings) -> dict[str, np.ndarray]:
    """Sorted document indices of each split: a seeded sample of documents is held out."""
    n_val = 0
    if settings.val_fraction > 0:
        if n < 2:
            raise ConfigError(
                f"val_fraction={settings.val_fraction} needs at least 2 documents, the corpus "
                f"has {n}; add documents or set val_fraction 0"
            )
        n_val = min(n - 1, max(1, round(settings.val_fraction * n)))
    order = np.random.default_rng(settings.seed).permutation(n)
    return {"train": np.sort(order[n_val:]), "val": np.sort(order[:n_val])}


def _write_split(
    tokenized: datasets.Dataset, directory: str, dtype: np.dtype, shard_tokens: int, bar: tqdm
) -> dict[str, int]:
    """Stream ``input_ids`` rows into shard files; returns token and document counts."""
    import pyarrow.compute as pc

    os.makedirs(directory)
    shards: list[dict[str, Any]] = []
    total = documents = 0
    out = None
    with open(os.path.join(directory, "documents.idx"), "wb") as ends:
        for table in tokenized.with_format("arrow").iter(batch_size=1024):
            column = table.column("input_ids")
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            tokens = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(dtype)
            (total + np.cumsum(lengths, dtype=np.uint64)).astype(np.uint64).tofile(ends)
            documents += len(lengths)
            while tokens.size:
                if out is None or shards[-1]["tokens"] == shard_tokens:
                    if out is not None:
                        out.close()
                    shards.append({"file": f"{len(shards):05d}.bin", "tokens": 0})
                    out = open(os.path.join(directory, shards[-1]["file"]), "wb")  # noqa: SIM115
                room = shard_tokens - shards[-1]["tokens"]
                tokens[:room].tofile(out)
                shards[-1]["tokens"] += min(room, tokens.size)
                total += min(room, tokens.size)
                tokens = tokens[room:]
            bar.update(len(lengths))
            bar.set_postfix(split=os.path.basename(directory), tokens=f"{total:,}")
    if out is not None:
        out.close()
    index = {"dtype": dtype.name, "tokens": total, "documents": documents, "shards": shards}
    with open(os.path.join(directory, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
    return {"tokens": total, "documents": documents}


def _check_not_empty(docs: datasets.Dataset, source: Source) -> None:
    """Fail before tokenizing when the corpus holds no text at all."""
    import pyarrow.compute as pc

    size = pc.sum(pc.binary_length(docs.data.column("text"))).as_py() if len(docs) else 0
    if not size:
        raise ConfigError(
            f"the corpus is empty: {source.describe()} holds {len(docs)} documents and no "
            "text; give files with text"
        )


def prepare(
    source: Source,
    tokenizer: TokenizerInfo,
    directory: str,
    settings: PrepareSettings,
    cache_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Tokenize ``source`` once into ``directory``; returns its metadata.

    A complete directory prepared from the same source and tokenizer is reused as is.

    Raises:
        ConfigError: ``directory`` holds something else (another source, tokenizer or files),
            the corpus is empty, or a document lacks the text field.
    """
    from tqdm.auto import tqdm

    directory = os.path.abspath(os.path.expanduser(directory))
    identity = {
        "fingerprint": source.fingerprint(),
        "val_fraction": settings.val_fraction,
        "seed": settings.seed,
    }
    existing = read_metadata(directory)
    if existing is not None:
        same = existing["source"]["identity"] == identity
        if same and existing["tokenizer"]["digest"] == tokenizer.digest:
            log(f"prepared corpus up to date: {directory}")
            return existing
        raise ConfigError(
            f"prepared_dir={directory!r} already holds a corpus prepared from another source, "
            "split or tokenizer; remove it or choose another prepared_dir"
        )
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise ConfigError(
            f"prepared_dir={directory!r} exists and is not a prepared corpus; give a new or "
            "empty directory"
        )

    start = time.perf_counter()
    docs = load_documents(source, cache_dir)  # raises on a missing text field
    _check_not_empty(docs, source)
    splits = _document_split(len(docs), settings)
    dtype = tokenizer.dtype()
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(os.path.join(tmp, "cache"))
    try:
        counts: dict[str, dict[str, int]] = {}
        with tqdm(total=len(docs), desc="Writing tokens", unit="doc") as bar:
            for split in SPLITS:
                part = docs.select(splits[split])
                tokenized = part.map(
                    Tokenize(tokenizer),
                    batched=True,
                    batch_size=256,
                    num_proc=settings.num_proc if settings.num_proc > 1 else None,
                    remove_columns=["text"],
                    features=_token_ids(),
                    cache_file_name=os.path.join(tmp, "cache", f"{split}.arrow"),
                    desc=f"Tokenizing {split}",
                )
                counts[split] = _write_split(
                    tokenized, os.path.join(tmp, split), dtype, settings.shard_tokens, bar
                )
                del tokenized
        shutil.rmtree(os.path.join(tmp, "cache"))
        seconds = time.perf_counter() - start
        tokens = sum(c["tokens"] for c in counts.values())
        meta = {
            "format": FORMAT,
            "tokenizer": {**dataclasses.asdict(tokenizer), "id": tokenizer.id},
            "dtype": dtype.name,
            "source": {
                "identity": identity,
                "description": source.describe(),
                "text_field": source.text_field,
                "max_documents": source.max_documents,
            },
            "splits": counts,
            "tokens": tokens,
            "documents": len(docs),
            "prepare_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
        }
        with open(os.path.join(tmp, METADATA), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        if os.path.isdir(directory) and not os.listdir(directory):
            os.rmdir(directory)
        try:
            os.rename(tmp, directory)
        except OSError:  # another process (node) finished the same prepare first
            if read_metadata(directory) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(
        f"prepared {tokens:,} tokens in {len(docs):,} documents ({dtype.name}) in "
        f"{seconds:.1f} s: {tokens / max(seconds, 1e-9):,.0f} tokens/s -> {directory}"
    )
    return meta
