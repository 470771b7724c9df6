"""The Hugging Face model types we read and write, as data: per ``model_type`` its
``config.json`` table (:class:`~lightning_sp.interop.hf_config.ConfigTable`) and its weight
table (:class:`WeightMap` rows: our parameter name -> the Hugging Face tensor).

Which of our parameters exist is the model's business (its descriptors: a norm with or
without bias, ``fc1`` or ``gate`` + ``up``, learned positions or RoPE, tied or untied output);
a weight table only names, for each parameter a model of that family can have, the tensor that
holds it. Several of our parameters may share one tensor (GPT-2's ``c_attn`` holds query, key
and value): they are concatenated along our dim 0 in table order.

A new Hugging Face family made of parts we have is one :class:`HFModelType` entry in
:data:`HF_MODEL_TYPES`; nothing else asks which family it is looking at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf_config import ConfigField, ConfigTable, Option, fits, write_config
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.moe_config import MoEConfig
from lightning_sp.model.ops import RopeScaling


@dataclass(frozen=True)
class WeightMap:
    """One of our parameters (``ours``, a global name with ``{i}`` for the layer) and the
    Hugging Face tensor that holds it (``hf``, the name ``save_pretrained`` writes);
    ``transpose``: stored ``[in, out]`` (GPT-2's ``Conv1D``) where ours is ``[out, in]``."""

    ours: str
    hf: str
    transpose: bool = False


@dataclass(frozen=True)
class ExpertWeightMap:
    """Our stacked expert weight ``ours`` (``[E, n, k]``, a global name with ``{i}``) and the
    Hub's per-expert tensors holding it: expert ``e``'s ``[n, k]`` slice is the concatenation
    along its dim 0 of ``hf`` (names with ``{i}`` and ``{e}``), equal parts (Mixtral's
    ``gate_up``: ``w1`` then ``w3``)."""

    ours: str
    hf: tuple[str, ...]


def linear(ours: str, hf: str, transpose: bool = False) -> tuple[WeightMap, ...]:
    """The weight and bias rows of a linear layer (modules ``ours`` and ``hf``)."""
    weight = WeightMap(f"{ours}.weight", f"{hf}.weight", transpose)
    return weight, WeightMap(f"{ours}.bias", f"{hf}.bias")


def norm(ours: str, hf: str) -> tuple[WeightMap, ...]:
    """The weight and (LayerNorm) bias rows of a norm."""
    return linear(ours, hf)


@dataclass(frozen=True)
class HFModelType:
    """A Hugging Face model family: ``model_type``, its ``*ForCausalLM`` class, our
    architecture family it reads into (``GPTConfig.of``: dropouts and the rest), the
    ``config.json`` table and the weight table. ``optional_prefix``: a prefix that files
    written elsewhere may lack (OpenAI's GPT-2 upload has no ``transformer.``)."""

    model_type: str
    hf_class: str
    architecture: str
    config: ConfigTable
    weights: tuple[WeightMap | ExpertWeightMap, ...]
    optional_prefix: str = ""

    @property
    def title(self) -> str:
        return self.config.title

    def config_json(self, config: GPTConfig, eos_token_id: int | None = None) -> dict[str, Any]:
        """The ``config.json`` of the model equal to ``config``: class, ``model_type``, token
        ids (the end-of-document token also begins documents), then the table's keys."""
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "initializer_range": config.init_std,
            "bos_token_id": eos_token_id,
            "eos_token_id": eos_token_id,
            **write_config(self.config, config),
        }


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
            ConfigField("bias", default=True),
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
    weights=(
        WeightMap("word_embeddings.weight", "transformer.wte.weight"),
        WeightMap("position_embeddings", "transformer.wpe.weight"),
        *norm("final_norm", "transformer.ln_f"),
        *norm("layers.{i}.ln1", "transformer.h.{i}.ln_1"),
        *linear("layers.{i}.attention.query", "transformer.h.{i}.attn.c_attn", True),
        *linear("layers.{i}.attention.key", "transformer.h.{i}.attn.c_attn", True),
        *linear("layers.{i}.attention.value", "transformer.h.{i}.attn.c_attn", True),
        *linear("layers.{i}.attention.proj", "transformer.h.{i}.attn.c_proj", True),
        *norm("layers.{i}.ln2", "transformer.h.{i}.ln_2"),
        *linear("layers.{i}.mlp.fc1", "transformer.h.{i}.mlp.c_fc", True),
        *linear("layers.{i}.mlp.fc2", "transformer.h.{i}.mlp.c_proj", True),
    ),
    optional_prefix="transformer.",
)


# -- Llama ------------------------------------------------------------------------------------


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE's parameters: ``rope_parameters`` (transformers 5) or the older ``rope_theta``
    and ``rope_scaling``."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    if "rope_theta" not in rope:
        rope["rope_theta"] = hf.get("rope_theta", 10000.0)
    return rope


_SCALING_FIELDS = tuple(f.name for f in dataclasses.fields(RopeScaling))


