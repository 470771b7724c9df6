"""The mixture-of-experts Hugging Face families, as data: Mixtral, Qwen3-MoE and OLMoE.

Each is a Llama-style family (:mod:`lightning_sp.interop.hf_llama`: its attention, norms and
``config.json`` vocabulary) whose feed-forward is our ``moe`` part:

==========  =================================================================================
mixtral     Mistral's attention; ``block_sparse_moe.gate`` (router), experts ``w1`` (gate),
            ``w3`` (up), ``w2`` (down); ``num_local_experts``, ``intermediate_size`` = f_e;
            top-k renormalised
qwen3_moe   Qwen3's attention (per-head query/key norms, ``head_dim``); ``mlp.gate``, experts
            ``gate_proj`` / ``up_proj`` / ``down_proj``; ``num_experts``,
            ``moe_intermediate_size`` = f_e, ``norm_topk_prob``; every layer sparse
olmoe       OLMo 2's query/key norms over the projections, norms before the sublayers;
            ``mlp.gate``, experts as Qwen3-MoE's; ``intermediate_size`` = f_e,
            ``norm_topk_prob`` (False in OLMoE-1B-7B)
==========  =================================================================================

The Hub stores one tensor per expert (``...experts.{e}.w1.weight``), which transformers 5 also
writes: our stacked ``experts.gate_up [E, 2f_e, h]`` and ``experts.down [E, h, f_e]`` are
:class:`~lightning_sp.model.parts.weights.ExpertWeightMap` rows, named by the MoE part
(``HF_MOE`` in ``model/moe/part.py``: ``mixtral``, and ``llama`` for Qwen3-MoE and OLMoE).
A file of transformers' in-memory names (its ``state_dict`` saved as is: fused
``mlp.experts.gate_up_proj`` and ``down_proj``, Mixtral's router as ``mlp.gate``) is read too;
export writes the Hub's form.
The routing a checkpoint fixes (experts, top-k, width, renormalisation) is compared; the
training-only settings (loss coefficients, capacity, router dtype) are ours to choose, and the
auxiliary coefficient is written as ``router_aux_loss_coef``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_sp.interop.hf_config import ConfigField, Option
from lightning_sp.interop.hf_llama import (
    ATTENTION_BIAS,
    MISTRAL_WINDOW,
    NAMES,
    NO_BIAS,
    QWEN_WINDOW,
    decoder_fields,
    dropout_keys,
    llama_family,
)
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.moe.config import MoEConfig


@dataclasses.dataclass(frozen=True)
class MoEKeys:
    """A family's ``config.json`` keys of our ``moe``: the expert count ``experts``
    (``num_local_experts`` or ``num_experts``; either is read), ``num_experts_per_tok``, the
    expert width ``width`` and the renormalisation key ``normalize`` (``norm_topk_prob``;
    None: the family always renormalises the top-k, and writes no key)."""

    experts: str
    width: str
    normalize: str | None

    def field(self) -> ConfigField:
        """Our ``moe`` read from these keys; compared as the MoE shape (:attr:`MoEConfig.
        architecture`; the training settings, no part of a checkpoint, at their defaults on
        both sides)."""

        def read(hf: Mapping[str, Any]) -> MoEConfig:
            return MoEConfig(
                num_experts=hf.get("num_local_experts") or hf["num_experts"],
                top_k=hf["num_experts_per_tok"],
                expert_ffn_size=hf[self.width],
                normalize_top_k=self.normalize is None or bool(hf.get(self.normalize)),
            )

        def shape(config: GPTConfig) -> MoEConfig | None:
            moe = config.moe
            return None if moe is None else MoEConfig(**dataclasses.asdict(moe.architecture))

        return ConfigField("moe", read=read, value=shape)

    def written(self, config: GPTConfig) -> dict[str, Any]:
        """The keys of ``config``'s ``moe`` (and the dropouts), as export writes them."""
        moe = config.moe or MoEConfig()
        keys = {
            **dropout_keys(config),
            self.experts: moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            self.width: moe.expert_ffn_size,
            "router_aux_loss_coef": moe.aux_loss_coef,
            "output_router_logits": moe.aux_loss_coef > 0,
        }
        if self.normalize is not None:
            keys[self.normalize] = moe.normalize_top_k
        return keys


def _sparse_fields(
    bias: ConfigField, qk_norm: str | None, keys: MoEKeys, **defaults: float
) -> tuple[ConfigField, ...]:
    """The Llama-style fields of an all-sparse family: no dense width (``intermediate_size``
    is the experts' in Mixtral and OLMoE, unused in Qwen3-MoE), the ``moe`` feed-forward in
    ``keys``, norms before the sublayers, ``qk_norm``; ``defaults``: the family's
    ``rms_norm_eps`` / ``rope_theta`` where ``config.json`` has none
    (:func:`~lightning_sp.interop.hf_llama.decoder_fields`)."""
    fixed = {"feed_forward": "moe", "norm_placement": "pre", "qk_norm": qk_norm}
    return (*decoder_fields(bias, fixed, feed_forward=(), **defaults), keys.field())


MIXTRAL_NAMES = dataclasses.replace(NAMES, feed_forward="mixtral")
"""Mixtral's naming: the Llama-style one with the MoE part's ``mixtral`` names
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1`` ...)."""

_MIXTRAL_KEYS = MoEKeys("num_local_experts", "intermediate_size", None)
_QWEN3_MOE_KEYS = MoEKeys("num_experts", "moe_intermediate_size", "norm_topk_prob")
_OLMOE_KEYS = MoEKeys("num_experts", "intermediate_size", "norm_topk_prob")

MIXTRAL = llama_family(
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    title="Mixtral",
    fields=_sparse_fields(NO_BIAS, None, _MIXTRAL_KEYS, rms_norm_eps=1e-5, rope_theta=1e6),
    head_dim=True,
    window=MISTRAL_WINDOW,
    options=(Option.constant("router_jitter_noise", 0.0),),
    extra=_MIXTRAL_KEYS.written,
    architecture="mistral",
    names=MIXTRAL_NAMES,
)

QWEN3_MOE = llama_family(
    model_type="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    title="Qwen3-MoE",
    fields=_sparse_fields(ATTENTION_BIAS, "head", _QWEN3_MOE_KEYS),
    head_dim=True,
    window=QWEN_WINDOW,
    options=(Option.constant("decoder_sparse_step", 1), Option.constant("mlp_only_layers", [])),
    extra=_QWEN3_MOE_KEYS.written,
    architecture="qwen3",
)

OLMOE = llama_family(
    model_type="olmoe",
    hf_class="OlmoeForCausalLM",
    title="OLMoE",
    fields=_sparse_fields(ATTENTION_BIAS, "projection", _OLMOE_KEYS, rms_norm_eps=1e-5),
    head_dim=False,
    options=(Option.constant("clip_qkv", None),),
    extra=_OLMOE_KEYS.written,
    architecture="llama",
)

MOE_TYPES = (MIXTRAL, QWEN3_MOE, OLMOE)
"""The mixture-of-experts model types, in the order export tries them."""
