"""Text data for GPT training: load documents with ``datasets``, tokenize, pack into samples.

Each document is tokenized, followed by one end-of-document (EOS) token, all documents are
concatenated and the token stream is cut into samples of ``seq_length + 1`` tokens (the
remainder is dropped). A sample's inputs are its first ``seq_length`` tokens, its labels the
last ``seq_length`` (the inputs shifted by one). Loading and tokenization are cached by
``datasets`` (keyed on the files' paths, sizes and modification times and on the tokenizer), so
a second run on the same corpus only re-reads Arrow files.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import random
import sysconfig
from collections.abc import Iterator
from typing import Any

import datasets
import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_sp.errors import ConfigError

BYTE_VOCAB_SIZE = 257
"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, 256 is the end-of-document token."""
BYTE_EOS_ID = 256

EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "[SEP]")
"""End-of-document tokens looked up, in this order, in a ``tokenizer.json`` vocabulary."""

_CACHE_VERSION = 1
"""Bump to invalidate every cached load/tokenization when their output format changes."""

_TOKEN_IDS = datasets.Features(
    {"input_ids": (getattr(datasets, "List", None) or datasets.Sequence)(datasets.Value("int32"))}
)
"""Schema of the tokenized documents (``List`` is ``Sequence`` before datasets 4)."""

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


def _files_under(directory: str) -> list[str]:
    """Every regular file under ``directory``, recursively, skipping hidden names and caches."""
    files: list[str] = []
    for root, subdirs, names in os.walk(directory, followlinks=True):
        subdirs[:] = [d for d in subdirs if not d.startswith(".") and d != "__pycache__"]
        files.extend(os.path.join(root, n) for n in names if not n.startswith("."))
    return [f for f in files if os.path.isfile(f)]


def resolve_paths(paths: str | list[str]) -> list[str]:
    """Expand files, directories (recursively) and glob patterns into a sorted list of files.

    Raises:
        ConfigError: an entry matches no file.
    """
    entries = [paths] if isinstance(paths, str) else list(paths)
    if not entries:
        raise ConfigError(
            "paths=[] names no file; give text files, directories or glob patterns, "
            "or leave paths unset for the standard-library corpus"
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
            found = [f for f in found if os.path.isfile(f)]
        if not found:
            raise ConfigError(
                f"{field}={entry!r} matches no file; give existing text files, directories "
                "or glob patterns"
            )
        files.update(os.path.abspath(f) for f in found)
    return sorted(files)


def _read_documents(files: list[tuple[str, int, int]], version: int) -> Iterator[dict[str, str]]:
    """``Dataset.from_generator`` source: one row per file. ``files`` holds (path, size,
    mtime_ns) so the cache fingerprint changes when a file changes; ``version`` likewise."""
    del version
    for path, _size, _mtime in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield {"text": f.read()}


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, digest: str) -> Any:
    """Load (once per process) the ``tokenizers.Tokenizer`` at ``path`` with content ``digest``."""
    del digest  # part of the cache key only
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


class _Tokenize:
    """The batched ``Dataset.map`` function: text column -> ``input_ids`` (int32) + EOS.

    Holds only plain values (no tokenizer object) so ``datasets`` hashes it stably and reuses
    the cached result. Empty documents produce no tokens (not even an EOS).
    """

    def __init__(self, text_column: str, eos_id: int, path: str | None, digest: str | None):
        self.text_column = text_column
        self.eos_id = eos_id
        self.path = path
        self.digest = digest
        self.version = _CACHE_VERSION

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[np.ndarray]]:
        texts = [t if isinstance(t, str) else "" for t in batch[self.text_column]]
        out: list[np.ndarray] = []
        if self.path is None:
            for text in texts:
                ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
                out.append(np.append(ids, np.int32(self.eos_id)) if ids.size else ids)
        else:
            tokenizer = _load_tokenizer(self.path, self.digest)
            encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
            for text, encoding in zip(texts, encode(texts, add_special_tokens=False), strict=True):
                ids = np.asarray(encoding.ids, dtype=np.int32)
                out.append(np.append(ids, np.int32(self.eos_id)) if text else ids)
        return {"input_ids": out}


