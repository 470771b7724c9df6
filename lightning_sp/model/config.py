"""The model configuration: one dataclass, one docstring per field. The architecture is data:
the norm, the positions, the MLP activation, the key/value groups, biases and tied embeddings
are fields naming descriptors of :mod:`lightning_sp.model.spec`; ``ARCHITECTURES`` holds the
field values of each family (``GPTConfig.llama(...)`` builds one)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_sp.errors import ConfigError, divisors
from lightning_sp.model.config_checks import BIAS_PROJECTIONS, check_config
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.ops import RopeScaling
from lightning_sp.model.parts.block import Block, block_of
from lightning_sp.model.recompute import (
    POLICIES,
    RecomputePolicy,
    parse_rest,
)
from lightning_sp.model.shape import ActivationShape

RECOMPUTE_POLICIES = POLICIES
"""The named policies: the presets ``none``, ``selective``, ``lean`` and ``full``."""
Activation = Literal["gelu", "gelu_tanh", "swiglu"]
Normalization = Literal["layernorm", "rmsnorm"]
PositionEmbedding = Literal["learned", "rope"]


@dataclass
class GPTConfig:
    """A decoder-only transformer. The defaults are a GPT-3 style decoder (paper §3): learned
    positions, pre-LayerNorm, GeLU MLP with biases, multi-head attention, tied input/output
    embeddings, dropout after the embedding, on attention probabilities and on both residual
    branches. The Llama family (``ARCHITECTURES["llama"]``) is RMSNorm, RoPE, SwiGLU,
    grouped-query attention, no biases, untied embeddings, no dropout."""

    vocab_size: int = 50257
    """Vocabulary size of the tokenizer (v). The embedding is padded to a multiple of
    ``make_vocab_size_divisible_by * tensor_parallel_size``; padded entries never receive
    probability."""

    seq_length: int = 2048
    """Sequence length (s): tokens per sample, and the number of learned positions."""

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

    moe: MoEConfig | None = None
    """The mixture-of-experts settings with ``feed_forward: moe`` (experts, top-k, router,
    load balancing, capacity); unused otherwise."""

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

    hidden_dropout: float = 0.1
    """Dropout probability after the embedding and on both residual branches."""

    attention_dropout: float = 0.1
    """Dropout probability on the attention probabilities."""

    sequence_parallel: bool = False
    """Shard LayerNorm, dropout and residual activations along the sequence over the
    tensor-parallel group (paper §4.2.2). Needs seq_length divisible by the TP size."""

    recompute: str | list[str] = "selective"
    """Activation recomputation: a preset or a list of recompute modules. Presets: ``none``
    stores everything; ``selective`` (= [core_attn]) recomputes only the attention core (QKᵀ,
    softmax, its dropout, attention over V) in backward (paper §5); ``lean`` = all four modules
    (20sbh/t per layer with TP+SP instead of 34); ``full`` keeps only each layer's input and
    recomputes the whole layer; ``auto`` picks the least recomputation that fits the device
    memory (resolved by the memory planner when the model is configured). Modules:
    ``core_attn``; ``layernorm`` (both LayerNorms, inside their consumer's backward);
    ``mlp_act`` (the GeLU, inside fc2's backward); ``residual_mask`` (the residual-dropout
    masks, regenerated from the RNG stream instead of stored)."""

    recompute_num_layers: int | None = None
    """With recompute=full, fully recompute only the first N layers of each model chunk; the
    others run ``recompute_rest``. None: every layer."""

    recompute_rest: str | list[str] = "selective"
    """With recompute=full and recompute_num_layers set: what the other layers of each model
    chunk run, a preset or a list of recompute modules as in ``recompute`` but not ``full`` or
    ``auto``. ``none`` stores everything there (Megatron's block method, fastest);
    ``selective`` (the default) recomputes the attention core; ``lean`` stores least (20sbh/t
    per layer with TP+SP), so the fewest layers need full recomputation. Ignored otherwise."""

    attention: str = "math"
    """Attention backend, ``math`` or ``sdpa``: ``math`` is the paper's (QKᵀ, softmax,
    dropout, ·V as separate ops storing ``s x s`` tensors: what Table 2 counts); ``sdpa`` calls
    ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels),
    which stores no ``s x s`` tensor, so ``core_attn`` recomputation has nothing to drop. On
    CPU, SDPA with attention dropout falls back to a math kernel that does store them."""

    activation: Activation = "gelu"
    """The MLP's activation: ``gelu`` is exact (erf); ``gelu_tanh`` is the tanh approximation
    that OpenAI's GPT-2 weights were trained with (Hugging Face's ``gelu_new``); ``swiglu`` is
    ``silu(gate(x)) * up(x)`` (Llama), two input projections of width f."""

    layernorm_eps: float = 1e-5
    """Epsilon of every norm (LayerNorm or RMSNorm)."""

    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation; the two output projections of
    each layer use init_std / sqrt(2 * num_layers)."""

    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times the tensor-parallel size."""

    hf_model_type: str | None = field(default=None, compare=False)
    """The Hugging Face ``model_type`` export writes (``llama``, ``mistral``, ``qwen2``,
    ``qwen3``, ``olmo2``, ``gpt2``); None: the first that holds the config (GPT-2, then Llama:
    a Mistral without a window computes as a Llama). Reading a directory sets it. Not part of
    the architecture (not compared)."""

    seed: int = 1234
    """Seed of the weight initialisation and of the dropout streams. A model built from the
    same seed has the same weights under every parallel layout."""

    @classmethod
    def of(cls, architecture: str, **overrides: Any) -> GPTConfig:
        """A config of the family ``architecture`` (:data:`ARCHITECTURES`) with ``overrides``."""
        if architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture={architecture!r} is not known; valid: {', '.join(ARCHITECTURES)}"
            )
        return cls(**{**ARCHITECTURES[architecture], **overrides})

    @classmethod
    def from_values(cls, values: Any) -> GPTConfig:
        """A config from plain values (a YAML mapping, a checkpoint's record, a parsed
        namespace): ``rope_scaling`` and ``moe`` given as mappings become a
        :class:`~lightning_sp.model.ops.RopeScaling` and a
        :class:`~lightning_sp.model.moe.config.MoEConfig`."""
        fields = dict(values) if isinstance(values, dict) else dict(vars(values))
        for name, record in (("rope_scaling", RopeScaling), ("moe", MoEConfig)):
            given = fields.get(name)
            if given is not None and not isinstance(given, record):
                fields[name] = record(**(dict(given) if isinstance(given, dict) else vars(given)))
        return cls(**fields)

    def has_bias(self, projection: str) -> bool:
        """Whether the projection ``projection`` (one of :data:`BIAS_PROJECTIONS`) has a
        bias."""
        if isinstance(self.bias, bool):
            return self.bias
        return projection in self.bias

    def expert_parallel_sizes(self, data_context_ranks: int) -> tuple[int, ...]:
        """The expert-parallel sizes this model can run over ``d·c`` data x context ranks:
        the common divisors of ``d·c`` and the number of experts (``(1,)`` for a dense
        model)."""
        if self.feed_forward != "moe" or self.moe is None:
            return (1,)
        return tuple(divisors(math.gcd(data_context_ranks, self.moe.num_experts)))

    def expert_tensor_parallel_sizes(self, tensor_parallel_size: int) -> tuple[int, ...]:
        """The expert tensor parallel sizes this model can run at ``t``: 1, and ``t`` for a
        mixture of experts at ``t > 1`` whose ``f_e`` it divides."""
        t = tensor_parallel_size
        if self.feed_forward != "moe" or self.moe is None or t == 1 or self.moe.expert_ffn_size % t:
            return (1,)
        return (1, t)

    def for_measurement(self) -> GPTConfig:
        """This config as the memory measurement traces it (under fake tensors, which hold no
        values): a mixture of experts routes force-balanced (``moe.force_balanced``), the
        balanced routing its formulas assume, with no count read from the device."""
        if self.moe is None:
            return self
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, force_balanced=True))

    def bias_value(self) -> bool | list[str]:
        """``bias`` in one spelling: True (every projection), False (none), or the list of
        those that have one, in :data:`BIAS_PROJECTIONS` order."""
        chosen = [p for p in BIAS_PROJECTIONS if self.has_bias(p)]
        return True if len(chosen) == len(BIAS_PROJECTIONS) else (chosen or False)

    def block(self) -> Block:
        """The layer's parts (:func:`lightning_sp.model.parts.block.block_of`)."""
        return block_of(self)

    @property
    def ffn_size(self) -> int:
        """The MLP width f: ``ffn_hidden_size`` or 4h."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def groups(self) -> int:
        """Key/value groups g (``num_query_groups``; None: ``num_heads``)."""
        return self.num_heads if self.num_query_groups is None else self.num_query_groups

    def activation_shape(
        self,
        tensor_parallel_size: int = 1,
        micro_batch_size: int = 1,
        *,
        seq_length: int | None = None,
        activation_bytes: float = 2,
        mask_bytes: float = 1,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        expert_tensor_parallel_size: int = 1,
        documents: bool = False,
    ) -> ActivationShape:
        """The shape of this config's layers at tensor-parallel size ``t``, micro-batch ``b``,
        context-parallel size ``c``, expert-parallel size ``e`` and expert-tensor-parallel size
        (``seq_length`` overrides the config's, for shorter inputs; it is the whole sequence,
        of which a rank holds ``s/c`` under CP); ``documents``: attention masked by packed
        documents (``data.document_mask``)."""
        return ActivationShape(
            s=seq_length or self.seq_length,
            b=micro_batch_size,
            h=self.hidden_size,
            a=self.num_heads,
            t=tensor_parallel_size,
            f=self.ffn_hidden_size or 0,
            sequence_parallel=self.sequence_parallel,
            attention=self.attention,
            activation_bytes=activation_bytes,
            mask_bytes=mask_bytes,
            hidden_dropout=self.hidden_dropout > 0,
            attention_dropout=self.attention_dropout > 0,
            g=0 if self.groups == self.num_heads else self.groups,
            activation=self.activation,
            norm=self.normalization,
            c=context_parallel_size,
            d=self.kv_channels or 0,
            documents=documents,
            e=expert_parallel_size,
            block=self.block(),
            etp=expert_tensor_parallel_size,
        )

    @property
    def output_init_std(self) -> float:
        """Init std of each layer's two output projections: ``init_std / sqrt(2L)``."""
        return self.init_std / math.sqrt(2 * self.num_layers)

    @property
    def head_dim(self) -> int:
        """The head dimension d: ``kv_channels`` or ``hidden_size / num_heads``."""
        return self.kv_channels or self.hidden_size // self.num_heads

    def layer_recompute(self, index_in_chunk: int) -> RecomputePolicy:
        """The policy one layer runs, parsed once: ``full`` for the first
        ``recompute_num_layers`` layers of a chunk (all, if None) and ``recompute_rest`` for
        the others; otherwise the configured preset or modules (``auto`` must have been
        resolved: :class:`ConfigError`)."""
        if self.recompute != "full":
            return RecomputePolicy.parse(self.recompute)
        limit = self.recompute_num_layers
        if limit is None or index_in_chunk < limit:
            return RecomputePolicy(full=True)
        return RecomputePolicy(modules=parse_rest(self.recompute_rest))

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """The vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * t``."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def validate(self) -> None:
        """Raise :class:`ConfigError` (one line: field, value, what is valid) on a bad field,
        whatever the layout (:func:`~lightning_sp.model.config_checks.check_config`); the one
        check against a layout is :func:`~lightning_sp.model.config_checks.check_model_layout`."""
        check_config(self)


RESUMABLE_FIELDS = frozenset(
    {
        "seq_length",  # learned positions: a shape, checked as one; RoPE: context extension
        "hidden_dropout",
        "attention_dropout",
        "sequence_parallel",
        "recompute",
        "recompute_num_layers",
        "recompute_rest",
        "attention",
        "init_std",
        "make_vocab_size_divisible_by",  # only the padding rows, which are not saved
        "seed",
    }
)
"""The :class:`GPTConfig` fields that do not change what trained weights mean: a run may load a
checkpoint with other values. Every other field, including any field added later, is the
architecture (:func:`architecture`), which a loaded checkpoint must match."""


def architecture(config: GPTConfig) -> dict[str, Any]:
    """The architecture fields of ``config`` (all but :data:`RESUMABLE_FIELDS`) as JSON values,
    written one way (``num_query_groups`` num_heads is None, ``ffn_hidden_size`` 4h is None),
    so that two configs describe the same weights exactly when these dicts are equal."""
    plain = json.loads(json.dumps(dataclasses.asdict(config), default=str))
    plain["num_query_groups"] = None if config.groups == config.num_heads else config.groups
    plain["ffn_hidden_size"] = (
        None if config.ffn_size == 4 * config.hidden_size else config.ffn_size
    )
    return {k: v for k, v in plain.items() if k not in RESUMABLE_FIELDS}


ARCHITECTURES: dict[str, dict[str, Any]] = {
    "gpt2": {},
    "llama": {
        "normalization": "rmsnorm",
        "position_embedding": "rope",
        "activation": "swiglu",
        "bias": False,
        "tie_embeddings": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "rope_theta": 500000.0,
    },
}
ARCHITECTURES["mistral"] = {**ARCHITECTURES["llama"], "rope_theta": 10000.0}
ARCHITECTURES["qwen2"] = {**ARCHITECTURES["mistral"], "bias": ["qkv"], "layernorm_eps": 1e-6}
ARCHITECTURES["qwen3"] = {**ARCHITECTURES["mistral"], "qk_norm": "head", "layernorm_eps": 1e-6}
ARCHITECTURES["olmo2"] = {
    **ARCHITECTURES["mistral"],
    "qk_norm": "projection",
    "norm_placement": "post",
    "layernorm_eps": 1e-6,
}
"""The field values of each architecture family (the rest are given per model): Llama, and the
dense families that differ from it by a part or an option (Mistral: none, its sliding window
aside; Qwen2: biases on Q, K, V; Qwen3: query/key norms per head; OLMo 2: query/key norms over
the projections and norms after each sublayer). A new family is one entry here if it is made
of known parts, or a new part in :mod:`lightning_sp.model.parts` if it brings one."""
