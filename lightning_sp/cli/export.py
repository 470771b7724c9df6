"""``python cli.py export --ckpt_path CKPT --output DIR``: a checkpoint of any layout as a
Hugging Face directory of the model type that holds its architecture (GPT-2 or Llama,
:func:`lightning_sp.interop.hf_types.model_type_for`). A checkpoint of a LoRA run
(``model.lora``) exports its adapters as a PEFT adapter directory (``--adapter DIR``:
``adapter_config.json`` + ``adapter_model.safetensors``, :mod:`lightning_sp.interop.peft`;
``base_model_name_or_path`` is the run's ``init_from``) and/or, with ``--output DIR``, the
merged model (each adapted weight ``W + s·B A``) as a plain Hugging Face directory; its
checkpoint holds the adapters only, so the merge reads the base from the run's ``init_from``
(checked to be the base it recorded).

This module only *reads* the checkpoint (a ``megatron_sp`` DCP directory,
:mod:`lightning_sp.checkpoint`, whose keys are global parameter names; or a
one-process Lightning ``.ckpt`` file) into layout-free ``(global name, full tensor)`` pairs;
:func:`lightning_sp.interop.hf_export.save_hf` turns those into the directory. DCP assembles one
full tensor at a time from whichever ranks' shards hold its pieces, so no full model is held
beyond the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_sp.checkpoint import verify
from lightning_sp.checkpoint.shards import parameter_shards
from lightning_sp.checkpoint.verify import check_architecture, read_lightning, saved_config
from lightning_sp.cli.parser import OneLineArgumentParser
from lightning_sp.data import BYTE_EOS_ID, EOS_TOKENS
from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import full_shapes, load_hf_weights
from lightning_sp.interop.hf_export import save_hf
from lightning_sp.interop.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merged_tensors, save_adapter
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.lora import LoRAConfig
from lightning_sp.model.recompute import NO_RECOMPUTE
from lightning_sp.parallel.state import ParallelState
from lightning_sp.training.adapters import check_base


def _config(fields: dict[str, Any]) -> GPTConfig:
    """The checkpoint's config, as export builds it: without recomputation (which does not
    change the weights; ``auto`` is resolved per device at run time)."""
    return dataclasses.replace(GPTConfig.from_values(fields), recompute=NO_RECOMPUTE)


@dataclasses.dataclass
class CheckpointModel:
    """What a checkpoint says about its model: the config, where its tensors are (a DCP
    directory, or a one-process Lightning ``.ckpt`` file) and its vocabulary record
    (``GPTModule.on_save_checkpoint``)."""

    path: Path
    config: GPTConfig
    keys: dict[str, Any]  # "model.<global name>" -> DCP storage metadata (directory only)
    vocabulary: dict[str, Any]
    hyper_parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The module's hyper-parameters (``lora``, ``init_from``)."""
    lora_base: dict[str, Any] | None = None
    """A LoRA run's base (``init_from`` and its fingerprint:
    :func:`~lightning_sp.training.adapters.base_record`)."""

    @property
    def lora(self) -> LoRAConfig | None:
        """The run's adapter settings (None: a full fine-tune)."""
        fields = self.hyper_parameters.get("lora")
        return LoRAConfig(**fields) if fields else None


def _dcp_read(state: dict[str, Any], path: Path) -> None:
    """Fill ``state``'s entries (full tensors or objects) from the DCP checkpoint at ``path``
    in this one process."""
    with warnings.catch_warnings():  # "no process group: loading in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, storage_reader=FileSystemReader(path), no_dist=True)