class PackedDataset(Dataset):
    """Packed samples selected by ``indices``; item ``i`` is ``{"input_ids", "labels"}``.

    Args:
        samples: int array ``[n, seq_length + 1]`` of packed token ids (shared between splits).
        indices: which rows of ``samples`` belong to this split, in order.
    """

    def __init__(self, samples: np.ndarray, indices: np.ndarray) -> None:
        self.samples = samples  # [n, s + 1]
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = torch.from_numpy(self.samples[self.indices[i]].astype(np.int64))  # [s + 1]
        return {"input_ids": row[:-1], "labels": row[1:]}  # [s], [s]


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose first epoch after a resume starts ``skip_samples`` in.

    Its length stays the full epoch's, as Lightning counts a resumed epoch's batches from the
    restored position; later epochs (``set_epoch``) are whole.
    """

    def __init__(self, *args: Any, skip_samples: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip_samples = skip_samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.skip_samples = self.skip_samples, 0
        return iter(indices[skip:])


class TextDataModule(pl.LightningDataModule):
    """Packed next-token-prediction samples from local text files or a Hub dataset.

    Every document is tokenized and followed by an end-of-document token; all documents are
    concatenated and cut into samples of ``seq_length + 1`` tokens (the remainder is dropped).
    Batches are ``{"input_ids": [b, s], "labels": [b, s]}`` (int64), labels being the inputs
    shifted by one. A seeded shuffle of the samples holds out ``val_fraction`` for validation.
    Under a distributed strategy Lightning shards the training samples over data-parallel ranks.

    Args:
        paths: Local text files, directories (every file under them, recursively, except
            hidden ones) or glob patterns (``**`` recurses). Unset (with no ``dataset_name``):
            the ``.py`` files of this Python's standard library, which every machine has.
        dataset_name: A Hugging Face Hub dataset (its ``train`` split, column
            ``text_column``); needs network access. Mutually exclusive with ``paths``.
        text_column: The text column of ``dataset_name`` (local files always use ``text``).
        tokenizer: Path of a Hugging Face ``tokenizers`` ``tokenizer.json``; its vocabulary must
            hold an end-of-document token (one of <|endoftext|>, <|end_of_text|>, </s>, <eos>,
            <|eos|>, [EOS], [SEP]). Unset: byte-level tokenizer (ids 0-255 are UTF-8 bytes,
            256 is end-of-document; vocabulary 257).
        seq_length: Tokens per sample (s); each sample consumes seq_length + 1 tokens.
        batch_size: Samples per data-parallel rank per optimizer step (b).
        val_fraction: Fraction of the packed samples held out for validation, in [0, 1); at
            least one sample is always held out.
        max_documents: Read at most this many files/documents, a seeded sample of them (keeps
            the standard-library corpus small for quick runs). Unset: all.
        seed: Seed of the document sample, the train/validation split and the shuffling.
        num_workers: DataLoader worker processes (0 loads in the main process).
        cache_dir: Where ``datasets`` caches loaded and tokenized data. Unset: its default
            (``HF_DATASETS_CACHE``, usually ``~/.cache/huggingface/datasets``).
    """

    def __init__(
        self,
        paths: str | list[str] | None = None,
        dataset_name: str | None = None,
        text_column: str = "text",
        tokenizer: str | None = None,
        seq_length: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.02,
        max_documents: int | None = None,
        seed: int = 1234,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if paths is not None and dataset_name is not None:
            raise ConfigError(
                f"paths={paths!r} and dataset_name={dataset_name!r} are both set; give one of "
                "them, or neither for the standard-library corpus"
            )
        for name, value in (("seq_length", seq_length), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} is invalid; it must be an integer >= 1")
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"val_fraction={val_fraction!r} is invalid; it must be in [0, 1)")
        if max_documents is not None and max_documents < 1:
            raise ConfigError(
                f"max_documents={max_documents!r} is invalid; it must be an integer >= 1, "
                "or unset for all documents"
            )
        if num_workers < 0:
            raise ConfigError(f"num_workers={num_workers!r} is invalid; it must be >= 0")
        if dataset_name is not None and not dataset_name.strip():
            raise ConfigError(
                f"dataset_name={dataset_name!r} is empty; give a Hub dataset name or unset it"
            )

        self.paths = paths
        self.dataset_name = dataset_name
        self.text_column = text_column
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_documents = max_documents
        self.seed = seed
        self.num_workers = num_workers
        self.cache_dir = cache_dir

        # Fail fast: resolve the files and load the tokenizer now.
        self.files: list[str] = []
        if dataset_name is None:
            self.files = stdlib_python_files() if paths is None else resolve_paths(paths)
            if not self.files:
                raise ConfigError(
                    "paths=None found no standard-library .py files under "
                    f"{sysconfig.get_paths()['stdlib']!r}; give text files with paths"
                )
            if max_documents is not None and max_documents < len(self.files):
                chosen = random.Random(seed).sample(self.files, max_documents)
                self.files = sorted(chosen)
        self._tokenizer_path: str | None = None
        self._tokenizer_digest: str | None = None
        self._eos_id = BYTE_EOS_ID
        self._vocab_size = BYTE_VOCAB_SIZE
        if tokenizer is not None:
            self._init_tokenizer(tokenizer)

        self.num_tokens: int | None = None
        self.train_dataset: PackedDataset | None = None
        self.val_dataset: PackedDataset | None = None

    def _init_tokenizer(self, path: str) -> None:
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(path):
            raise ConfigError(
                f"tokenizer={self.tokenizer!r} is not a file; give the path of a Hugging Face "
                "tokenizers tokenizer.json, or leave it unset for the byte-level tokenizer"
            )
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        try:
            tok = _load_tokenizer(path, digest)
        except Exception as e:
            reason = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"tokenizer={self.tokenizer!r} is not a valid tokenizers tokenizer.json "
                f"({reason}); save one with tokenizers.Tokenizer.save"
            ) from e
        eos = next((t for t in EOS_TOKENS if tok.token_to_id(t) is not None), None)
        if eos is None:
            raise ConfigError(
                f"tokenizer={self.tokenizer!r} has no end-of-document token; add one of "
                f"{list(EOS_TOKENS)} to its vocabulary (e.g. as a special token)"
            )
        self._tokenizer_path = path
        self._tokenizer_digest = digest
        self._eos_id = tok.token_to_id(eos)
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer: 257 for bytes, else the tokenizer's (with added
        tokens)."""
        return self._vocab_size

    @property
    def eos_token_id(self) -> int:
        """Id of the end-of-document token appended after every document."""
        return self._eos_id

    @property
    def tokenizer_id(self) -> str:
        """Identifies the tokenizer for checkpoint compatibility: ``bytes`` or
        ``tokenizers:<first 16 hex digits of the tokenizer.json's sha256>``."""
        if self._tokenizer_digest is None:
            return "bytes"
        return f"tokenizers:{self._tokenizer_digest[:16]}"

    def _documents(self) -> datasets.Dataset:
        """The corpus as a ``datasets.Dataset`` (cached on disk by ``datasets``)."""
        if self.dataset_name is None:
            stats = [(p, os.stat(p)) for p in self.files]
            keyed = [(p, s.st_size, s.st_mtime_ns) for p, s in stats]
            return datasets.Dataset.from_generator(
                _read_documents,
                features=datasets.Features({"text": datasets.Value("string")}),
                gen_kwargs={"files": keyed, "version": _CACHE_VERSION},
                cache_dir=self.cache_dir,
            )
        try:
            ds = datasets.load_dataset(self.dataset_name, split="train", cache_dir=self.cache_dir)
        except Exception as e:
            reason = (str(e).splitlines() or [""])[0]
            raise ConfigError(
                f"dataset_name={self.dataset_name!r} could not be loaded "
                f"({type(e).__name__}: {reason}); check the name and network access, or give "
                "local files with paths"
            ) from e
        if self.text_column not in ds.column_names:
            raise ConfigError(
                f"text_column={self.text_column!r} is not a column of dataset_name="
                f"{self.dataset_name!r}; its columns are {ds.column_names}"
            )
        if self.max_documents is not None and self.max_documents < len(ds):
            rows = random.Random(self.seed).sample(range(len(ds)), self.max_documents)
            ds = ds.select(sorted(rows))
        return ds

    def _tokenized(self) -> datasets.Dataset:
        """Documents -> one ``input_ids`` row per document (EOS appended), cached by ``map``."""
        docs = self._documents()
        column = "text" if self.dataset_name is None else self.text_column
        fn = _Tokenize(column, self._eos_id, self._tokenizer_path, self._tokenizer_digest)
        return docs.map(
            fn,
            batched=True,
            batch_size=64,
            remove_columns=docs.column_names,
            features=_TOKEN_IDS,
            desc="Tokenizing",
        )

    def prepare_data(self) -> None:
        """Load and tokenize once (on one process per node), filling the ``datasets`` cache."""
        self._tokenized()

    def setup(self, stage: str | None = None) -> None:
        """Pack the tokens and split train/validation; runs once, later calls are no-ops."""
        if self.train_dataset is not None:
            return
        column = self._tokenized().data.column("input_ids")
        parts = [chunk.flatten().to_numpy() for chunk in column.chunks]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)  # [T]
        self.num_tokens = int(tokens.size)
        width = self.seq_length + 1
        n = tokens.size // width
        if n < 2:
            raise ConfigError(
                f"seq_length={self.seq_length} needs at least {2 * width} tokens for 2 packed "
                f"samples of seq_length + 1 = {width} tokens, but the corpus has {tokens.size} "
                "tokens; add text, raise max_documents or lower seq_length"
            )
        samples = tokens[: n * width].reshape(n, width)  # [n, s + 1]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).numpy()
        n_val = min(n - 1, max(1, round(self.val_fraction * n)))
        train_idx, val_idx = order[n_val:], order[:n_val]
        replicas = self._num_replicas()
        if len(train_idx) // replicas < self.batch_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is larger than the {len(train_idx)} training "
                f"samples (over {replicas} data-parallel replica(s)) of the corpus "
                f"({tokens.size} tokens at seq_length={self.seq_length}); lower batch_size or "
                "seq_length, or add text"
            )
        self.train_dataset = PackedDataset(samples, train_idx)
        self.val_dataset = PackedDataset(samples, val_idx)

    def _replicas(self) -> tuple[int, int]:
        """``(data-parallel replicas, this replica's index)``; ``(1, 0)`` without a trainer.

        Under ``megatron_sp`` these are the data-parallel size and rank: tensor- and
        pipeline-parallel ranks of one replica read the same samples.
        """
        strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
        try:
            kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        except Exception:  # strategy not fully set up yet
            kwargs = {}
        return max(1, int(kwargs.get("num_replicas", 1))), int(kwargs.get("rank", 0))

    def _num_replicas(self) -> int:
        return self._replicas()[0]

    def _batches_done_this_epoch(self) -> int:
        """Training batches the (restored) fit loop has already consumed in this epoch."""
        loop = getattr(self.trainer, "fit_loop", None) if self.trainer is not None else None
        if loop is None or not loop.restarting:
            return 0
        # a checkpoint written in on_train_batch_end holds the step of a batch that counts as
        # processed but not yet completed
        return loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded) training batches ``{"input_ids": [b, s], "labels": [b, s]}``;
        incomplete last batch dropped.

        The sampler shards over data-parallel replicas itself (so Lightning keeps it), and a
        run resumed mid-epoch continues with the batch after the last one it trained on.
        """
        if self.train_dataset is None:
            self.setup()
        replicas, rank = self._replicas()
        sampler = ResumableDistributedSampler(
            self.train_dataset,
            num_replicas=replicas,
            rank=rank,
            shuffle=True,
            seed=self.seed,
            drop_last=True,
        )
        done = self._batches_done_this_epoch() * self.batch_size
        # a run saved at the end of an epoch starts the next one whole
        sampler.skip_samples = done if done < len(sampler) else 0
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order, last batch kept even if incomplete."""
        if self.val_dataset is None:
            self.setup()
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
