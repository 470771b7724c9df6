"""LoRA adapters as ``peft`` names them: the adapter tensors of a model and their names in a
PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), written and
read.

Our adapter of linear ``layers.{i}.attention.query`` is ``layers.{i}.attention.query.lora.A``
and ``.B``; ``peft`` names them after the Hugging Face module of that linear in the model type's
naming scheme (:meth:`~lightning_sp.interop.hf_tables.HFModelType.weights`):
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` and ``lora_B.weight``
(``A [r, in]``, ``B [out, r]`` in both, whatever the layout: a file holds full tensors).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf_types import HFModelType, model_type_for
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.lora import LoRAConfig
from lightning_sp.model.parts.weights import WeightMap
from lightning_sp.parallel.init import local_slice

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What ``peft`` puts before a model's own module names in a saved adapter."""


def hf_modules(model_type: HFModelType, config: GPTConfig) -> dict[str, str]:
    """Our linears (``layers.{i}.attention.query``) -> their Hugging Face module
    (``model.layers.{i}.self_attn.q_proj``), for the linears held whole by one tensor."""
    rows = [w for w in model_type.weights(config) if isinstance(w, WeightMap)]
    by_tensor: dict[str, list[str]] = {}
    for row in rows:
        by_tensor.setdefault(row.hf, []).append(row.ours)
    return {
        row.ours.removesuffix(".weight"): row.hf.removesuffix(".weight")
        for row in rows
        if row.ours.endswith(".weight") and len(by_tensor[row.hf]) == 1
    }


def peft_name(linear: str, which: str, modules: Mapping[str, str]) -> str:
    """The ``peft`` file name of our adapter tensor ``{linear}.lora.{which}`` (``linear`` with
    a layer number; ``which``: ``A`` or ``B``)."""
    parts = linear.split(".")
    key = ".".join(["layers", "{i}", *parts[2:]]) if parts[0] == "layers" else linear
    if key not in modules:
        raise ConfigError(f"lora: {linear!r} has no Hugging Face module to name its adapter")
    module = modules[key].replace("{i}", parts[1]) if parts[0] == "layers" else modules[key]
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def adapter_config(
    config: GPTConfig, lora: LoRAConfig, linears: Iterable[str], base: str | None
) -> dict[str, Any]:
    """The ``adapter_config.json`` of adapters on ``linears`` (our global names): ``peft``'s
    LoRA fields, ``target_modules`` as the family's module names."""
    modules = hf_modules(model_type_for(config), config)
    targets = sorted({peft_name(n, "A", modules).split(".")[-3] for n in linears})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.r,
        "lora_alpha": lora.lora_alpha,
        "lora_dropout": lora.lora_dropout,
        "use_rslora": lora.use_rslora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def save_adapter(
    config: GPTConfig,
    lora: LoRAConfig,
    tensors: Iterable[tuple[str, Tensor]],
    output: str | Path,
    base: str | None = None,
) -> Path:
    """Write a PEFT adapter directory from ``(global name, full tensor)`` pairs of our adapter
    parameters (``layers.{i}.{linear}.lora.A`` / ``.B``); ``base``: the base model's directory
    (``base_model_name_or_path``). Returns the directory."""
    modules = hf_modules(model_type_for(config), config)
    out: dict[str, Tensor] = {}
    linears = []
    for name, full in tensors:
        linear, _, which = name.rpartition(".lora.")
        out[peft_name(linear, which, modules)] = full.detach().contiguous().clone()
        linears.append(linear)
    path = Path(output)
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    document = adapter_config(config, lora, linears, base)
    (path / ADAPTER_CONFIG).write_text(json.dumps(document, indent=2) + "\n")
    return path


def read_adapter_config(directory: str | Path, field: str = "adapter_from") -> LoRAConfig:
    """The :class:`LoRAConfig` a PEFT adapter directory states (its ``target_modules`` as
    written); :class:`ConfigError` (one line) for a directory that is not a LoRA adapter."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise ConfigError(f"{field}={str(directory)!r} has no {ADAPTER_CONFIG}")
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{field}: {path} is not readable JSON ({error})") from None
    if document.get("peft_type") != "LORA":
        raise ConfigError(f"{field}: {path} is peft_type={document.get('peft_type')!r}, not LORA")
    targets = document.get("target_modules")
    lora = LoRAConfig(
        r=document.get("r", 8),
        lora_alpha=document.get("lora_alpha", 8),
        lora_dropout=document.get("lora_dropout", 0.0),
        target_modules=[targets] if isinstance(targets, str) else list(targets or []),
        use_rslora=bool(document.get("use_rslora", False)),
    )
    lora.validate()
    return lora


def read_adapter(directory: str | Path, config: GPTConfig) -> dict[str, Tensor]:
    """The adapter tensors of a PEFT adapter directory by our global names
    (``layers.{i}.{linear}.lora.A``), full; :class:`ConfigError` (one line) for a tensor that
    names no linear of ``config``'s model."""
    modules = hf_modules(model_type_for(config), config)
    theirs = {}
    for ours, module in modules.items():
        for which in ("A", "B"):
            theirs[f"{PEFT_PREFIX}{module}.lora_{which}.weight"] = f"{ours}.lora.{which}"
    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ConfigError(f"adapter_from={str(directory)!r} has no {ADAPTER_WEIGHTS}")
    out = {}
    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            pattern = _layer_pattern(key)
            if pattern is None or pattern[0] not in theirs:
                raise ConfigError(f"adapter_from: {key!r} names no linear of this model")
            out[theirs[pattern[0]].replace("{i}", pattern[1])] = handle.get_tensor(key)
    return out


