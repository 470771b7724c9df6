"""``python cli.py export --ckpt_path CKPT --output DIR``: a checkpoint of any layout as a
Hugging Face GPT-2 directory.

This module only *reads* the checkpoint format (a ``megatron_sp`` directory of one file per
``(tp, pp)`` shard plus ``meta.pt``, or a one-process Lightning ``.ckpt`` file) into
layout-free ``(global name, full tensor)`` pairs; :func:`lightning_sp.interop.hf.save_gpt2`
turns those into the directory. Shard files are loaded one at a time, memory-mapped (their
optimizer states are never read), and each parameter's place in its full tensor comes from
the :class:`~lightning_sp.parallel.init.ShardSpec` of the same model built on the ``meta``
device for that shard's coordinates, so no slicing rule is restated here.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import save_gpt2
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import chunk_layer_ranges
from lightning_sp.training.data import BYTE_EOS_ID, EOS_TOKENS
from lightning_sp.training.strategy import META_FILE, shard_file

_SHARD = re.compile(r"model_tp(\d+)_pp(\d+)\.pt")
_CHUNK_KEY = re.compile(r"(?:gpt|pipeline\.chunks\.(\d+))\.(.+)")


@dataclasses.dataclass
class CheckpointModel:
    """What a checkpoint says about its model: the config, the layout it was saved with
    (``t``, ``p``, ``m``) and its vocabulary record (``GPTModule.on_save_checkpoint``)."""

    path: Path
    config: GPTConfig
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    virtual_pipeline_size: int = 1
    vocabulary: dict[str, Any] = dataclasses.field(default_factory=dict)

    def shard_path(self, tp_rank: int, pp_rank: int) -> Path:
        return self.path if self.path.is_file() else self.path / shard_file(tp_rank, pp_rank)


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def open_checkpoint(path: str | Path) -> CheckpointModel:
    """Read a checkpoint's metadata (not its weights); :class:`ConfigError` if it is none."""
    path = Path(path)
    if path.is_dir():
        if not (path / META_FILE).is_file():
            raise ConfigError(
                f"ckpt_path={str(path)!r} is not a checkpoint: no {META_FILE}; give a "
                "checkpoint directory written by the megatron_sp strategy or a .ckpt file"
            )
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
        coords = [
            tuple(map(int, m.groups())) for f in path.iterdir() if (m := _SHARD.match(f.name))
        ]
        t = 1 + max((c[0] for c in coords), default=-1)
        p = 1 + max((c[1] for c in coords), default=-1)
        if not coords or len(coords) != t * p:
            raise ConfigError(
                f"ckpt_path={str(path)!r} has {len(coords)} model shard files, not the "
                f"{t} x {p} of a complete tensor x pipeline layout"
            )
        first = _load(path / shard_file(0, 0))["state_dict"]
    elif path.is_file():
        meta = _load(path)
        t = p = 1
        first = meta["state_dict"]
    else:
        raise ConfigError(f"ckpt_path={str(path)!r} does not exist")
    fields = meta.get("hyper_parameters", {}).get("config")
    if fields is None:
        raise ConfigError(f"ckpt_path={str(path)!r} holds no GPTModule hyper-parameters")
    chunks = {int(m.group(1) or 0) for k in first if (m := _CHUNK_KEY.fullmatch(k))}
    config = GPTConfig(**fields)
    if config.recompute == "auto":  # recompute does not change the weights
        config = dataclasses.replace(config, recompute="none")
    return CheckpointModel(path, config, t, p, max(len(chunks), 1), meta.get("vocabulary", {}))


def _shard_chunks(ckpt: CheckpointModel, tp_rank: int, pp_rank: int) -> list[GPT]:
    """The model chunks of one shard, on the meta device: their parameters' ShardSpecs."""
    t, p = ckpt.tensor_parallel_size, ckpt.pipeline_parallel_size
    state = ParallelState(t, p, 1, tp_rank, pp_rank, 0, None, None, None, torch.device("meta"))
    ranges = chunk_layer_ranges(ckpt.config.num_layers, p, ckpt.virtual_pipeline_size, pp_rank)
    return [GPT(ckpt.config, state, layer_range=r, device="meta") for r in ranges]


