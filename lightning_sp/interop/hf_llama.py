"""The Llama-style Hugging Face families, as data: Llama, Mistral, Qwen2, Qwen3 and OLMo 2.

They share one ``config.json`` vocabulary (``hidden_size``, ``num_key_value_heads``,
``rms_norm_eps``, ``rope_parameters`` ...) and one weight naming (:data:`NAMES`:
``model.layers.N.self_attn.q_proj`` ...); each family is the shared table with the keys of its
own parts:

=========  ===========================================================================
llama      biases from ``attention_bias`` (Q, K, V and O) and ``mlp_bias``; ``head_dim``
mistral    no bias keys; ``head_dim``; ``sliding_window`` null or >= seq_length
qwen2      biases on Q, K, V only (fixed); no ``head_dim``; no sliding window
qwen3      ``attention_bias``; ``head_dim``; query/key norms per head (``q_norm [d]``)
olmo2      ``attention_bias``; query/key norms over the projections (``q_norm [a·d]``);
           norms after each sublayer (``post_attention_layernorm``,
           ``post_feedforward_layernorm``), none before
=========  ===========================================================================

The tensors are named by the parts themselves (``HF_NORMS``, ``HF_ATTENTION``, ``HF_MLP`` in
``model/parts/``), from the config's layer: the tensors a model of the config has.

A family is composed of the public conventions here by :func:`llama_family`: the fields every
Llama-style family has (:func:`decoder_fields`), an attention convention (its bias key
:data:`ATTENTION_BIAS`, its ``head_dim`` :data:`HEAD_DIM_FIELD` / :data:`HEAD_DIM` or
:data:`NO_HEAD_DIM`, a sliding window it refuses, :func:`check_window`, in Mistral's or Qwen's
keys, :class:`Window`) and a feed-forward convention (the dense MLP's width
:data:`DENSE_WIDTH`; a mixture of experts brings its own: :mod:`lightning_sp.interop.hf_moe`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf_config import ConfigField, ConfigTable, Option
from lightning_sp.interop.hf_tables import HFModelType
from lightning_sp.model.config import BIAS_PROJECTIONS, GPTConfig
from lightning_sp.model.ops import RopeScaling
from lightning_sp.model.parts.weights import HFNames

# -- config.json ----------------------------------------------------------------------------------


def _rope(hf: Mapping[str, Any], theta: float = 10000.0) -> dict[str, Any]:
    """RoPE's parameters: ``rope_parameters`` (transformers 5) or the older ``rope_theta``
    and ``rope_scaling``; ``theta``: the family's base where the file gives none."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    if "rope_theta" not in rope:
        rope["rope_theta"] = hf.get("rope_theta", theta)
    return rope


_SCALING_FIELDS = tuple(f.name for f in dataclasses.fields(RopeScaling) if f.name != "rope_type")
_ROPE_TYPES = ("default", "llama3", "linear", "dynamic")