def open_checkpoint(path: str | Path) -> CheckpointModel:
    """Read a checkpoint's metadata (not its weights); :class:`ConfigError` if it is none."""
    path = Path(path)
    if path.is_file():  # a Lightning .ckpt of a one-process run: names are already global
        saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        fields = saved.get("hyper_parameters", {}).get("config")
        if fields is None:
            raise ConfigError(f"ckpt_path={str(path)!r} holds no GPTModule hyper-parameters")
        hyper = saved.get("hyper_parameters", {})
        return CheckpointModel(path, _config(fields), {}, saved.get("vocabulary", {}), hyper)
    meta, metadata = verify(path)  # one line if missing, incomplete or corrupt
    config = _config(saved_config(meta).values())
    data = path.resolve()
    state = read_lightning(data)  # Lightning's state: vocabulary, hparams, a LoRA run's base
    vocabulary, hyper = state.get("vocabulary", {}), dict(state.get("hyper_parameters", {}))
    lora = hyper.get("lora")
    # a tensor this model (with the run's adapters) lacks: one line
    check_architecture(metadata, meta, config, LoRAConfig(**lora) if lora else None)
    keys = {
        k: v
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    return CheckpointModel(data, config, keys, vocabulary, hyper, state.get("lora_base"))


def _adapter(name: str) -> bool:
    return ".lora." in name


def iter_full_tensors(
    ckpt: CheckpointModel, select: Callable[[str], bool] = lambda name: True
) -> Iterator[tuple[str, Tensor]]:
    """``(global name, full tensor)`` for every parameter whose name ``select`` accepts, one
    tensor read at a time (DCP assembles it from whichever ranks' shards hold its pieces)."""
    if ckpt.path.is_file():
        state = torch.load(ckpt.path, map_location="cpu", weights_only=False, mmap=True)
        for key, tensor in state["state_dict"].items():
            if key.startswith("gpt.") and select(key.removeprefix("gpt.")):
                yield key.removeprefix("gpt."), tensor
        return
    for key, entry in ckpt.keys.items():
        if not select(key.removeprefix("model.")):
            continue
        tensor = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        _dcp_read({key: tensor}, ckpt.path)
        yield key.removeprefix("model."), tensor


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


MODEL_FILES = (
    "config.json", "generation_config.json", "model.safetensors",
    "model.safetensors.index.json", "model-*-of-*.safetensors", "pytorch_model.bin",
    "pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja",
)  # fmt: skip
"""Names (globs) of a Hugging Face model directory's files: what ``--overwrite true`` removes
before writing, so that no file of a previous model (a stale ``tokenizer.json`` beside a
byte-level model) is left behind. Nothing else in the directory is touched."""


def model_files(directory: Path) -> list[Path]:
    """The files of ``directory`` that :data:`MODEL_FILES` names, sorted."""
    found = {p for pattern in MODEL_FILES for p in directory.glob(pattern) if p.is_file()}
    return sorted(found)


def clear_output(output: Path, overwrite: bool) -> list[str]:
    """Make ``output`` ready for a model: a new or empty directory as it is; a non-empty one
    only with ``overwrite``, after removing the previous model's files (returned, by name;
    every other entry stays). :class:`ConfigError` (one line) otherwise."""
    if output.is_file():
        raise ConfigError(f"output={str(output)!r} is a file; give a directory")
    if not output.is_dir() or not any(output.iterdir()):
        return []
    if not overwrite:
        raise ConfigError(
            f"output={str(output)!r} is not empty; give a new or empty directory, or "
            "--overwrite true to replace the model files in it"
        )
    removed = model_files(output)
    for path in removed:
        path.unlink()
    return [path.name for path in removed]


def umask_modes(paths: list[Path]) -> None:
    """Give ``paths`` the mode a new file gets under the user's umask (``0o666 & ~umask``):
    safetensors writes its file with mode 0600 whatever the umask."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        path.chmod(0o666 & ~umask)


def merged_full_tensors(ckpt: CheckpointModel) -> Iterator[tuple[str, Tensor]]:
    """The model's full tensors, each adapted weight merged with its adapter (``W + s·B A``,
    :func:`~lightning_sp.interop.peft.merged_tensors`); a full fine-tune's as they are."""
    lora = ckpt.lora
    if lora is None:
        yield from iter_full_tensors(ckpt)
        return
    adapters = dict(iter_full_tensors(ckpt, _adapter))  # r columns or rows each: small
    for name, tensor in base_full_tensors(ckpt, next(iter(adapters.values())).dtype):
        linear = name.removesuffix(".weight")
        if f"{linear}.lora.A" not in adapters:
            yield name, tensor
            continue
        pair = {f"{linear}.lora.{w}": adapters[f"{linear}.lora.{w}"] for w in ("A", "B")}
        yield name, merged_tensors({name: tensor}, pair, lora)[name]


