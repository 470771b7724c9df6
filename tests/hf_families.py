"""Shared by the Hugging Face family tests: a small random model of each Llama-style family
(Mistral, Qwen2, Qwen3, OLMo 2) saved locally (nothing is downloaded), its float64 reference
logits and loss on a fixed batch, and the layouts a model is read into.

Each model has 8 query heads in 2 key/value groups (fewer than t = 4), untied embeddings and
every weight perturbed (norms, biases and query/key norms included); Mistral and Qwen3 use a
head dimension of 12, not h/a = 8. transformers runs sdpa attention (its eager path casts the
softmax to fp32). OLMo 2's query/key norms span the whole projection, which tensor
parallelism shards: we compute their statistics in the model's dtype widened to fp32 at least
(float64 here, the same under any t); transformers rounds them to fp32 even in a float64
model, so the float64 reference runs its ``q_norm`` / ``k_norm`` in float64
(:func:`wide_olmo2_norms`); unpatched the difference is fp32 rounding (~1e-7).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

from hf_models import HIDDEN, LAYERS, VOCAB, hf_logits_and_loss, save_with_reference, transformers

HEADS, GROUPS, FFN, HEAD_DIM = 8, 2, 96, 12

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None,
                                                        "head_dim": HEAD_DIM}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": HEAD_DIM}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}  # fmt: skip
"""Family -> (config class, model class, what it sets besides the common sizes)."""


def family_config(family: str, **overrides: Any) -> Any:
    """The small transformers config of ``family``."""
    config_class, _, own = FAMILIES[family]
    fields = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=GROUPS, intermediate_size=FFN, vocab_size=VOCAB,
                  max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_theta=20000.0, bos_token_id=0, eos_token_id=0, pad_token_id=None,
                  attn_implementation="sdpa", **own)  # fmt: skip
    fields.update(overrides)
    return getattr(transformers, config_class)(**fields)


def save_random_family(directory: Path, family: str, **overrides: Any) -> Any:
    """A random model of ``family``, every parameter perturbed, saved in ``directory``;
    returned in float64 eval mode (OLMo 2's query/key norms widened, :func:`wide_olmo2_norms`)."""
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[family][1])(family_config(family, **overrides))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    model.save_pretrained(directory)
    model = model.double().eval()
    if family == "olmo2":
        wide_olmo2_norms(model)
    return model


def _wide_rms_norm(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``Olmo2RMSNorm.forward`` with its statistics in the input's dtype (float64)."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def wide_olmo2_norms(model: Any) -> None:
    """Run an OLMo 2 (or OLMoE: the same query/key norms over the whole projection) model's
    ``q_norm`` and ``k_norm`` with float64 statistics."""
    for layer in model.model.layers:
        for name in ("q_norm", "k_norm"):
            norm = getattr(layer.self_attn, name)
            norm.forward = types.MethodType(_wide_rms_norm, norm)


def save_family_with_reference(directory: Path, family: str) -> tuple[Path, Path]:
    """A saved random ``family`` model and, beside it, its float64 reference logits and loss."""
    return save_with_reference(directory, save_random_family(directory, family))


__all__ = ["FAMILIES", "hf_logits_and_loss", "save_family_with_reference", "save_random_family"]
