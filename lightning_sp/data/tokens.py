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


class TokenSplit:
    """One split (``train`` / ``val``) of a prepared directory as a token stream.

    Args:
        directory: The prepared directory.
        split: ``train`` or ``val``.
    """

    def __init__(self, directory: str, split: str) -> None:
        self.directory = os.path.join(directory, split)
        with open(os.path.join(self.directory, "index.json"), encoding="utf-8") as f:
            index = json.load(f)
        self.dtype = np.dtype(index["dtype"])
        self.files = [os.path.join(self.directory, s["file"]) for s in index["shards"]]
        self.ends = np.cumsum([s["tokens"] for s in index["shards"]], dtype=np.int64)
        self.num_tokens = int(self.ends[-1]) if len(self.ends) else 0
        self.num_documents = int(index["documents"])
        flags = index.get("flags")  # chat SFT: one uint8 per token (lightning_sp.data.chat)
        self.flags_file = os.path.join(self.directory, flags) if flags else None
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
            out[done : done + piece.size] = piece
            done += piece.size
            shard += 1
        return out

    def read_flags(self, start: int, count: int) -> np.ndarray:
        """Flags ``[start, start + count)`` (uint8, a copy) of a chat split."""
        if self.flags_file is None:
            raise ValueError(f"{self.directory} has no flags (not a chat SFT split)")
        if self._flags is None:
            self._flags = np.memmap(self.flags_file, dtype=np.uint8, mode="r")
        return np.array(self._flags[start : start + count])


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
