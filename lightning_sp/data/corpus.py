"""Where a data module's samples come from: one of a blend of prepared directories, an
existing prepared directory, or a source (local paths, a Hub dataset, the standard library)
to prepare into a given directory or into a cache directory keyed by what it holds.

:func:`resolve_corpus` picks the first that applies (in that order) and checks it before any
work: a source's paths resolve to at least one entry, an already-prepared directory matches
the tokenizer (:func:`~lightning_sp.data.prepare.check_prepared`) and its split files are
whole (:class:`~lightning_sp.data.tokens.TokenSplit`: index readable, file sizes as counted).
It reads no text.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass

from lightning_sp.data.blend import parse_blend
from lightning_sp.data.prepare import SPLITS, check_prepared, read_metadata
from lightning_sp.data.sources import Source, resolve_paths, stdlib_python_files
from lightning_sp.data.tokenizer import TokenizerInfo
from lightning_sp.data.tokens import TokenSplit
from lightning_sp.errors import ConfigError


def default_cache_dir() -> str:
    """``~/.cache/lightning_sp`` (``$XDG_CACHE_HOME`` respected)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "lightning_sp")


@dataclass(frozen=True)
class Corpus:
    """The prepared directories a data module reads, and the source to prepare first."""

    directories: list[str]
    """The prepared directories (one, or a blend's several), absolute where given."""
    source: Source | None = None
    """What to prepare into ``directories[0]``; ``None`` when it is already prepared."""
    weights: list[float] | None = None
    """A blend's normalized weights, one per directory; ``None`` without a blend."""


def cache_path(
    source: Source, info: TokenizerInfo, val_fraction: float, seed: int, cache_dir: str | None
) -> str:
    """The cache directory of ``source`` prepared with this tokenizer and split:
    ``<cache_dir>/prepared/<key>`` (``cache_dir`` unset: :func:`default_cache_dir`)."""
    key = [source.fingerprint(), info.digest, val_fraction, seed]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]
    return os.path.join(cache_dir or default_cache_dir(), "prepared", digest)


def resolve_corpus(
    *,
    paths: str | list[str] | None,
    dataset_name: str | None,
    text_field: str,
    prepared_dir: str | None,
    blend: list[float | str] | None,
    max_documents: int | None,
    seed: int,
    val_fraction: float,
    cache_dir: str | None,
    info: TokenizerInfo,
) -> Corpus:
    """Where the samples come from, first match wins: ``blend``; a complete
    ``prepared_dir`` with ``paths`` and ``dataset_name`` unset; else the source prepared into
    ``prepared_dir`` or the cache (:func:`cache_path`). Raises ``ConfigError`` when the
    standard library has no ``.py`` files or a prepared directory does not match ``info``."""
    if blend is not None:
        parsed = parse_blend(blend)
        directories = [os.path.abspath(d) for d in parsed.directories]
        corpus = Corpus(directories, weights=list(parsed.weights))
    elif (
        prepared_dir is not None
        and paths is None
        and dataset_name is None
        and read_metadata(os.path.expanduser(prepared_dir)) is not None
    ):  # an existing prepared corpus, whatever it was prepared from
        corpus = Corpus([os.path.abspath(os.path.expanduser(prepared_dir))])
    else:
        entries: list[str] = []
        if dataset_name is None:
            entries = stdlib_python_files() if paths is None else resolve_paths(paths)
            if not entries:
                raise ConfigError(
                    "paths=None found no standard-library .py files under "
                    f"{sysconfig.get_paths()['stdlib']!r}; give files with paths"
                )
        source = Source(tuple(entries), dataset_name, text_field, max_documents, seed)
        directory = prepared_dir or cache_path(source, info, val_fraction, seed, cache_dir)
        return Corpus([directory], source)
    for directory in corpus.directories:  # already prepared: it must match the tokenizer
        check_prepared(directory, info)
        for split in SPLITS:  # and its files be whole (sizes only: nothing is read)
            TokenSplit(directory, split)
    return corpus
