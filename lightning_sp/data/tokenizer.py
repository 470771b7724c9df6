"""Tokenizers: byte-level (default) or a Hugging Face ``tokenizers`` ``tokenizer.json``.

A :class:`TokenizerInfo` record identifies a tokenizer by the sha256 of its file (``bytes`` for
the byte-level one); prepared corpora and checkpoints store that identity, and reading data
prepared with another tokenizer fails before any work.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Any

import numpy as np

from lightning_sp.errors import ConfigError

BYTE_VOCAB_SIZE = 257
"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, 256 is the end-of-document token."""
BYTE_EOS_ID = 256

EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "[SEP]")
"""End-of-document tokens looked up, in this order, in a ``tokenizer.json`` vocabulary."""


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """What a prepared corpus and a checkpoint need to know about the tokenizer.

    Attributes:
        path: Absolute path of the ``tokenizer.json``; ``None`` for the byte-level tokenizer.
        digest: sha256 of that file; ``"bytes"`` for the byte-level tokenizer.
        eos_id: Id of the end-of-document token appended after every document.
        vocab_size: Vocabulary size, added tokens included.
    """

    path: str | None
    digest: str
    eos_id: int
    vocab_size: int

    @property
    def id(self) -> str:
        """Short identity: ``bytes`` or ``tokenizers:<first 16 hex digits of the sha256>``."""
        return "bytes" if self.path is None else f"tokenizers:{self.digest[:16]}"

    def dtype(self) -> np.dtype:
        """Smallest unsigned dtype holding every id: uint16 when the vocabulary fits, else
        uint32."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)


BYTES = TokenizerInfo(path=None, digest="bytes", eos_id=BYTE_EOS_ID, vocab_size=BYTE_VOCAB_SIZE)


@functools.lru_cache(maxsize=8)
def _load(path: str, digest: str) -> Any:
    """The ``tokenizers.Tokenizer`` at ``path`` with content ``digest``, once per process."""
    del digest  # part of the cache key only
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def tokenizer_info(tokenizer: str | None, field: str = "tokenizer") -> TokenizerInfo:
    """Check and describe the tokenizer at ``tokenizer`` (``None``: bytes).

    Raises:
        ConfigError: not a file, not a ``tokenizer.json``, or no end-of-document token.
    """
    if tokenizer is None:
        return BYTES
    path = os.path.abspath(os.path.expanduser(tokenizer))
    if not os.path.isfile(path):
        raise ConfigError(
            f"{field}={tokenizer!r} is not a file; give the path of a Hugging Face "
            "tokenizers tokenizer.json, or leave it unset for the byte-level tokenizer"
        )
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    try:
        tok = _load(path, digest)
    except Exception as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"{field}={tokenizer!r} is not a valid tokenizers tokenizer.json "
            f"({reason}); save one with tokenizers.Tokenizer.save"
        ) from e
    eos = next((t for t in EOS_TOKENS if tok.token_to_id(t) is not None), None)
    if eos is None:
        raise ConfigError(
            f"{field}={tokenizer!r} has no end-of-document token; add one of "
            f"{list(EOS_TOKENS)} to its vocabulary (e.g. as a special token)"
        )
    return TokenizerInfo(
        path=path,
        digest=digest,
        eos_id=tok.token_to_id(eos),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
    )


class Tokenize:
    """The batched ``Dataset.map`` function: column ``text`` -> ``input_ids`` + EOS.

    Holds only plain values (no tokenizer object) so it pickles into ``num_proc`` workers and
    ``datasets`` hashes it stably. Empty documents produce no tokens (not even an EOS).
    """

    def __init__(self, info: TokenizerInfo) -> None:
        self.path = info.path
        self.digest = info.digest
        self.eos_id = info.eos_id

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[np.ndarray]]:
        texts = [t if isinstance(t, str) else "" for t in batch["text"]]
        out: list[np.ndarray] = []
        if self.path is None:
            for text in texts:
                ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
                out.append(np.append(ids, np.int32(self.eos_id)) if ids.size else ids)
        else:
            tokenizer = _load(self.path, self.digest)
            encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
            for text, encoding in zip(texts, encode(texts, add_special_tokens=False), strict=True):
                ids = np.asarray(encoding.ids, dtype=np.int32)
                out.append(np.append(ids, np.int32(self.eos_id)) if text else ids)
        return {"input_ids": out}