def _rope_scaling(hf: Mapping[str, Any]) -> RopeScaling | None:
    """Our :class:`RopeScaling` of ``rope_type`` ``llama3`` (all its keys), ``linear``
    (``factor``) or ``dynamic`` (``factor``; its length is ``max_position_embeddings``, which
    transformers' dynamic NTK reads, not an ``original_max_position_embeddings``)."""
    rope = _rope(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in _ROPE_TYPES:
        raise ConfigError(
            f"rope_type={kind!r} (rope scaling) is not computed by this GPT; valid: "
            + ", ".join(repr(k) for k in _ROPE_TYPES)
        )
    if kind == "llama3":
        return RopeScaling(**{k: rope[k] for k in _SCALING_FIELDS if k in rope})
    if kind == "linear":
        return RopeScaling(factor=rope["factor"], rope_type="linear")
    length = hf["max_position_embeddings"]  # transformers' length for dynamic, whatever else
    return RopeScaling(
        factor=rope["factor"], original_max_position_embeddings=length, rope_type="dynamic"
    )


def _write_rope_scaling(config: GPTConfig) -> dict[str, Any] | None:
    scaling = config.rope_scaling
    if scaling is None:
        return None
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    if scaling.rope_type == "dynamic":  # its length is max_position_embeddings (_positions)
        return {"rope_type": "dynamic", "factor": scaling.factor}
    fields = {k: v for k, v in dataclasses.asdict(scaling).items() if k != "rope_type"}
    return {"rope_type": "llama3", **fields}


def _positions(config: GPTConfig) -> int:
    """The positions the model's table must hold, ``max_position_embeddings``: ``seq_length``,
    or under ``dynamic`` RoPE scaling its length (the base rescales beyond it: any
    ``seq_length``, and the length is what ``max_position_embeddings`` says to transformers)."""
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "dynamic":
        return scaling.original_max_position_embeddings
    return config.seq_length


def _bias(projections: list[str]) -> bool | list[str]:
    """Projections with a bias in :meth:`GPTConfig.bias_value`'s one spelling."""
    chosen = [p for p in BIAS_PROJECTIONS if p in projections]
    return True if len(chosen) == len(BIAS_PROJECTIONS) else (chosen or False)


def _read_bias(hf: Mapping[str, Any]) -> bool | list[str]:
    """``attention_bias`` (Q, K, V and O) and ``mlp_bias`` (the MLP's three) as our ``bias``."""
    chosen = ["qkv", "proj"] if hf.get("attention_bias") else []
    return _bias(chosen + (["fc1", "fc2"] if hf.get("mlp_bias") else []))


def _read_head_dim(hf: Mapping[str, Any]) -> int | None:
    """``head_dim`` as our ``kv_channels``: None when it is h/a."""
    d = hf.get("head_dim")
    return None if d in (None, hf["hidden_size"] // hf["num_attention_heads"]) else d


HEAD_DIM_FIELD = ConfigField("kv_channels", "head_dim", read=_read_head_dim, checked=False)
"""``head_dim`` read into ``kv_channels`` (checked by :data:`HEAD_DIM`)."""
HEAD_DIM = Option("head_dim", lambda hf: hf.get("head_dim"), ours=lambda c: c.head_dim)
"""``head_dim`` against ours (``kv_channels`` or h/a), written as ours."""
NO_HEAD_DIM = Option("head_dim", lambda hf: hf["hidden_size"] // hf["num_attention_heads"])
"""A family with no ``head_dim`` of its own: h/a only."""


def check_window(hf: Mapping[str, Any], config: GPTConfig, where: str) -> None:
    """A sliding window this GPT computes: none, or one at least as long as the sequence (the
    whole causal attention); Qwen's ``use_sliding_window`` must be off (a
    :attr:`~lightning_sp.interop.hf_config.ConfigTable.checks` entry)."""
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window", True) and window is not None and window < config.seq_length:
        raise ConfigError(
            f"{where} sets sliding_window={window}, shorter than seq_length="
            f"{config.seq_length}; this GPT computes full causal attention only (sliding "
            "windows are not supported): use a seq_length <= the window"
        )


@dataclasses.dataclass(frozen=True)
class Window:
    """A family's sliding-window convention: a ``sliding_window`` key, refused when shorter
    than the sequence (:func:`check_window`) and written null, and the ``options`` that go
    with it."""

    options: tuple[Option, ...] = ()


MISTRAL_WINDOW = Window()
"""Mistral's (and Mixtral's): the ``sliding_window`` key alone."""
QWEN_WINDOW = Window((Option.constant("use_sliding_window", False),))
"""Qwen's: ``sliding_window`` and ``use_sliding_window``, which must be off."""


DENSE_WIDTH = ConfigField("ffn_hidden_size", "intermediate_size", value=lambda c: c.ffn_size)
"""The dense feed-forward's convention: its width f is ``intermediate_size``."""


def decoder_fields(
    bias: ConfigField,
    fixed: Mapping[str, Any],
    feed_forward: tuple[ConfigField, ...] = (DENSE_WIDTH,),
    *,
    rms_norm_eps: float = 1e-6,
    rope_theta: float = 10000.0,
) -> tuple[ConfigField, ...]:
    """The fields every Llama-style family has (sizes, norms, positions, tied embeddings),
    with the family's bias field ``bias``, the values it fixes ``fixed`` (a dense
    feed-forward unless ``fixed`` says otherwise) and its feed-forward convention's fields
    ``feed_forward`` in the width's place (default :data:`DENSE_WIDTH`; a mixture of experts
    passes none here and adds its own). ``rms_norm_eps`` and ``rope_theta``: the values the
    family's transformers config takes where ``config.json`` has no such key (OLMo 2's
    epsilon is 1e-5, Mixtral's base 1e6)."""
    fixed = {"feed_forward": "dense", **fixed}
    return (
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
        *feed_forward,
        ConfigField("seq_length", "max_position_embeddings", value=_positions, at_most=True),
        ConfigField("layernorm_eps", "rms_norm_eps", default=rms_norm_eps),
        ConfigField("activation", "hidden_act", choices={"silu": "swiglu"}),
        ConfigField("normalization", default="rmsnorm"),
        ConfigField("position_embedding", default="rope"),
        ConfigField(
            "rope_theta", "rope_theta", read=lambda hf: _rope(hf, rope_theta)["rope_theta"]
        ),
        ConfigField("rope_scaling", "rope_scaling", read=_rope_scaling, write=_write_rope_scaling),
        bias,
        ConfigField("tie_embeddings", "tie_word_embeddings", default=False),
        *(ConfigField(ours, default=value) for ours, value in fixed.items()),
    )


ATTENTION_BIAS = ConfigField(
    "bias", "attention_bias", read=_read_bias, value=lambda c: c.bias_value(),
    write=lambda c: c.has_bias("qkv"),
)  # fmt: skip
"""The ``attention_bias`` convention: Q, K, V and O biased together (and ``mlp_bias`` read
into the same ``bias``); written from ours."""
_MLP_BIAS = ConfigField("bias", "mlp_bias", write=lambda c: c.has_bias("fc1"), written_only=True)
_PRE = {"qk_norm": None, "norm_placement": "pre"}


NO_BIAS = ConfigField("bias", default=False, value=lambda c: c.bias_value())
"""The convention of a family with no bias keys (Mistral's, Mixtral's): no biases."""


def dropout_keys(config: GPTConfig) -> dict[str, Any]:
    """The keys a Llama-style ``config.json`` writes only: the attention's dropout."""
    return {"attention_dropout": config.attention_dropout}


# -- weights ------------------------------------------------------------------------------------

NAMES = HFNames(
    layer="model.layers.{i}",
    norm="llama",
    attention="llama",
    feed_forward="llama",
    embedding="model.embed_tokens",
    final_norm="model.norm",
)
"""The Llama-style naming (``model.layers.N.self_attn.q_proj`` ...): each part names its own
tensors in the ``llama`` convention (OLMo 2's post-norms and the query/key norms included)."""


# -- the families ---------------------------------------------------------------------------------


def llama_family(
    *,
    model_type: str,
    hf_class: str,
    title: str,
    fields: tuple[ConfigField, ...],
    head_dim: bool,
    window: Window | None = None,
    options: tuple[Option, ...] = (),
    extra: Callable[[GPTConfig], dict[str, Any]] = dropout_keys,
    architecture: str | None = None,
    names: HFNames = NAMES,
) -> HFModelType:
    """A Llama-style family composed of the conventions above: its ``fields``
    (:func:`decoder_fields` and its own); its ``head_dim`` convention (a key of its own read
    into ``kv_channels``, :data:`HEAD_DIM_FIELD` and :data:`HEAD_DIM`; else h/a only,
    :data:`NO_HEAD_DIM`); its sliding-window convention ``window`` (:data:`MISTRAL_WINDOW`,
    :data:`QWEN_WINDOW`; None: no window key); its further ``options``; the keys it only
    writes, ``extra`` (default: the attention's dropout); the architecture it reads into
    (default: ``model_type``) and its naming scheme ``names``."""

    def written(config: GPTConfig) -> dict[str, Any]:
        keys = extra(config)
        return keys if window is None else {**keys, "sliding_window": None}

    return HFModelType(
        model_type=model_type,
        hf_class=hf_class,
        architecture=architecture or model_type,
        config=ConfigTable(
            title=title,
            fields=(*fields, HEAD_DIM_FIELD) if head_dim else fields,
            options=(
                HEAD_DIM if head_dim else NO_HEAD_DIM,
                *(() if window is None else window.options),
                *options,
            ),
            extra=written,
            checks=() if window is None else (check_window,),
        ),
        names=names,
    )


LLAMA = llama_family(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    title="Llama",
    fields=(*decoder_fields(ATTENTION_BIAS, _PRE), _MLP_BIAS),
    head_dim=True,
    options=(Option.constant("pretraining_tp", 1),),
)

MISTRAL = llama_family(
    model_type="mistral",
    hf_class="MistralForCausalLM",
    title="Mistral",
    fields=decoder_fields(NO_BIAS, _PRE),
    head_dim=True,
    window=MISTRAL_WINDOW,
)

QWEN2 = llama_family(
    model_type="qwen2",
    hf_class="Qwen2ForCausalLM",
    title="Qwen2",
    fields=decoder_fields(
        ConfigField("bias", default=["qkv"], value=lambda c: c.bias_value()), _PRE
    ),
    head_dim=False,
    window=QWEN_WINDOW,
)

QWEN3 = llama_family(
    model_type="qwen3",
    hf_class="Qwen3ForCausalLM",
    title="Qwen3",
    fields=decoder_fields(ATTENTION_BIAS, {"qk_norm": "head", "norm_placement": "pre"}),
    head_dim=True,
    window=QWEN_WINDOW,
)

OLMO2 = llama_family(
    model_type="olmo2",
    hf_class="Olmo2ForCausalLM",
    title="OLMo 2",
    fields=decoder_fields(
        ATTENTION_BIAS, {"qk_norm": "projection", "norm_placement": "post"}, rms_norm_eps=1e-5
    ),
    head_dim=False,
)

LLAMA_STYLE = (LLAMA, MISTRAL, QWEN2, QWEN3, OLMO2)
"""The Llama-style model types, in the order export tries them."""
