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
from collections.abc import Callable, Mapping
from typing import Any

from lightning_sp.interop.hf_config import ConfigField, ConfigTable, Option
from lightning_sp.interop.hf_llama import (
    ATTENTION_BIAS,
    HEAD_DIM,
    HEAD_DIM_FIELD,
    NAMES,
    NO_BIAS,
    NO_HEAD_DIM,
    check_window,
    decoder_fields,
    dropout_keys,
)
from lightning_sp.interop.hf_tables import HFModelType
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.moe.config import MoEConfig


def _moe_field(width: str, normalize: Callable[[Mapping[str, Any]], bool]) -> ConfigField:
    """Our ``moe`` from ``num_local_experts`` / ``num_experts``, ``num_experts_per_tok`` and
    the expert width key ``width``; compared as the MoE shape (:attr:`MoEConfig.
    architecture`; the training settings, no part of a checkpoint, at their defaults on both
    sides)."""

    def read(hf: Mapping[str, Any]) -> MoEConfig:
        return MoEConfig(
            num_experts=hf.get("num_local_experts") or hf["num_experts"],
            top_k=hf["num_experts_per_tok"],
            expert_ffn_size=hf[width],
            normalize_top_k=normalize(hf),
        )

    def shape(config: GPTConfig) -> MoEConfig | None:
        moe = config.moe
        return None if moe is None else MoEConfig(**dataclasses.asdict(moe.architecture))

    return ConfigField("moe", read=read, value=shape)


def _moe_keys(experts_key: str, width: str, normalize_key: str | None) -> Callable:
    """The ``config.json`` keys of our ``moe`` (and the dropouts)."""

    def extra(config: GPTConfig) -> dict[str, Any]:
        moe = config.moe or MoEConfig()
        keys = {
            **dropout_keys(config),
            experts_key: moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            width: moe.expert_ffn_size,
            "router_aux_loss_coef": moe.aux_loss_coef,
            "output_router_logits": moe.aux_loss_coef > 0,
        }
        if normalize_key is not None:
            keys[normalize_key] = moe.normalize_top_k
        return keys

    return extra


def _sparse_fields(bias: ConfigField, qk_norm: str | None) -> tuple[ConfigField, ...]:
    """The Llama-style fields of an all-sparse family: no dense width (``intermediate_size``
    is the experts' in Mixtral and OLMoE, unused in Qwen3-MoE), the ``moe`` feed-forward,
    norms before the sublayers, ``qk_norm``."""
    fixed = {"feed_forward": "moe", "norm_placement": "pre", "qk_norm": qk_norm}
    return decoder_fields(bias, fixed, feed_forward=())


MIXTRAL_NAMES = dataclasses.replace(NAMES, feed_forward="mixtral")
"""Mixtral's naming: the Llama-style one with the MoE part's ``mixtral`` names
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1`` ...)."""


MIXTRAL = HFModelType(
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    architecture="mistral",
    config=ConfigTable(
        title="Mixtral",
        fields=(
            *_sparse_fields(NO_BIAS, None),
            HEAD_DIM_FIELD,
            _moe_field("intermediate_size", lambda hf: True),
        ),
        options=(HEAD_DIM, Option.constant("router_jitter_noise", 0.0)),
        extra=lambda c: {
            **_moe_keys("num_local_experts", "intermediate_size", None)(c),
            "sliding_window": None,
        },
        checks=(check_window,),
    ),
    names=MIXTRAL_NAMES,
)

QWEN3_MOE = HFModelType(
    model_type="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    architecture="qwen3",
    config=ConfigTable(
        title="Qwen3-MoE",
        fields=(
            *_sparse_fields(ATTENTION_BIAS, "head"),
            HEAD_DIM_FIELD,
            _moe_field("moe_intermediate_size", lambda hf: bool(hf.get("norm_topk_prob"))),
        ),
        options=(
            HEAD_DIM,
            Option.constant("use_sliding_window", False),
            Option.constant("decoder_sparse_step", 1),
            Option.constant("mlp_only_layers", []),
        ),
        extra=lambda c: {
            **_moe_keys("num_experts", "moe_intermediate_size", "norm_topk_prob")(c),
            "sliding_window": None,
        },
        checks=(check_window,),
    ),
    names=NAMES,
)

OLMOE = HFModelType(
    model_type="olmoe",
    hf_class="OlmoeForCausalLM",
    architecture="llama",
    config=ConfigTable(
        title="OLMoE",
        fields=(
            *_sparse_fields(ATTENTION_BIAS, "projection"),
            _moe_field("intermediate_size", lambda hf: bool(hf.get("norm_topk_prob"))),
        ),
        options=(NO_HEAD_DIM, Option.constant("clip_qkv", None)),
        extra=_moe_keys("num_experts", "intermediate_size", "norm_topk_prob"),
    ),
    names=NAMES,
)

MOE_TYPES = (MIXTRAL, QWEN3_MOE, OLMOE)
"""The mixture-of-experts model types, in the order export tries them."""
