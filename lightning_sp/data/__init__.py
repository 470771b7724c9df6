"""Training data: sources (``datasets`` loaders) -> ``prepare`` (tokenize once into
memory-mapped token shards) -> packed samples in a seeded, resumable, data-parallel order.

Modules: ``sources`` (text/JSONL/Parquet/CSV/saved/Hub), ``tokenizer`` (bytes or
``tokenizer.json``), ``prepare`` (the prepared directory), ``tokens`` (memory-mapped samples),
``order`` (per-index permutations and blends), ``blend`` (Megatron-style weights),
``sampler`` (data-parallel, resumable), ``corpus`` (where the samples come from),
``corpus_hooks`` (preparing it and mapping its splits), ``datamodule`` (the
``LightningDataModule``).
"""

from lightning_sp.data.blend import Blend, parse_blend
from lightning_sp.data.corpus import default_cache_dir
from lightning_sp.data.datamodule import TextDataModule
from lightning_sp.data.order import Permutation, SampleOrder
from lightning_sp.data.prepare import (
    PrepareSettings,
    check_prepared,
    prepare,
    read_metadata,
)
from lightning_sp.data.sampler import ResumableSampler
from lightning_sp.data.sources import Source, load_documents, resolve_paths
from lightning_sp.data.tokenizer import (
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    EOS_TOKENS,
    TokenizerInfo,
    tokenizer_info,
)
from lightning_sp.data.tokens import PackedSamples, TokenSplit

__all__ = [
    "BYTE_EOS_ID",
    "BYTE_VOCAB_SIZE",
    "EOS_TOKENS",
    "Blend",
    "PackedSamples",
    "Permutation",
    "PrepareSettings",
    "ResumableSampler",
    "SampleOrder",
    "Source",
    "TextDataModule",
    "TokenSplit",
    "TokenizerInfo",
    "check_prepared",
    "default_cache_dir",
    "load_documents",
    "parse_blend",
    "prepare",
    "read_metadata",
    "resolve_paths",
    "tokenizer_info",
]
