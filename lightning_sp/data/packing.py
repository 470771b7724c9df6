"""Packed token bins, written once: what chat SFT (:mod:`lightning_sp.data.chat`) and
preference data (:mod:`lightning_sp.data.preference`) share once their rows are rendered.

An item is one or more documents (``(ids, mask)``: a conversation; a preference pair's chosen
and rejected sequences), kept together in one bin of ``width = seq_length + 1`` tokens; bins
are filled first-fit (:func:`first_fit`), the rest of a bin one padding document of the
end-of-document token with no loss. :func:`prepare_packed` draws the validation split, writes
each split's tokens and ``flags.bin`` (one byte per token: bit 0 an assistant token, bit 1 a
document start) and the metadata into a temporary directory, and publishes it by one rename: a
crash leaves the previous directory or none.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from lightning_sp.data.prepare import FORMAT, METADATA, read_metadata
from lightning_sp.errors import ConfigError

ASSISTANT, START = 1, 2
"""Bits of ``flags.bin``: an assistant token (its loss counts as a label), a document start."""
FLAGS_FILE = "flags.bin"

Overflow = Literal["truncate", "refuse"]

Document = tuple[list[int], list[int]]
"""A document's token ids and its loss mask (1: an assistant token)."""


def check_target(directory: str, overflow: str) -> None:
    """``overflow`` one of :data:`Overflow`, and ``directory`` new, empty or a prepared chat
    corpus (one line each, before anything is read)."""
    if overflow not in ("truncate", "refuse"):
        raise ConfigError(f"overflow={overflow!r} is invalid; valid: 'truncate', 'refuse'")
    existing = read_metadata(directory)
    if os.path.isdir(directory) and os.listdir(directory) and not (existing or {}).get("chat"):
        raise ConfigError(
            f"prepared_dir={directory!r} exists and is not a prepared chat corpus; give a new "
            "or empty directory"
        )


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit packing: bins (lists of item indices, in order) of total length at most
    ``capacity``; every item of length <= ``capacity`` lands in exactly one bin."""
    bins: list[list[int]] = []
    room: list[int] = []
    for item, length in enumerate(lengths):
        for b, free in enumerate(room):
            if length <= free:
                bins[b].append(item)
                room[b] -= length
                break
        else:
            bins.append([item])
            room.append(capacity - length)
    return bins


def pack(items: list[list[Document]], width: int, eos_id: int) -> list[Document]:
    """``items`` (each its documents, kept together) packed first-fit into bins of ``width``
    tokens, each ``(ids, flags)`` filled up by one padding document of ``eos_id``."""
    lengths = [sum(len(ids) for ids, _ in docs) for docs in items]
    packed = []
    for members in first_fit(lengths, width):
        ids: list[int] = []
        flags: list[int] = []
        for i in members:
            for seq, mask in items[i]:
                flags += [ASSISTANT * m for m in mask]
                flags[len(ids)] |= START
                ids += seq
        start = len(ids)
        if start < width:  # the rest: one padding document, no loss
            ids += [eos_id] * (width - start)
            flags += [0] * (width - start)
            flags[start] = START
        packed.append((ids, flags))
    return packed


def split_members(count: int, val_fraction: float, seed: int) -> dict[str, list[int]]:
    """The items of each split (``train``, ``val``; in order): ``val_fraction`` of ``count``
    (at least one, and one short of all) drawn by ``seed``, none when it is 0."""
    order = np.random.default_rng(seed).permutation(count)
    n_val = min(count - 1, max(1, round(val_fraction * count))) if val_fraction > 0 else 0
    return {"train": sorted(order[n_val:].tolist()), "val": sorted(order[:n_val].tolist())}


def write_split(
    directory: str, bins: list[Document], dtype: np.dtype, index_fields: dict[str, Any]
) -> dict[str, int]:
    """One split's bins as a token shard, ``flags.bin`` and ``index.json`` (with
    ``index_fields``) under ``directory``; returns its counts."""
    os.makedirs(directory)
    tokens = np.array([t for ids, _ in bins for t in ids], dtype=dtype)
    flags = np.array([f for _, fl in bins for f in fl], dtype=np.uint8)
    tokens.tofile(os.path.join(directory, "00000.bin"))
    flags.tofile(os.path.join(directory, FLAGS_FILE))
    documents = int((flags & START).astype(bool).sum())
    index = {
        "dtype": dtype.name, "tokens": int(tokens.size), "documents": documents,
        "shards": [{"file": "00000.bin", "tokens": int(tokens.size)}], "flags": FLAGS_FILE,
        **index_fields,
    }  # fmt: skip
    with open(os.path.join(directory, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
    return {"tokens": int(tokens.size), "documents": documents, "samples": len(bins)}


def prepare_packed(
    directory: str,
    items: list[list[Document]],
    *,
    info: Any,
    width: int,
    val_fraction: float,
    seed: int,
    fields: dict[str, Any],
    what: str,
    log: Callable[[str], None],
    index_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Split ``items`` (:func:`split_members`), pack each split (:func:`pack`) and publish
    ``directory`` (module docstring) with the metadata: the tokenizer ``info``, ``fields``
    (``chat``, ``preference``), the splits' counts; ``what`` names the items in the log line.
    Returns the metadata."""
    tmp = f"{directory}.tmp-{uuid.uuid4().hex[:8]}"
    counts = {}
    try:
        for split, members in split_members(len(items), val_fraction, seed).items():
            bins = pack([items[i] for i in members], width, info.eos_id)
            counts[split] = write_split(
                os.path.join(tmp, split), bins, info.dtype(), index_fields or {}
            )
        meta = {
            "format": FORMAT,
            "tokenizer": {**info.__dict__, "id": info.id},
            "dtype": info.dtype().name,
            **fields,
            "splits": counts,
            "tokens": sum(c["tokens"] for c in counts.values()),
            "documents": sum(len(docs) for docs in items),
        }
        with open(os.path.join(tmp, METADATA), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(
        f"prepared {what} into {counts['train']['samples']} + {counts['val']['samples']} "
        f"packed samples of {width} tokens -> {directory}"
    )
    return meta
