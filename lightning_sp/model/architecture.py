"""``Architecture``: what a model's weights mean (sizes, norms, positions, activation,
biases, tied embeddings, the mixture-of-experts shape). A checkpoint, an exported model, a
Hugging Face directory read by ``init_from`` and the resume check compare it whole
(:attr:`lightning_sp.model.config.GPTConfig.architecture`); how a run computes is
:class:`~lightning_sp.model.run_settings.RunSettings`, which may change between runs."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from lightning_sp.errors import finite_number
from lightning_sp.model.config_checks import BIAS_PROJECTIONS
from lightning_sp.model.moe.config import MoEArchitecture
from lightning_sp.model.ops import RopeScaling

Activation = Literal["gelu", "gelu_tanh", "swiglu"]
Normalization = Literal["layernorm", "rmsnorm"]
PositionEmbedding = Literal["learned", "rope"]


@dataclass
class Architecture:
    """The fields of a :class:`~lightning_sp.model.config.GPTConfig` that fix what trained
    weights mean: two configs whose architectures are equal hold the same weights."""

    vocab_size: int = 50257
    """Vocabulary size of the tokenizer (v). The embedding is padded to a multiple of
    ``make_vocab_size_divisible_by * tensor_parallel_size``; padded entries never receive
    probability."""

    hidden_size: int = 768
    """Hidden size (h)."""

    num_layers: int = 12
    """Number of transformer layers (L)."""

    num_heads: int = 12
    """Number of attention heads (a); must divide hidden_size and be divisible by the
    tensor-parallel size."""

    num_query_groups: int | None = None
    """Key/value heads (g): ``None`` or num_heads is multi-head attention, fewer is
    grouped-query attention (GQA; 1 is multi-query). Must divide num_heads. Under tensor
    parallelism either t divides g (each rank holds g/t groups) or g divides t (each rank
    holds the one group its query heads use, replicated over the t/g ranks that share it,
    its gradient summed over them)."""

    ffn_hidden_size: int | None = None
    """Width of the MLP's inner layer (f); default 4 * hidden_size."""

    kv_channels: int | None = None
    """Head dimension (d, Hugging Face's ``head_dim``, Megatron's ``kv_channels``); None:
    hidden_size / num_heads. Qwen3 and Mistral Nemo use one that is not h/a: the query
    projection is then ``h -> a·d`` and the output projection ``a·d -> h``."""

    qk_norm: str | None = None
    """RMSNorm on queries and keys before RoPE: ``head`` (over each head's d features, weights
    ``[d]``: Qwen3), ``projection`` (over the whole query and key projections, weights
    ``[a·d]`` and ``[g·d]``, statistics all-reduced over TP: OLMo 2) or None."""

    norm_placement: str = "pre"
    """Where each sublayer's norm sits: ``pre`` (``x + f(norm(x))``: GPT-2, Llama) or ``post``
    (``x + norm(f(x))``: OLMo 2, whose norms are ``post_attention_layernorm`` and
    ``post_feedforward_layernorm``)."""

    feed_forward: str = "dense"
    """The layer's feed-forward part, by name in
    :data:`lightning_sp.model.parts.block.FEED_FORWARDS` (``dense``: the MLP; ``moe``: a
    mixture of SwiGLU experts, configured by ``moe``)."""

    moe: MoEArchitecture | None = None
    """The mixture-of-experts part's shape with ``feed_forward: moe`` (experts, top-k, router
    scores, shared experts, the choice bias); unused otherwise."""

    normalization: Normalization = "layernorm"
    """``layernorm`` (weight and bias) or ``rmsnorm`` (weight only, statistics in fp32)."""

    position_embedding: PositionEmbedding = "learned"
    """``learned``: a table of seq_length x hidden_size added to the token embedding;
    ``rope``: rotary embeddings applied to queries and keys (no parameters)."""

    rope_theta: float = 10000.0
    """RoPE base (Llama 3: 500000). Used with position_embedding=rope."""

    rope_scaling: RopeScaling | None = None
    """Llama 3.1's RoPE frequency scaling (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); None: unscaled."""

    bias: bool | list[str] = True
    """Biases on the linear layers: True on every one (GPT-2), False on none (Llama), or a
    list of the projections that have them, from :data:`BIAS_PROJECTIONS` (``qkv``: query,
    key and value; ``proj``: attention output; ``fc1``: the MLP's input projections; ``fc2``:
    its output): ``[qkv]`` is Qwen2's."""

    tie_embeddings: bool = True
    """The output layer uses the input embedding's weight (GPT-2); False gives it its own
    (Llama). Under pipeline parallelism only a tied model keeps a copy on the last stage."""

    activation: Activation = "gelu"
    """The MLP's activation: ``gelu`` is exact (erf); ``gelu_tanh`` is the tanh approximation
    that OpenAI's GPT-2 weights were trained with (Hugging Face's ``gelu_new``); ``swiglu`` is
    ``silu(gate(x)) * up(x)`` (Llama), two input projections of width f."""

    layernorm_eps: float = 1e-5
    """Epsilon of every norm (LayerNorm or RMSNorm)."""

    def __post_init__(self) -> None:
        finite_number(
            "rope_theta", self.rope_theta, "a positive number (Llama 3: 500000)", lambda v: v > 0
        )
        finite_number("layernorm_eps", self.layernorm_eps, "a finite number > 0", lambda v: v > 0)

    def has_bias(self, projection: str) -> bool:
        """Whether the projection ``projection`` (one of :data:`BIAS_PROJECTIONS`) has a
        bias."""
        if isinstance(self.bias, bool):
            return self.bias
        return projection in self.bias

    def bias_value(self) -> bool | list[str]:
        """``bias`` in one spelling: True (every projection), False (none), or the list of
        those that have one, in :data:`BIAS_PROJECTIONS` order."""
        chosen = [p for p in BIAS_PROJECTIONS if self.has_bias(p)]
        return True if len(chosen) == len(BIAS_PROJECTIONS) else (chosen or False)

    @property
    def ffn_size(self) -> int:
        """The MLP width f: ``ffn_hidden_size`` or 4h."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def groups(self) -> int:
        """Key/value groups g (``num_query_groups``; None: ``num_heads``)."""
        return self.num_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def head_dim(self) -> int:
        """The head dimension d: ``kv_channels`` or ``hidden_size / num_heads``."""
        return self.kv_channels or self.hidden_size // self.num_heads

    def canonical(self) -> "Architecture":
        """This architecture written one way, so that two describe the same weights exactly
        when they are equal: ``num_query_groups`` None for multi-head attention,
        ``ffn_hidden_size`` None for 4h, ``bias`` as :meth:`bias_value`, ``moe`` its shape
        (:class:`MoEArchitecture`) and only with ``feed_forward: moe``."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(Architecture)}
        moe = self.moe if self.feed_forward == "moe" else None
        values.update(
            num_query_groups=None if self.groups == self.num_heads else self.groups,
            ffn_hidden_size=None if self.ffn_size == 4 * self.hidden_size else self.ffn_size,
            bias=self.bias_value(),
            moe=moe if moe is None or type(moe) is MoEArchitecture else _moe_shape(moe),
        )
        return Architecture(**values)

    def differences(self, other: "Architecture") -> list[tuple[str, Any, Any]]:
        """``(field, this value, other's value)`` for every field where the two differ, in
        field order; an MoE field by its dotted name (``moe.top_k``). Values as a config file
        writes them (a record as a mapping)."""
        found = []
        for f in dataclasses.fields(Architecture):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine == theirs:
                continue
            if isinstance(mine, MoEArchitecture) and isinstance(theirs, MoEArchitecture):
                found += [
                    (f"moe.{g.name}", getattr(mine, g.name), getattr(theirs, g.name))
                    for g in dataclasses.fields(MoEArchitecture)
                    if getattr(mine, g.name) != getattr(theirs, g.name)
                ]
            else:
                found.append((f.name, _plain(mine), _plain(theirs)))
        return found


def _moe_shape(moe: MoEArchitecture) -> MoEArchitecture:
    """The :class:`MoEArchitecture` fields of ``moe`` (an ``MoEConfig``) as their own record."""
    return MoEArchitecture(
        **{f.name: getattr(moe, f.name) for f in dataclasses.fields(MoEArchitecture)}
    )


def _plain(value: Any) -> Any:
    """A record as the mapping a config file writes; any other value as it is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
