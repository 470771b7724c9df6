"""``TextDataModule``: packed next-token samples read from prepared (memory-mapped) corpora.

Here its settings (checked before any work), the loaders and the resumable training order;
its base :class:`~lightning_sp.data.corpus_hooks.CorpusHooks` prepares the corpus and maps its
splits.
"""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_sp.data.chat import load_chat_tokenizer
from lightning_sp.data.corpus import resolve_corpus
from lightning_sp.data.corpus_hooks import CorpusHooks
from lightning_sp.data.documents import DocumentOptions
from lightning_sp.data.order import SampleOrder
from lightning_sp.data.prompts import Codec, prompt_dataloader
from lightning_sp.data.sampler import ResumableLoader, ResumableSampler
from lightning_sp.data.sources import Source
from lightning_sp.data.tokenizer import tokenizer_info
from lightning_sp.data.tokens import PackedSamples
from lightning_sp.errors import ConfigError, positive_int


class TextDataModule(CorpusHooks):
    """Packed next-token-prediction samples from corpora tokenized once into memory-mapped
    shards (``python cli.py prepare``), or prepared on first use into a cache.

    Batches are ``{"input_ids": [b, s], "labels": [b, s]}`` (int64), labels being the inputs
    shifted by one; a sample is ``s + 1`` consecutive tokens of the documents (each followed
    by an end-of-document token) concatenated. The training order is a seeded shuffle per
    epoch, sharded over data-parallel replicas only, and resumes exactly mid-epoch through
    :meth:`state_dict`. Where the data comes from, first match wins: ``blend`` (prepared
    directories); a complete ``prepared_dir`` with ``paths`` and ``dataset_name`` unset; else
    the source (``paths`` / ``dataset_name`` / the standard library) prepared into
    ``prepared_dir`` or, unset, a cache directory under ``cache_dir`` keyed by source,
    tokenizer and split (and reused while they are unchanged).

    Args:
        paths: Local files, directories (every file under them, recursively, except hidden
            ones) or glob patterns (``**`` recurses). ``.jsonl``/``.json``/``.parquet``/``.csv``
            files give one document per row (field ``text_field``); a directory written by
            ``Dataset.save_to_disk`` gives its rows; any other file is one plain-text document.
            Unset (with no ``dataset_name``/``prepared_dir``/``blend``): the ``.py`` files of
            this Python's standard library, which every machine has.
        dataset_name: A Hugging Face Hub dataset (its ``train`` split, field ``text_field``);
            needs network access. Mutually exclusive with ``paths``.
        text_field: The field (JSON) or column (Parquet, CSV, saved and Hub datasets) that
            holds each document's text.
        tokenizer: Path of a Hugging Face ``tokenizers`` ``tokenizer.json``; its vocabulary must
            hold an end-of-document token (one of <|endoftext|>, <|end_of_text|>, </s>, <eos>,
            <|eos|>, [EOS], [SEP]). Unset: byte-level tokenizer (ids 0-255 are UTF-8 bytes,
            256 is end-of-document; vocabulary 257). Must be the one the data was prepared with.
        prepared_dir: Directory of the prepared corpus: ``cli.py prepare`` writes it, ``fit``
            reads it (and prepares it first from ``paths``/``dataset_name`` when it is missing).
        blend: Several prepared directories mixed by weight, Megatron-LM style:
            ``[0.3, /data/a, 0.7, /data/b]`` (weights > 0, normalized). Excludes the other
            sources.
        seq_length: Tokens per sample (s); each sample consumes seq_length + 1 tokens.
        batch_size: Samples per data-parallel rank per optimizer step (b).
        val_fraction: Fraction of the documents held out for validation when preparing, in
            [0, 1) (at least one document when > 0).
        max_documents: Prepare from at most this many documents, a seeded sample of them (keeps
            the standard-library corpus small for quick runs). Unset: all.
        seed: Seed of the document sample, the train/validation split and the shuffling.
        num_workers: DataLoader worker processes (0 loads in the main process).
        num_proc: Tokenizing processes when preparing (``datasets``' ``map(num_proc=...)``).
        cache_dir: Root of the prepared-corpus cache (``prepared/<key>`` under it) and of the
            ``datasets`` cache. Unset: ``~/.cache/lightning_sp`` and ``datasets``' default.
        prompts: Prompts for ``predict`` (each continued by ``GPTModule.predict_step``); while
            predicting no corpus is prepared or read.
        document_mask: Attention stays within each document of a sample (block-causal, as
            Llama 3 trained; Megatron's ``--reset-attention-mask``).
        reset_position_ids: Positions restart at 0 at each document of a sample.
        eod_mask_loss: No loss where the input token is the end-of-document token; the step's
            loss is then the global token mean (:mod:`lightning_sp.data.documents`).
        chat_template_dir: A local Hugging Face tokenizer directory: ``paths`` are then chat
            rows (``messages`` or ``prompt``/``completion``, JSONL/JSON/Parquet) rendered with
            its chat template, packed first-fit into ``seq_length + 1`` tokens with document
            masks between conversations, prepared once into ``prepared_dir`` with a mask shard
            (:mod:`lightning_sp.data.chat`); ``tokenizer`` defaults to its tokenizer.json.
        assistant_only_loss: Chat SFT: loss on the assistant tokens only (the template's
            generation markers); false trains on every token.
        overflow: Chat SFT: a conversation longer than ``seq_length + 1`` tokens is
            ``truncate``-d (counted in one notice) or ``refuse``-d; preference data: a pair.
        preference: ``paths`` are preference rows (``prompt``/``chosen``/``rejected``, text or
            messages, TRL's formats) for DPO (``model.dpo``), tokenized with
            ``chat_template_dir``'s tokenizer, each pair two documents of one sample, loss on
            the answers (:mod:`lightning_sp.data.preference`).
    """

    def __init__(
        self,
        paths: str | list[str] | None = None,
        dataset_name: str | None = None,
        text_field: str = "text",
        tokenizer: str | None = None,
        prepared_dir: str | None = None,
        blend: list[float | str] | None = None,
        seq_length: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.02,
        max_documents: int | None = None,
        seed: int = 1234,
        num_workers: int = 0,
        num_proc: int = 1,
        cache_dir: str | None = None,
        prompts: list[str] | None = None,
        document_mask: bool = False,
        reset_position_ids: bool = False,
        eod_mask_loss: bool = False,
        chat_template_dir: str | None = None,
        assistant_only_loss: bool = True,
        overflow: str = "truncate",
        preference: bool = False,
    ) -> None:
        super().__init__()
        self.preference = preference
        if preference and chat_template_dir is None:
            raise ConfigError(
                "preference=true needs chat_template_dir: the local Hugging Face tokenizer "
                "directory the pairs are tokenized (and chat rows rendered) with"
            )
        self.chat_template_dir = chat_template_dir
        self.assistant_only_loss, self.overflow = assistant_only_loss, overflow
        if chat_template_dir is not None:
            if dataset_name is not None or blend is not None:
                raise ConfigError(
                    f"chat_template_dir={chat_template_dir!r} reads chat rows from local paths; "
                    "unset dataset_name and blend"
                )
            if overflow not in ("truncate", "refuse"):
                raise ConfigError(f"overflow={overflow!r} is invalid; valid: 'truncate', 'refuse'")
            if not preference:
                load_chat_tokenizer(chat_template_dir, assistant_only_loss)  # one line, now
            tokenizer = tokenizer or os.path.join(chat_template_dir, "tokenizer.json")
        self.documents = DocumentOptions(document_mask, reset_position_ids, eod_mask_loss)
        if paths is not None and dataset_name is not None:
            raise ConfigError(
                f"paths={paths!r} and dataset_name={dataset_name!r} are both set; give one of "
                "them, or neither for the standard-library corpus"
            )
        if blend is not None and (paths, dataset_name, prepared_dir) != (None, None, None):
            raise ConfigError(
                f"blend={blend!r} is set with paths, dataset_name or prepared_dir; a blend "
                "reads prepared directories only, unset the others"
            )
        for name, value in (("seq_length", seq_length), ("batch_size", batch_size),
                            ("num_proc", num_proc)):  # fmt: skip
            positive_int(name, value)
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
        self.paths, self.dataset_name, self.text_field = paths, dataset_name, text_field
        self.tokenizer, self.seq_length, self.batch_size = tokenizer, seq_length, batch_size
        self.val_fraction, self.max_documents, self.seed = val_fraction, max_documents, seed
        self.num_workers, self.num_proc, self.cache_dir = num_workers, num_proc, cache_dir
        self.info = tokenizer_info(tokenizer)
        self.prompts = prompts

        # Where the samples come from, checked now (before any work).
        corpus = resolve_corpus(
            paths=paths, dataset_name=dataset_name, text_field=text_field,
            prepared_dir=prepared_dir, blend=blend, max_documents=max_documents, seed=seed,
            val_fraction=val_fraction, cache_dir=cache_dir, info=self.info,
        )  # fmt: skip
        self.source: Source | None = corpus.source
        self.directories, self.weights = corpus.directories, corpus.weights
        if chat_template_dir is not None and self.source is not None and paths is None:
            raise ConfigError(
                f"chat_template_dir={chat_template_dir!r} needs paths: the chat rows (JSONL, "
                "JSON or Parquet with 'messages' or 'prompt'/'completion'), or a prepared_dir "
                "already prepared from them"
            )

        self.num_tokens: int | None = None
        self.train_dataset: PackedSamples | None = None
        self.val_dataset: PackedSamples | None = None
        self._sampler: ResumableSampler | None = None
        self._resume: dict[str, Any] | None = None
        self._prepare_error: ConfigError | None = None  # raised by every rank in setup

    @override
    def train_dataloader(self) -> ResumableLoader:
        """Training batches ``{"input_ids": [b, s], "labels": [b, s]}`` in the seeded order
        of :class:`ResumableSampler`; incomplete last batch dropped."""
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        replicas, rank = self._replicas()
        order = SampleOrder(self.train_dataset.counts, self.weights, self.seed)
        self._sampler = ResumableSampler(self.train_dataset, order, replicas, rank)
        if self._resume is not None:
            self._sampler.load_state_dict(self._resume)
            self._resume = None
        return ResumableLoader(
            self.train_dataset, sampler=self._sampler, drop_last=True, **self._loading()
        )

    @override
    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order, last batch kept even if incomplete (Lightning
        shards them over data-parallel replicas)."""
        if self.val_dataset is None:
            self.setup("fit")
        assert self.val_dataset is not None
        return DataLoader(self.val_dataset, shuffle=False, **self._loading())

    def _loading(self) -> dict[str, Any]:
        """What the train and validation loaders share: the batch size and the workers."""
        return {"batch_size": self.batch_size, "num_workers": self.num_workers,
                "persistent_workers": self.num_workers > 0}  # fmt: skip

    @property
    def codec(self) -> Codec:
        """This run's tokenizer, text to ids and back (bytes or ``tokenizer.json``)."""
        return Codec.from_info(self.info)

    @override
    def predict_dataloader(self) -> DataLoader:
        """The ``prompts``, one per batch ``{"input_ids": [1, n], "prompt": [str]}``."""
        if not self.prompts:
            raise ConfigError(
                f"data.prompts={self.prompts!r} is empty; give the prompts to continue, e.g. "
                """--data.prompts '["def "]'"""
            )
        return prompt_dataloader(self.prompts, self.codec)

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count the training samples handed to the model (what a checkpoint has trained on;
        batches a DataLoader prefetched are not counted)."""
        if self.trainer is not None and self.trainer.training and self._sampler is not None:
            self._sampler.advance(int(batch["input_ids"].shape[0]))
        return batch

    @override
    def state_dict(self) -> dict[str, Any]:
        """``{"sampler": {epoch, consumed_samples, epoch_samples, seed}}`` (plain ints), or
        ``{}`` before training."""
        if self._sampler is not None:
            return {"sampler": self._sampler.state_dict()}
        return {"sampler": dict(self._resume)} if self._resume is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training order where :meth:`state_dict` left it."""
        if "sampler" in state_dict:
            self._resume = dict(state_dict["sampler"])
            if self._sampler is not None:
                self._sampler.load_state_dict(self._resume)
                self._resume = None
