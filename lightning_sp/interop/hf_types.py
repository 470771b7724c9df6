"""The Hugging Face model types we read and write, as data: per ``model_type`` its
``config.json`` table (:class:`~lightning_sp.interop.hf_config.ConfigTable`) and its naming
scheme (:class:`~lightning_sp.model.parts.weights.HFNames`).

Which of our parameters exist, and which Hugging Face tensor holds each, is the model's
business: the parts of the config's layer list their weights in the family's naming scheme
(:meth:`HFModelType.weights`: a norm with or without bias, ``fc1`` or ``gate`` + ``up``,
query/key norms); the scheme names the model's own tensors. Several of our parameters may
share one tensor (GPT-2's ``c_attn`` holds query, key and value): they are concatenated along
our dim 0 in the model's order.

A new Hugging Face family made of parts we have is one :class:`HFModelType` entry in
:data:`HF_MODEL_TYPES` (with an existing naming scheme, or a new :class:`HFNames` whose
conventions the parts have); nothing else asks which family it is looking at.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf_config import (
    ConfigField,
    ConfigTable,
    Mismatch,
    Option,
    fit_mismatches,
)
from lightning_sp.interop.hf_llama import LLAMA, LLAMA_STYLE, MISTRAL, OLMO2, QWEN2, QWEN3
from lightning_sp.interop.hf_moe import MOE_TYPES
from lightning_sp.interop.hf_tables import HFModelType
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.parts.weights import ExpertWeightMap, HFNames, WeightMap

__all__ = [
    "GPT2",
    "HF_MODEL_TYPES",
    "LLAMA",
    "MISTRAL",
    "OLMO2",
    "QWEN2",
    "QWEN3",
    "ExpertWeightMap",
    "HFModelType",
    "HFNames",
    "WeightMap",
    "hf_model_type",
    "model_type_for",
]


# -- GPT-2 ------------------------------------------------------------------------------------

# activation_function -> ours; export writes the first: torch's own tanh GeLU for gelu_tanh,
# so the exported model computes exactly ours (OpenAI's gelu_new is the same function)
_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def _gpt2_dropouts(config: GPTConfig) -> dict[str, Any]:
    return {
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
    }


GPT2 = HFModelType(
    model_type="gpt2",
    hf_class="GPT2LMHeadModel",
    architecture="gpt2",
    config=ConfigTable(
        title="GPT-2",
        fields=(
            ConfigField("vocab_size", "vocab_size"),
            ConfigField("hidden_size", "n_embd"),
            ConfigField("num_layers", "n_layer"),
            ConfigField("num_heads", "n_head"),
            ConfigField(
                "num_query_groups", "n_head", value=lambda c: c.groups, write=lambda c: c.num_heads
            ),
            ConfigField(
                "ffn_hidden_size",
                "n_inner",
                value=lambda c: c.ffn_size,
                read=lambda hf: hf.get("n_inner") or 4 * hf.get("n_embd", 0),
            ),
            ConfigField("seq_length", "n_positions", at_most=True),
            ConfigField("layernorm_eps", "layer_norm_epsilon", default=1e-5),
            ConfigField("activation", "activation_function", choices=_GPT2_ACTIVATIONS),
            ConfigField("normalization", default="layernorm"),
            ConfigField("position_embedding", default="learned"),
            ConfigField("bias", default=True, value=lambda c: c.bias_value()),
            ConfigField("tie_embeddings", default=True),
            ConfigField("feed_forward", default="dense"),
        ),
        options=tuple(
            Option.constant(key, value)
            for key, value in {
                "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False,
                "add_cross_attention": False,
                "tie_word_embeddings": True,
            }.items()
        ),
        extra=_gpt2_dropouts,
    ),
    names=HFNames(
        layer="transformer.h.{i}",
        norm="gpt2",
        attention="gpt2",
        feed_forward="gpt2",
        embedding="transformer.wte",
        final_norm="transformer.ln_f",
        positions="transformer.wpe",
        conv1d=True,
    ),
    optional_prefix="transformer.",
)


HF_MODEL_TYPES: dict[str, HFModelType] = {m.model_type: m for m in (GPT2, *LLAMA_STYLE, *MOE_TYPES)}
"""Every Hugging Face model type we read and write, by ``config.json`` ``model_type``."""


def hf_model_type(hf: Mapping[str, Any], where: str) -> HFModelType:
    """The model type of the ``config.json`` ``hf``; :class:`ConfigError` if we have none."""
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(
            f"{where} is not a supported model: config.json has model_type={model_type!r}; "
            f"valid: {', '.join(repr(m) for m in HF_MODEL_TYPES)}"
        )
    return HF_MODEL_TYPES[model_type]


def model_type_for(config: GPTConfig) -> HFModelType:
    """The Hugging Face model type that holds ``config`` exactly: ``config.hf_model_type`` if
    set, else the first that fits; :class:`ConfigError` (one line) if none does:
    :func:`none_holds`."""
    candidates = list(HF_MODEL_TYPES.values())
    if config.hf_model_type is not None:
        candidates = [hf_model_type({"model_type": config.hf_model_type}, "hf_model_type")]
    found = []
    for model_type in candidates:
        reasons = fit_mismatches(model_type.config, config)
        if not reasons:
            return model_type
        found.append((model_type, reasons))
    raise ConfigError(none_holds(found, config))


def _holds_part(model_type: HFModelType, config: GPTConfig) -> bool:
    """Whether the model type's layers have ``config``'s feed-forward part (its fixed
    ``feed_forward``)."""
    return all(
        f.of(config) == f.raw({}) for f in model_type.config.fields if f.ours == "feed_forward"
    )


def none_holds(found: list[tuple[HFModelType, list[Mismatch]]], config: GPTConfig) -> str:
    """The one line for ``config`` that no model type holds, from each type's mismatches.
    Only the types with the config's feed-forward part count when some have it; where they
    all differ in the same fields of one record (``moe``: a sigmoid router, the choice bias),
    those fields are what no family holds; else each type's first mismatch."""
    same_part = [(t, reasons) for t, reasons in found if _holds_part(t, config)]
    if same_part and len(same_part) < len(found):
        found = same_part
        first = found[0][1]
        for field in dict.fromkeys(r.field for r in first):
            held = [{d for r in reasons if r.field == field for d in r.differs}
                    for _, reasons in found]  # fmt: skip
            common = set.intersection(*held)
            if common:
                order = [d for r in first if r.field == field for d in r.differs]
                what = ", ".join(f"{field}.{name}={value!r}" for name, value in order
                                 if (name, value) in common)  # fmt: skip
                names = ", ".join(t.model_type for t, _ in found)
                return f"no Hugging Face family we export holds {what} ({names} do not)"
    reasons = "; ".join(f"{t.model_type}: {r[0].message}" for t, r in found)
    return f"no Hugging Face model type holds this config ({reasons})"