def check_adapter_base(directory: str | Path, init_from: str | Path | None) -> None:
    """:class:`ConfigError` (one line) when the adapter directory names a base model
    (``base_model_name_or_path``, a local directory) other than ``init_from``."""
    document = json.loads((Path(directory) / ADAPTER_CONFIG).read_text())
    base = document.get("base_model_name_or_path")
    if base and init_from is not None and Path(base).resolve() != Path(init_from).resolve():
        raise ConfigError(
            f"adapter_from={str(directory)!r} was trained on {base!r}, not on "
            f"init_from={str(init_from)!r}"
        )


FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK = 1024, 1 << 16
"""A weights file larger than ``FINGERPRINT_BLOCKS · FINGERPRINT_BLOCK`` bytes (64 MiB) is
fingerprinted by that many blocks at evenly spaced offsets; a smaller one whole."""


def base_fingerprint(directory: str | Path) -> str:
    """SHA-256 (hex) naming a base model directory's content: its ``config.json`` and, for each
    ``*.safetensors`` file (by name), its size and bytes (every byte up to 64 MiB; beyond,
    :data:`FINGERPRINT_BLOCKS` blocks of 64 KiB evenly spaced, header included: any two
    trainings of one architecture differ in nearly every weight, so in the blocks too). What
    an adapter run records of its base and checks on resume."""
    path = Path(directory)
    sha = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        sha.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as handle:
            if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK:
                sha.update(handle.read())
                continue
            step = (size - FINGERPRINT_BLOCK) // (FINGERPRINT_BLOCKS - 1)
            for index in range(FINGERPRINT_BLOCKS):
                handle.seek(index * step)
                sha.update(handle.read(FINGERPRINT_BLOCK))
    return sha.hexdigest()


@torch.no_grad()
def load_adapter(model: nn.Module, directory: str | Path, config: GPTConfig) -> int:
    """Set every adapter shard of ``model`` (one rank's GPT chunk, adapted) to its slice of
    the PEFT adapter in ``directory``; :class:`ConfigError` (one line) if the directory lacks
    one of them or holds one the model lacks. Returns the number of tensors set."""
    full = read_adapter(directory, config)
    ours = {
        model.global_name(n): p  # type: ignore[operator]
        for n, p in model.named_parameters()
        if getattr(p, "lora", False)
    }
    missing = sorted(set(ours) - set(full))
    if missing:
        raise ConfigError(f"adapter_from={str(directory)!r} has no {missing[0]!r}")
    layers = {n.split(".")[1] for n in ours}
    extra = sorted(n for n in set(full) - set(ours) if n.split(".")[1] in layers)
    if extra:
        raise ConfigError(f"adapter_from: {extra[0]!r} adapts a linear this run does not")
    for name, param in ours.items():
        param.copy_(local_slice(param, full[name].to(param.dtype)))
    return len(ours)


def merged_tensors(
    tensors: Mapping[str, Tensor], adapters: Mapping[str, Tensor], lora: LoRAConfig
) -> dict[str, Tensor]:
    """Full base tensors (our global names) with each adapted linear's weight replaced by
    ``W + s · B A``: the model a plain transformers directory holds."""
    out = dict(tensors)
    for name, a in adapters.items():
        linear, _, which = name.rpartition(".lora.")
        if which != "A":
            continue
        weight = f"{linear}.weight"
        delta = adapters[f"{linear}.lora.B"].double() @ a.double()
        out[weight] = tensors[weight] + (lora.scaling * delta).to(tensors[weight].dtype)
    return out


def _layer_pattern(key: str) -> tuple[str, str] | None:
    """``key`` with its layer number replaced by ``{i}``, and the number (``""`` if none)."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit() and i > 0 and parts[i - 1] in ("layers", "h"):
            return ".".join([*parts[:i], "{i}", *parts[i + 1 :]]), part
    return key, ""


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_config",
    "base_fingerprint",
    "check_adapter_base",
    "load_adapter",
    "merged_tensors",
    "read_adapter",
    "read_adapter_config",
    "save_adapter",
]