def base_full_tensors(ckpt: CheckpointModel, dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """A LoRA run's frozen weights (and the checkpoint's buffers), full: the checkpoint's
    when it holds them, else (a run from ``init_from`` saves its adapters only) read from
    the run's ``init_from`` as ``dtype``, once its fingerprint is the one the checkpoint
    records (one line otherwise). The base is then built whole in this process."""
    if ckpt.path.is_file() or all(f"model.{n}" in ckpt.keys for n in full_shapes(ckpt.config)):
        yield from iter_full_tensors(ckpt, lambda name: not _adapter(name))
        return
    base = ckpt.hyper_parameters.get("init_from")
    if base is None:
        raise ConfigError(
            f"ckpt_path={str(ckpt.path)!r} holds adapters only and records no init_from to "
            "merge them into; export --adapter DIR instead"
        )
    check_base(ckpt.lora_base, base)  # one line: another base than the run's
    model = GPT(dataclasses.replace(ckpt.config, sequence_parallel=False),
                ParallelState.single(), dtype=dtype)  # fmt: skip
    load_hf_weights(model, base)
    names = set()
    for name, _, shard in parameter_shards(model):
        assert shard is not None  # one process holds every row
        names.add(name)
        yield name, shard.local
    for name, tensor in iter_full_tensors(ckpt, lambda name: not _adapter(name)):
        if name not in names:  # persistent buffers (an MoE router's biases): the run's
            yield name, tensor


def export_adapter(ckpt: CheckpointModel, adapter: str | Path, overwrite: bool) -> Path:
    """Write the adapters of ``ckpt`` (a LoRA run's) as a PEFT adapter directory at
    ``adapter`` (new or empty unless ``overwrite``, which replaces its adapter files);
    ``base_model_name_or_path``: the run's ``init_from``. One line for a checkpoint of a full
    fine-tune."""
    lora = ckpt.lora
    if lora is None:
        raise ConfigError(
            f"ckpt_path={str(ckpt.path)!r} is a full fine-tune (no model.lora): it has no "
            "adapters; export it with --output DIR"
        )
    directory = Path(adapter)
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise ConfigError(
            f"adapter={str(directory)!r} is not empty; give a new or empty directory, or "
            "--overwrite true to replace the adapter files in it"
        )
    base = ckpt.hyper_parameters.get("init_from")
    if base is not None and Path(base).is_dir():  # as given to the run: relative to here
        base = str(Path(base).resolve())
    path = save_adapter(ckpt.config, lora, iter_full_tensors(ckpt, _adapter), directory, base)
    umask_modes([path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS])
    return path


def export_checkpoint(
    ckpt_path: str | Path,
    output: str | Path,
    tokenizer: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], object] = print,
) -> Path:
    """Write the checkpoint at ``ckpt_path`` (any layout) as a Hugging Face directory at
    ``output`` (a LoRA run's merged: :func:`merged_full_tensors`), with the run's tokenizer
    files when it used a ``tokenizer.json`` (or ``tokenizer``, which must be the same file).
    ``output`` must be new or empty unless ``overwrite``, which first removes the previous
    model's files (:func:`clear_output`; ``log`` gets one line naming them). Files get the
    user's umask."""
    ckpt = open_checkpoint(ckpt_path)
    tokenizer_file, eos_token, eos_id = _tokenizer(ckpt, tokenizer)
    directory = Path(output)
    removed = clear_output(directory, overwrite)
    if removed:
        log(f"removed the previous model's files from {directory}: {', '.join(removed)}")
    path = save_hf(
        ckpt.config,
        merged_full_tensors(ckpt),
        directory,
        eos_token_id=eos_id,
        tokenizer_file=tokenizer_file,
        eos_token=eos_token,
    )
    umask_modes(model_files(path))
    return path


def _flag(value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not true or false")


def main(argv: list[str]) -> int:
    """``lightning-sp export``'s entry point."""
    parser = OneLineArgumentParser(
        "export",
        description="Write a checkpoint (any layout) as a Hugging Face directory that "
        "transformers.AutoModelForCausalLM.from_pretrained loads (GPT2LMHeadModel or "
        "LlamaForCausalLM, by the model's architecture).",
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint directory or .ckpt file")
    parser.add_argument(
        "--output",
        default=None,
        help="directory to write the model to (a LoRA run's merged: each adapted weight W + s·B A)",
    )
    parser.add_argument(
        "--adapter",
        default=None,
        help="a LoRA run's adapters: the PEFT adapter directory to write (adapter_config.json "
        "+ adapter_model.safetensors; peft.PeftModel.from_pretrained and model.adapter_from "
        "read it)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the run's tokenizer.json (default: the path the checkpoint records)",
    )
    parser.add_argument(
        "--overwrite",
        type=_flag,
        default=False,
        help="true: write into a non-empty directory, first removing the files of the model "
        "there (config.json, model.safetensors*, tokenizer files; named in one line); other "
        "files stay. false (default): refuse a non-empty directory",
    )
    args = parser.parse_args(argv)
    if args.output is None and args.adapter is None:
        raise ConfigError("export writes --output DIR (the model) and/or --adapter DIR; give one")
    if args.adapter is not None:
        adapter = export_adapter(open_checkpoint(args.ckpt_path), args.adapter, args.overwrite)
        print(f"wrote {adapter}")
    if args.output is not None:
        path = export_checkpoint(args.ckpt_path, args.output, args.tokenizer, args.overwrite)
        print(f"wrote {path}")
    return 0
