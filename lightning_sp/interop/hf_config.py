"""Hugging Face GPT-2's ``config.json`` against :class:`GPTConfig`: read, check, write.

Our GPT is GPT-2's architecture (learned positions, pre-LayerNorm, GeLU MLP, tied
embeddings, attention scaled by 1/√d), so a GPT-2 directory fits a ``GPTConfig`` when the
sizes agree field by field. Every mismatch is one :class:`ConfigError` line naming our field,
its value and the value the directory needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_sp.errors import ConfigError
from lightning_sp.model.config import GPTConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# Hugging Face's activation_function -> our GPTConfig.activation
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# what export writes: torch's own tanh GeLU, so the exported model computes exactly ours
EXPORTED_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}

# GPT-2 options our model does not have, with the value it computes
UNSUPPORTED_OPTIONS = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}


def read_gpt2_config(directory: str | Path, field: str = "init_from") -> dict[str, Any]:
    """The ``config.json`` of a local GPT-2 directory (``field`` names the option that gave it
    in error messages). Raises :class:`ConfigError` when the directory, its ``config.json``
    or its weights file is missing, or when it is not a GPT-2 model."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(
            f"{field}={str(directory)!r} is not a directory; give a local Hugging Face GPT-2 "
            "directory (as written by save_pretrained)"
        )
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(
            f"{field}={str(directory)!r} has no {CONFIG_FILE}; give a local Hugging Face GPT-2 "
            "directory (as written by save_pretrained)"
        )
    try:
        hf = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(
            f"{field}={str(directory)!r}: {CONFIG_FILE} is not readable JSON ({reason})"
        ) from None
    model_type = hf.get("model_type") if isinstance(hf, dict) else None
    if model_type != "gpt2":
        raise ConfigError(
            f"{field}={str(directory)!r} is not a GPT-2 model: {CONFIG_FILE} has "
            f"model_type={model_type!r}; give a directory with model_type 'gpt2'"
        )
    if not (path / WEIGHTS_FILE).is_file() and not (path / WEIGHTS_INDEX_FILE).is_file():
        raise ConfigError(
            f"{field}={str(directory)!r} has no {WEIGHTS_FILE}; save the model with "
            "save_pretrained(..., safe_serialization=True) (pytorch_model.bin is not read)"
        )
    return hf


def check_gpt2_config(hf: dict[str, Any], config: GPTConfig, directory: str | Path) -> None:
    """Raise :class:`ConfigError` (one line naming our field) unless ``config`` has the sizes
    and options of the GPT-2 model whose ``config.json`` is ``hf``.

    ``seq_length`` may be shorter than GPT-2's ``n_positions`` (the first rows are used).
    """
    where = f"the GPT-2 model in {str(directory)!r}"
    inner = hf.get("n_inner") or 4 * hf.get("n_embd", 0)
    equal = (
        ("vocab_size", config.vocab_size, "vocab_size", hf.get("vocab_size")),
        ("hidden_size", config.hidden_size, "n_embd", hf.get("n_embd")),
        ("num_layers", config.num_layers, "n_layer", hf.get("n_layer")),
        ("num_heads", config.num_heads, "n_head", hf.get("n_head")),
        ("ffn_hidden_size", config.ffn_size, "n_inner", inner),
        ("layernorm_eps", config.layernorm_eps, "layer_norm_epsilon", hf.get("layer_norm_epsilon")),
    )
    for ours, value, theirs, needed in equal:
        if value != needed:
            raise ConfigError(
                f"{ours}={value} does not match {theirs}={needed} of {where}; set {ours}: {needed}"
            )
    positions = hf.get("n_positions")
    if not isinstance(positions, int) or config.seq_length > positions:
        raise ConfigError(
            f"seq_length={config.seq_length} exceeds n_positions={positions} of {where}; "
            f"use seq_length <= {positions}"
        )
    activation = hf.get("activation_function")
    if activation not in ACTIVATIONS:
        raise ConfigError(
            f"{where} uses activation_function={activation!r}, which our MLP does not compute; "
            f"valid: {', '.join(ACTIVATIONS)}"
        )
    if config.activation != ACTIVATIONS[activation]:
        raise ConfigError(
            f"activation={config.activation!r} does not match activation_function="
            f"{activation!r} of {where}; set activation: {ACTIVATIONS[activation]}"
        )
    for option, computed in UNSUPPORTED_OPTIONS.items():
        if hf.get(option, computed) != computed:
            raise ConfigError(
                f"{where} sets {option}={hf[option]!r}; this GPT computes {option}={computed}"
            )


def gpt2_config(
    config: GPTConfig, *, eos_token_id: int | None = None, dtype: str = "float32"
) -> dict[str, Any]:
    """The ``config.json`` of the GPT-2 model equal to ``config`` (positions: ``seq_length``;
    dropouts as trained; ``eos_token_id`` also serves as the BOS token, as in GPT-2)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.seq_length,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.ffn_size,
        "activation_function": EXPORTED_ACTIVATION[config.activation],
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "layer_norm_epsilon": config.layernorm_eps,
        "initializer_range": config.init_std,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": dtype,
        **UNSUPPORTED_OPTIONS,
    }
