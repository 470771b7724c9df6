"""The GPT configuration: one dataclass, one docstring per field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lightning_sp.errors import ConfigError, divisors, positive_int
from lightning_sp.model.recompute import POLICIES, parse_recompute, parse_rest, policy_name

RECOMPUTE_POLICIES = POLICIES
"""The named policies: the presets ``none``, ``selective``, ``lean`` and ``full``."""
ACTIVATIONS = ("gelu", "gelu_tanh")
Activation = Literal["gelu", "gelu_tanh"]


@dataclass
class GPTConfig:
    """A GPT-3 style decoder (paper §3): learned positions, pre-LayerNorm, GeLU MLP, tied
    input/output embeddings, dropout after the embedding, on attention probabilities and on
    both residual branches."""

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

    ffn_hidden_size: int | None = None
    """Width of the MLP's inner layer; default 4 * hidden_size."""

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
    """The MLP's GeLU: ``gelu`` is exact (erf); ``gelu_tanh`` is the tanh approximation that
    OpenAI's GPT-2 weights were trained with (Hugging Face's ``gelu_new``)."""

    layernorm_eps: float = 1e-5
    """Epsilon of every LayerNorm."""

    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation; the two output projections of
    each layer use init_std / sqrt(2 * num_layers)."""

    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times the tensor-parallel size."""

    seed: int = 1234
    """Seed of the weight initialisation and of the dropout streams. A model built from the
    same seed has the same weights under every parallel layout."""

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def output_init_std(self) -> float:
        """Init std of each layer's two output projections: ``init_std / sqrt(2L)``."""
        return self.init_std / math.sqrt(2 * self.num_layers)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_recompute(self, index_in_chunk: int) -> str:
        """The policy one layer runs, by name (:func:`~lightning_sp.model.recompute.
        policy_name`): ``full`` for the first ``recompute_num_layers`` layers of a chunk (all,
        if None) and ``recompute_rest`` for the others; otherwise the configured preset, or
        its modules joined by ``+`` (``auto`` must have been resolved)."""
        if parse_recompute(self.recompute) == "auto":
            raise ConfigError("recompute='auto' must be resolved before layers are built")
        if self.recompute != "full":
            return policy_name(self.recompute)
        limit = self.recompute_num_layers
        if limit is None or index_in_chunk < limit:
            return "full"
        return policy_name(parse_rest(self.recompute_rest))

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """The vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * t``."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def validate(self, tensor_parallel_size: int = 1) -> None:
        """Raise :class:`ConfigError` (one line: field, value, what is valid) on a bad config."""
        t = tensor_parallel_size
        for name in ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_heads"):
            positive_int(name, getattr(self, name))
        parse_recompute(self.recompute)
        parse_rest(self.recompute_rest)
        from lightning_sp.model.attention import check_attention

        check_attention(self.attention)
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"activation={self.activation!r} is not an activation; "
                f"valid: {', '.join(ACTIVATIONS)}"
            )
        if self.recompute_num_layers is not None and self.recompute_num_layers < 0:
            raise ConfigError(
                f"recompute_num_layers={self.recompute_num_layers} must be >= 0 or null"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name}={value!r} must be in [0, 1)")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                f"num_heads must be one of {divisors(self.hidden_size)}"
            )
        if self.hidden_size % t:
            raise ConfigError(
                f"hidden_size={self.hidden_size} is not divisible by tensor_parallel_size={t}; "
                f"tensor_parallel_size must be one of {divisors(self.hidden_size)}"
            )
        if self.num_heads % t:
            raise ConfigError(
                f"num_heads={self.num_heads} is not divisible by tensor_parallel_size={t}; "
                f"tensor_parallel_size must be one of {divisors(self.num_heads)}"
            )
        if self.ffn_size % t:
            raise ConfigError(
                f"ffn_hidden_size={self.ffn_size} is not divisible by tensor_parallel_size={t}; "
                f"tensor_parallel_size must be one of {divisors(self.ffn_size)}"
            )
        if self.sequence_parallel and self.seq_length % t:
            raise ConfigError(
                f"seq_length={self.seq_length} is not divisible by tensor_parallel_size={t} "
                f"with sequence_parallel=True; use a seq_length that is a multiple of {t} "
                "or sequence_parallel=False"
            )