def _rope_scaling(hf: Mapping[str, Any]) -> RopeScaling | None:
    rope = _rope(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(
            f"rope_type={kind!r} (rope scaling) is not computed by this GPT; valid: "
            "'default', 'llama3'"
        )
    return RopeScaling(**{k: rope[k] for k in _SCALING_FIELDS if k in rope})


def _write_rope_scaling(config: GPTConfig) -> dict[str, Any] | None:
    if config.rope_scaling is None:
        return None
    return {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}


LLAMA = HFModelType(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    architecture="llama",
    config=ConfigTable(
        title="Llama",
        fields=(
            ConfigField("vocab_size", "vocab_size"),
            ConfigField("hidden_size", "hidden_size"),
            ConfigField("num_layers", "num_hidden_layers"),
            ConfigField("num_heads", "num_attention_heads"),
            ConfigField(
                "num_query_groups",
                "num_key_value_heads",
                value=lambda c: c.groups,
                read=lambda hf: hf.get("num_key_value_heads") or hf.get("num_attention_heads"),
            ),
            ConfigField("ffn_hidden_size", "intermediate_size", value=lambda c: c.ffn_size),
            ConfigField("seq_length", "max_position_embeddings", at_most=True),
            ConfigField("layernorm_eps", "rms_norm_eps", default=1e-6),
            ConfigField("activation", "hidden_act", choices={"silu": "swiglu"}),
            ConfigField("normalization", default="rmsnorm"),
            ConfigField("position_embedding", default="rope"),
            ConfigField("rope_theta", "rope_theta", read=lambda hf: _rope(hf)["rope_theta"]),
            ConfigField(
                "rope_scaling", "rope_scaling", read=_rope_scaling, write=_write_rope_scaling
            ),
            ConfigField("bias", "attention_bias", default=False),
            ConfigField("bias", "mlp_bias", default=False),
            ConfigField("tie_embeddings", "tie_word_embeddings", default=False),
            ConfigField("feed_forward", default="dense"),
        ),
        options=(
            Option("head_dim", lambda hf: hf["hidden_size"] // hf["num_attention_heads"]),
            Option.constant("pretraining_tp", 1),
        ),
        extra=lambda config: {"attention_dropout": config.attention_dropout},
    ),
    weights=(
        WeightMap("word_embeddings.weight", "model.embed_tokens.weight"),
        WeightMap("output.weight", "lm_head.weight"),
        *norm("final_norm", "model.norm"),
        *norm("layers.{i}.ln1", "model.layers.{i}.input_layernorm"),
        *linear("layers.{i}.attention.query", "model.layers.{i}.self_attn.q_proj"),
        *linear("layers.{i}.attention.key", "model.layers.{i}.self_attn.k_proj"),
        *linear("layers.{i}.attention.value", "model.layers.{i}.self_attn.v_proj"),
        *linear("layers.{i}.attention.proj", "model.layers.{i}.self_attn.o_proj"),
        *norm("layers.{i}.ln2", "model.layers.{i}.post_attention_layernorm"),
        *linear("layers.{i}.mlp.gate", "model.layers.{i}.mlp.gate_proj"),
        *linear("layers.{i}.mlp.up", "model.layers.{i}.mlp.up_proj"),
        *linear("layers.{i}.mlp.fc2", "model.layers.{i}.mlp.down_proj"),
    ),
)


# -- Mixtral ----------------------------------------------------------------------------------


def _moe_structure(moe: MoEConfig | None) -> MoEConfig | None:
    """What of an MoE config a checkpoint fixes (experts, top-k, width, scores, shared experts,
    the choice bias); the training-only settings (loss coefficients, capacity, router dtype)
    back at their defaults."""
    if moe is None:
        return None
    return dataclasses.replace(
        moe, aux_loss_coef=0.0, z_loss_coef=0.0, capacity_factor=None,
        bias_update_rate=MoEConfig.bias_update_rate, router_dtype="fp32",
    )  # fmt: skip


def _mixtral_moe(hf: Mapping[str, Any]) -> MoEConfig:
    return MoEConfig(
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_ffn_size=hf["intermediate_size"],
    )


def _mixtral_extra(config: GPTConfig) -> dict[str, Any]:
    moe = config.moe or MoEConfig()
    return {
        "attention_dropout": config.attention_dropout,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "intermediate_size": moe.expert_ffn_size,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": moe.aux_loss_coef > 0,
    }


_LLAMA_FIELDS = tuple(
    f for f in LLAMA.config.fields if f.ours not in ("ffn_hidden_size", "feed_forward")
)

_EXPERT = "model.layers.{i}.block_sparse_moe.experts.{e}"

MIXTRAL = HFModelType(
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    architecture="llama",
    config=ConfigTable(
        title="Mixtral",
        fields=(
            *_LLAMA_FIELDS,
            ConfigField("feed_forward", default="moe"),
            ConfigField("moe", read=_mixtral_moe, value=lambda c: _moe_structure(c.moe)),
        ),
        options=(
            Option("head_dim", lambda hf: hf["hidden_size"] // hf["num_attention_heads"]),
            Option.constant("sliding_window", None),
            Option.constant("router_jitter_noise", 0.0),
        ),
        extra=_mixtral_extra,
    ),
    weights=(
        *(w for w in LLAMA.weights if ".mlp." not in w.ours),
        WeightMap("layers.{i}.mlp.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight"),
        ExpertWeightMap(
            "layers.{i}.mlp.experts.gate_up", (f"{_EXPERT}.w1.weight", f"{_EXPERT}.w3.weight")
        ),
        ExpertWeightMap("layers.{i}.mlp.experts.down", (f"{_EXPERT}.w2.weight",)),
    ),
)


HF_MODEL_TYPES: dict[str, HFModelType] = {m.model_type: m for m in (GPT2, LLAMA, MIXTRAL)}
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
    """The Hugging Face model type that holds ``config`` exactly (the first that fits);
    :class:`ConfigError` naming each type's first mismatch if none does."""
    reasons = []
    for model_type in HF_MODEL_TYPES.values():
        reason = fits(model_type.config, config)
        if reason is None:
            return model_type
        reasons.append(f"{model_type.model_type}: {reason}")
    raise ConfigError("no Hugging Face model type holds this config (" + "; ".join(reasons) + ")")
