"""Hugging Face export: a layout-free stream of ``(global name, full tensor)`` pairs (a
checkpoint reader, a model's state dict) to a directory ``AutoModelForCausalLM`` loads.

:func:`hf_tensors` maps our parameters, each given once and whole (vocabulary padding allowed,
dropped here), onto the model type's tensors through the same layout import reads
(:func:`~lightning_sp.interop.hf.hf_layout`): several of ours concatenated into one tensor,
transposed tensors, one tensor per expert. :func:`save_hf` writes ``config.json``,
``model.safetensors`` and the tokenizer files (a chat template included,
:func:`copy_chat_tokenizer`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from lightning_sp.interop.hf import full_shapes, hf_layout
from lightning_sp.interop.hf_config import CONFIG_FILE, WEIGHTS_FILE
from lightning_sp.interop.hf_types import HFModelType, model_type_for
from lightning_sp.model.config import GPTConfig


def hf_tensors(
    model_type: HFModelType, config: GPTConfig, tensors: Iterable[tuple[str, Tensor]]
) -> dict[str, Tensor]:
    """The Hugging Face tensors, by name, of ``(global name, full tensor)`` pairs holding each
    of our parameters once, whole (vocabulary padding allowed); a repeat (a pipeline stage's
    copy of the tied embedding) must be equal."""
    layout = hf_layout(model_type, config)
    shapes = full_shapes(config)
    ours: dict[str, Tensor] = {}
    for name, full in tensors:
        if name not in shapes:
            raise ValueError(f"{name!r} is not a parameter of this config's model")
        shape = shapes[name]
        value = full.detach()[: shape[0]]  # drops vocabulary padding
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {list(full.shape)}, not {list(shape)}")
        if name in ours and not torch.equal(ours[name], value):
            raise ValueError(f"{name} given twice with different values")
        ours[name] = value
    out = {}
    for hf_name, entry in layout.items():
        missing = [p.ours for p in entry.parts if p.ours not in ours]
        if missing:
            raise ValueError(f"no tensor for {missing[0]} ({model_type.title}'s {hf_name})")
        joined = torch.cat([p.of(ours[p.ours]) for p in entry.parts])
        out[hf_name] = (joined.t() if entry.transpose else joined).contiguous().clone()
    return out


CHAT_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""What :func:`copy_chat_tokenizer` copies beside a ``tokenizer.json``."""


def copy_chat_tokenizer(source: Path, output: Path) -> bool:
    """Copy a Hugging Face tokenizer directory's own files (:data:`CHAT_TOKENIZER_FILES`) when
    it has a chat template (``chat_template.jinja``, or a ``chat_template`` in its
    ``tokenizer_config.json``), so that ``apply_chat_template`` runs on the export; returns
    whether it did."""
    config = source / "tokenizer_config.json"
    if not config.is_file():
        return False
    has_template = (source / "chat_template.jinja").is_file() or bool(
        json.loads(config.read_text()).get("chat_template")
    )
    if has_template:
        for name in CHAT_TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, output / name)
    return has_template


def save_hf(
    config: GPTConfig,
    tensors: Iterable[tuple[str, Tensor]],
    output: str | Path,
    *,
    eos_token_id: int | None = None,
    tokenizer_file: str | Path | None = None,
    eos_token: str | None = None,
) -> Path:
    """Write a Hugging Face directory of the model type that holds ``config``
    (:func:`~lightning_sp.interop.hf_types.model_type_for`: GPT-2 or Llama) from ``(global
    name, full tensor)`` pairs (see :func:`hf_tensors`). Writes ``config.json``,
    ``model.safetensors`` and, given ``tokenizer_file`` (a ``tokenizers`` ``tokenizer.json``),
    that file with a ``tokenizer_config.json`` naming ``eos_token``, or the tokenizer's own
    configuration and chat template when it has one (:func:`copy_chat_tokenizer`). Returns
    the directory."""
    model_type = model_type_for(config)
    out = hf_tensors(model_type, config, tensors)
    hf = model_type.config_json(config, eos_token_id)
    dtypes = {t.dtype for t in out.values()}
    hf["dtype"] = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    path = Path(output)
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, path / "tokenizer.json")
        if copy_chat_tokenizer(Path(tokenizer_file).parent, path):
            return path  # the model's own tokenizer files, chat template included
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": config.seq_length,
            "bos_token": eos_token,
            "eos_token": eos_token,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return path