def iter_full_tensors(ckpt: CheckpointModel) -> Iterator[tuple[str, Tensor]]:
    """``(global name, full tensor)`` for every parameter, one pipeline stage at a time: the
    stage's ``t`` shard files are read one after another into the stage's full tensors."""
    t = ckpt.tensor_parallel_size
    for pp_rank in range(ckpt.pipeline_parallel_size):
        full: dict[str, Tensor] = {}
        for tp_rank in range(t):
            saved = _load(ckpt.shard_path(tp_rank, pp_rank))["state_dict"]
            for c, chunk in enumerate(_shard_chunks(ckpt, tp_rank, pp_rank)):
                prefix = f"pipeline.chunks.{c}." if ckpt.pipeline_parallel_size > 1 else "gpt."
                for name, meta_param in chunk.named_parameters():
                    if name == "word_embeddings.weight" and not chunk.has_embedding:
                        continue  # the last stage's copy of the tied embedding
                    shard, spec = saved[prefix + name], meta_param.shard  # type: ignore[attr-defined]
                    key = chunk.global_name(name)
                    if spec.dim is None:
                        full.setdefault(key, shard.clone())
                        continue
                    if key not in full:
                        size = list(shard.shape)
                        size[spec.dim] *= t
                        full[key] = shard.new_empty(size)
                    full[key].narrow(spec.dim, spec.start, shard.shape[spec.dim]).copy_(shard)
            del saved
        yield from full.items()


def _tokenizer(ckpt: CheckpointModel, override: str | None) -> tuple[str | None, str | None, int]:
    """``(tokenizer.json path or None, EOS token, EOS id)`` of the run."""
    recorded = ckpt.vocabulary.get("tokenizer")
    path = override or ckpt.vocabulary.get("tokenizer_path")
    if path is None:
        if recorded not in (None, "bytes"):
            raise ConfigError(
                f"ckpt_path={str(ckpt.path)!r} was trained with tokenizer {recorded!r} but does "
                "not record its path; give it with --tokenizer PATH/tokenizer.json"
            )
        return None, None, BYTE_EOS_ID
    if not Path(path).is_file():
        raise ConfigError(f"tokenizer={path!r} is not a file; give the run's tokenizer.json")
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if recorded not in (None, f"tokenizers:{digest[:16]}"):
        raise ConfigError(
            f"tokenizer={path!r} is not the tokenizer {recorded!r} the checkpoint was trained "
            "with; give that tokenizer.json"
        )
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    eos = next((e for e in EOS_TOKENS if tok.token_to_id(e) is not None), None)
    eos_id = tok.token_to_id(eos) if eos is not None else None
    return str(path), eos, eos_id if eos_id is not None else BYTE_EOS_ID


def export_checkpoint(
    ckpt_path: str | Path, output: str | Path, tokenizer: str | None = None
) -> Path:
    """Write the checkpoint at ``ckpt_path`` (any layout) as a Hugging Face GPT-2 directory at
    ``output``, with the run's tokenizer files when it used a ``tokenizer.json`` (or
    ``tokenizer``, which must be the same file)."""
    ckpt = open_checkpoint(ckpt_path)
    tokenizer_file, eos_token, eos_id = _tokenizer(ckpt, tokenizer)
    if Path(output).is_file():
        raise ConfigError(f"output={str(output)!r} is a file; give a directory")
    return save_gpt2(
        ckpt.config,
        iter_full_tensors(ckpt),
        output,
        eos_token_id=eos_id,
        tokenizer_file=tokenizer_file,
        eos_token=eos_token,
    )


def main(argv: list[str]) -> int:
    """``cli.py export``'s entry point."""
    parser = argparse.ArgumentParser(
        prog="cli.py export",
        description="Write a checkpoint (any layout) as a Hugging Face GPT-2 directory that "
        "transformers.GPT2LMHeadModel.from_pretrained loads.",
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint directory or .ckpt file")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the run's tokenizer.json (default: the path the checkpoint records)",
    )
    args = parser.parse_args(argv)
    path = export_checkpoint(args.ckpt_path, args.output, args.tokenizer)
    print(f"wrote {path}")
    return 0
