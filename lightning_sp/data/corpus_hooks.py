"""The prepared corpus of :class:`~lightning_sp.data.datamodule.TextDataModule`, its base: the
tokenizer it is read with (vocabulary size, end-of-document id, identity), the configured
source tokenized once into its prepared directory (``prepare_data``, one process per node),
and the prepared splits mapped and checked (``setup``: the model's vocabulary, a chat
corpus's packing length, the tokens of every corpus, the batch against the samples), a bad
input found on any rank raised by every rank.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_sp.data.chat import prepare_chat
from lightning_sp.data.documents import DocumentOptions
from lightning_sp.data.order import SampleOrder
from lightning_sp.data.preference import prepare_preference
from lightning_sp.data.prepare import (
    PrepareSettings,
    check_prepared,
    prepare,
    read_metadata,
)
from lightning_sp.data.sources import Source
from lightning_sp.data.tokenizer import TokenizerInfo
from lightning_sp.data.tokens import PackedSamples, TokenSplit
from lightning_sp.errors import ConfigError
from lightning_sp.runtime.agree import ranks_agree


class CorpusHooks(pl.LightningDataModule):
    """The corpus hooks of a data module of packed samples (``TextDataModule``, which sets
    the attributes below from its arguments)."""

    source: Source | None
    directories: list[str]
    weights: list[float] | None
    info: TokenizerInfo
    chat_template_dir: str | None
    assistant_only_loss: bool
    overflow: str
    preference: bool
    documents: DocumentOptions
    seq_length: int
    batch_size: int
    val_fraction: float
    seed: int
    num_proc: int
    cache_dir: str | None
    num_tokens: int | None
    train_dataset: PackedSamples | None
    val_dataset: PackedSamples | None
    _prepare_error: ConfigError | None

    @property
    def files(self) -> list[str]:
        """The local entries of the configured source (empty for prepared data)."""
        return list(self.source.entries) if self.source is not None else []

    def _settings(self) -> PrepareSettings:
        return PrepareSettings(self.val_fraction, self.seed, num_proc=self.num_proc)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer: 257 for bytes, else the tokenizer's (with added
        tokens)."""
        return self.info.vocab_size

    @property
    def eos_token_id(self) -> int:
        """Id of the end-of-document token appended after every document."""
        return self.info.eos_id

    @property
    def tokenizer_id(self) -> str:
        """Identifies the tokenizer for checkpoint compatibility: ``bytes`` or
        ``tokenizers:<first 16 hex digits of the tokenizer.json's sha256>``."""
        return self.info.id

    def check_model_vocab(self, model_vocab_size: int | None) -> None:
        """Fail when the tokenizer has more ids than the model's vocabulary."""
        if model_vocab_size is not None and self.vocab_size > model_vocab_size:
            raise ConfigError(
                f"model.config.vocab_size={model_vocab_size} is smaller than the tokenizer's "
                f"vocabulary of {self.vocab_size} tokens; set model.config.vocab_size >= "
                f"{self.vocab_size} or use a smaller tokenizer"
            )

    def _model_vocab(self) -> int | None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        return getattr(getattr(module, "config", None), "vocab_size", None)

    def prepare_corpus(self, log: Any = print) -> str:
        """Tokenize the configured source into its prepared directory (reused when up to
        date); returns the directory. Nothing to do for already-prepared data."""
        if self.source is not None and self.chat_template_dir is not None:
            self._prepare_chat(self.source, log)
        elif self.source is not None:
            prepare(self.source, self.info, self.directories[0], self._settings(),
                    cache_dir=self.cache_dir, log=log)  # fmt: skip
        else:
            log(f"already prepared, nothing to do: {', '.join(self.directories)}")
        return self.directories[0]

    def _prepare_chat(self, source: Source, log: Any) -> None:
        """Chat SFT: render and pack the rows (again only when the source or a setting
        changed since the directory was prepared)."""
        assert self.chat_template_dir is not None
        settings = (self.assistant_only_loss, self.overflow, self.val_fraction, self.seed)
        identity = [source.fingerprint(), self.info.digest, self.seq_length, *settings]
        identity += ["preference"] if self.preference else []
        existing = read_metadata(self.directories[0]) or {}
        if existing.get("chat", {}).get("identity") == identity:
            log(f"already prepared, nothing to do: {self.directories[0]}")
            return
        if self.preference:
            prepare_preference(
                list(source.entries), self.chat_template_dir, self.directories[0],
                self.seq_length, self.overflow,  # type: ignore[arg-type]
                self.val_fraction, self.seed, log=log, identity=identity,
            )  # fmt: skip
            return
        prepare_chat(
            list(source.entries), self.chat_template_dir, self.directories[0], self.seq_length,
            self.assistant_only_loss, self.overflow,  # type: ignore[arg-type]
            self.val_fraction, self.seed, log=log, identity=identity,
        )  # fmt: skip

    @override
    def prepare_data(self) -> None:
        """Prepare the source on first use (one process per node; the others wait). Under a
        Trainer of several processes a bad input found here is raised by every rank in
        :meth:`setup` (:mod:`lightning_sp.runtime.agree`), not by this rank alone."""
        try:
            self.check_model_vocab(self._model_vocab())
            if self.source is not None and not self._predicting:
                self.prepare_corpus()
        except ConfigError as error:
            if self.trainer is None or self.trainer.world_size == 1:
                raise
            self._prepare_error = error

    @override
    def setup(self, stage: str) -> None:
        """Map the prepared splits (nothing is read whole); later calls are no-ops. Nothing
        to map for ``predict`` (it reads ``prompts``). A bad input found here or by
        :meth:`prepare_data` on any rank is raised by every rank (one ``ConfigError``)."""
        with ranks_agree():
            if self._prepare_error is not None:
                raise self._prepare_error
            self._setup(stage)

    def _setup(self, stage: str) -> None:
        if self.train_dataset is not None or stage == "predict":
            return
        self.check_model_vocab(self._model_vocab())
        metas = [check_prepared(d, self.info) for d in self.directories]
        for directory, meta in zip(self.directories, metas, strict=True):
            chat = meta.get("chat")
            if chat is not None and chat["seq_length"] != self.seq_length:
                raise ConfigError(
                    f"seq_length={self.seq_length} differs from the seq_length="
                    f"{chat['seq_length']} the chat corpus {directory!r} was packed for; use "
                    "that seq_length or prepare again"
                )
        self.num_tokens = sum(int(m["tokens"]) for m in metas)
        vocab = self.info.vocab_size  # every read checks its ids against it
        train = [TokenSplit(d, "train", vocab) for d in self.directories]
        width = self.seq_length + 1
        for directory, split in zip(self.directories, train, strict=True):
            if split.num_tokens < width:
                raise ConfigError(
                    f"seq_length={self.seq_length} needs at least {width} training tokens per "
                    f"corpus, but {directory!r} has {split.num_tokens}; add text or lower "
                    "seq_length"
                )
        eod = self.info.eos_id
        self.train_dataset = PackedSamples(train, self.seq_length, self.documents, eod)
        self.val_dataset = PackedSamples([TokenSplit(d, "val", vocab) for d in self.directories],
                                         self.seq_length, self.documents, eod)  # fmt: skip
        replicas = self._replicas()[0]
        epoch = len(SampleOrder(self.train_dataset.counts, self.weights, self.seed))
        if epoch // replicas < self.batch_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is larger than the {epoch} training samples "
                f"(over {replicas} data-parallel replica(s)) at seq_length={self.seq_length}; "
                "lower batch_size or seq_length, or add text"
            )

    def _replicas(self) -> tuple[int, int]:
        """``(data-parallel replicas, this replica's index)``; ``(1, 0)`` without a trainer.

        Under ``megatron_sp`` these are the data-parallel size and rank of the strategy's
        ``ParallelState``: tensor- and pipeline-parallel ranks of one replica read the same
        samples.
        """
        strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
        try:
            kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        except Exception:  # strategy not fully set up yet
            kwargs = {}
        return max(1, int(kwargs.get("num_replicas", 1))), int(kwargs.get("rank", 0))

    @property
    def _predicting(self) -> bool:
        return self.trainer is not None and self.trainer.predicting
