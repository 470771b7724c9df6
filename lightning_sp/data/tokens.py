"""Memory-mapped token shards of a prepared directory, cut into packed samples by index.

Nothing is read whole: a shard is ``np.memmap``-ed on first access (in the process that reads
it, so DataLoader workers open their own maps) and a sample reads only its ``s + 1`` tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_sp.data.chat import flags_to_sample
from lightning_sp.data.documents import DocumentOptions, annotate
from lightning_sp.data.preference import REFERENCE, REFERENCE_FILE, with_sequences
from lightning_sp.errors import ConfigError
from lightning_sp.runtime.agree import LocalError


class CorruptShardError(LocalError):
    """A prepared shard holds a token id outside the vocabulary (one line naming the shard).
    Found by the rank that reads the sample (:class:`~lightning_sp.runtime.agree.LocalError`);
    re-raised from a DataLoader worker, which rebuilds it from the worker's traceback text,
    it keeps its own line."""

    def __init__(self, message: str) -> None:
        marker = f"{type(self).__name__}: "
        if "Traceback" in message and marker in message:  # DataLoader's re-raise
            message = message.rsplit(marker, 1)[1].strip().splitlines()[0]
        super().__init__(message)


class TokenSplit:
    """One split (``train`` / ``val``) of a prepared directory as a token stream.

    Opening it checks, without reading a token, that ``index.json`` is readable and that every
    shard file (and the chat flags file) holds exactly the tokens the index counts: a cut,
    missing or unreadable file is one ``ConfigError`` line naming it. With ``vocab_size``,
    every read checks its ids against the vocabulary (one max per shard piece read; a
    sample's ``s + 1`` tokens): an id outside it is :class:`CorruptShardError`, naming the
    shard and the token's offset in it (the vocabulary-parallel embedding and loss would drop
    such an id without a word).

    Args:
        directory: The prepared directory.
        split: ``train`` or ``val``.
        vocab_size: The tokenizer's vocabulary (ids ``0 .. vocab_size - 1``); None: unchecked.
    """

    def __init__(self, directory: str, split: str, vocab_size: int | None = None) -> None:
        self.directory = os.path.join(directory, split)
        self.vocab_size = vocab_size
        index = _read_index(self.directory)
        self.dtype = np.dtype(index["dtype"])
        self.files = [os.path.join(self.directory, s["file"]) for s in index["shards"]]
        counts = [int(s["tokens"]) for s in index["shards"]]
        self.ends = np.cumsum(counts, dtype=np.int64)
        self.num_tokens = int(self.ends[-1]) if len(self.ends) else 0
        self.num_documents = int(index["documents"])
        flags = index.get("flags")  # chat SFT: one uint8 per token (lightning_sp.data.chat)
        self.flags_file = os.path.join(self.directory, flags) if flags else None
        for file, count in zip(self.files, counts, strict=True):
            _check_size(file, count, self.dtype.itemsize)
        if self.flags_file is not None:
            _check_size(self.flags_file, self.num_tokens, 1)
        self.preference = bool(index.get("preference"))
        """Preference pairs (:mod:`lightning_sp.data.preference`): samples carry
        ``sequences``."""
        self.reference_file = os.path.join(self.directory, REFERENCE_FILE)
        """Preference pairs: each sample's reference log-probabilities ``[samples, K]``
        (float64, ``.npy``), once :func:`~lightning_sp.data.preference.store_reference` wrote
        them (``dpo.reference: precomputed``)."""
        self._maps: list[np.memmap] | None = None
        self._flags: np.memmap | None = None
        self._reference: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:  # workers map the files
        return {**self.__dict__, "_maps": None, "_flags": None, "_reference": None}

    def reference_row(self, j: int) -> np.ndarray | None:
        """Sample ``j``'s stored reference log-probabilities ``[K]`` (a copy), ``None`` if
        none were stored."""
        if self._reference is None:
            if not os.path.exists(self.reference_file):
                return None
            self._reference = np.load(self.reference_file, mmap_mode="r")
        return np.array(self._reference[j])

    def _shard(self, i: int) -> np.memmap:
        if self._maps is None:
            self._maps = [None] * len(self.files)  # type: ignore[list-item]
        if self._maps[i] is None:
            self._maps[i] = np.memmap(self.files[i], dtype=self.dtype, mode="r")
        return self._maps[i]

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of the split's stream as int64 (a copy)."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        shard = int(np.searchsorted(self.ends, start, side="right"))
        while done < count:
            base = int(self.ends[shard - 1]) if shard else 0
            offset = start + done - base
            piece = self._shard(shard)[offset : offset + count - done]
            if self.vocab_size is not None and piece.size and int(piece.max()) >= self.vocab_size:
                self._out_of_vocabulary(shard, offset, piece)
            out[done : done + piece.size] = piece
            done += piece.size
            shard += 1
        return out

    def _out_of_vocabulary(self, shard: int, offset: int, piece: np.ndarray) -> None:
        where = offset + int(np.argmax(piece >= self.vocab_size))
        raise CorruptShardError(
            f"{self.files[shard]}: token id {int(piece.max())} (first bad id at token {where} "
            f"of the shard) is outside the tokenizer's vocabulary of {self.vocab_size} ids; "
            "the prepared corpus is damaged: prepare it again"
        )

    def read_flags(self, start: int, count: int) -> np.ndarray:
        """Flags ``[start, start + count)`` (uint8, a copy) of a chat split."""
        if self.flags_file is None:
            raise ValueError(f"{self.directory} has no flags (not a chat SFT split)")
        if self._flags is None:
            self._flags = np.memmap(self.flags_file, dtype=np.uint8, mode="r")
        return np.array(self._flags[start : start + count])


def _read_index(directory: str) -> dict[str, Any]:
    """A split's ``index.json``, checked to hold what :class:`TokenSplit` reads (one line
    naming the file otherwise)."""
    path = os.path.join(directory, "index.json")
    again = "the prepared corpus is damaged: prepare it again"
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
        shards = index["shards"]
        for shard in shards:
            if not isinstance(shard["file"], str) or int(shard["tokens"]) < 0:
                raise ValueError(f"shard {shard!r}")
        np.dtype(index["dtype"])
        int(index["documents"])
    except OSError as error:
        raise ConfigError(f"{path} cannot be read ({error.strerror}); {again}") from None
    except (ValueError, KeyError, TypeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"{path} is not a prepared split's index ({type(error).__name__}: {reason}); {again}"
        ) from None
    return dict(index)


def _check_size(path: str, tokens: int, itemsize: int) -> None:
    """``path`` exists and holds ``tokens`` items of ``itemsize`` bytes (one line if not)."""
    again = "the prepared corpus is damaged: prepare it again"
    try:
        size = os.path.getsize(path)
    except OSError:
        raise ConfigError(f"{path} is missing ({tokens} tokens by index.json); {again}") from None
    if size != tokens * itemsize:
        raise ConfigError(
            f"{path} holds {size} bytes, index.json says {tokens} tokens of {itemsize} byte(s) "
            f"= {tokens * itemsize} bytes (cut or overwritten); {again}"
        )


class PackedSamples(Dataset):
    """Samples of ``seq_length + 1`` consecutive tokens of one or more token streams.

    Sample ``i`` of stream ``k`` is tokens ``[i (s+1), (i+1)(s+1))`` of that stream (the
    remainder is dropped); streams are numbered one after the other (global index = offset of
    the stream + i). Item ``i`` is ``{"input_ids": [s], "labels": [s]}`` (int64), labels being
    the inputs shifted by one.

    Args:
        streams: Token streams (one per blended prepared directory).
        seq_length: Tokens per sample (s).
        documents: What an item carries about the documents inside it
            (:func:`~lightning_sp.data.documents.annotate`: ``documents``, ``positions``,
            ``loss_mask``); needs ``eod_id``.
        eod_id: The end-of-document token that ends every document of the streams.
    """

    def __init__(
        self,
        streams: list[TokenSplit],
        seq_length: int,
        documents: DocumentOptions | None = None,
        eod_id: int | None = None,
    ) -> None:
        self.streams = streams
        self.seq_length = seq_length
        self.documents = documents if documents is not None and documents.any else None
        if self.documents is not None and eod_id is None:
            raise ValueError("PackedSamples with document options needs eod_id")
        self.eod_id = eod_id
        width = seq_length + 1
        self.counts = [s.num_tokens // width for s in streams]
        self.offsets = np.cumsum([0, *self.counts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def tokens(self, i: int) -> np.ndarray:
        """The ``s + 1`` token ids of sample ``i``, int64."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        width = self.seq_length + 1
        return self.streams[k].read((i - int(self.offsets[k])) * width, width)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = torch.from_numpy(self.tokens(int(i)))  # [s + 1]
        k = int(np.searchsorted(self.offsets, int(i), side="right")) - 1
        if self.streams[k].flags_file is not None:  # a packed chat bin: its masks and documents
            width = self.seq_length + 1
            start = (int(i) - int(self.offsets[k])) * width
            flags = torch.from_numpy(self.streams[k].read_flags(start, width))
            sample = flags_to_sample(row, flags)
            if not self.streams[k].preference:
                return sample
            reference = self.streams[k].reference_row(int(i) - int(self.offsets[k]))
            if reference is not None:  # [K], dpo.reference: precomputed
                sample = {**sample, REFERENCE: torch.from_numpy(reference)}
            return with_sequences(sample)
        if self.documents is not None:
            assert self.eod_id is not None
            return annotate(row, self.eod_id, self.documents)
        return {"input_ids": row[:-1], "labels": row[1:]}  # [s], [s]
