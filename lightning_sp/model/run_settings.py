"""``RunSettings``: how a run computes a model (sequence parallelism, activation
recomputation, the attention backend, dropout, initialisation, the vocabulary padding, the
sequence length it trains on). They may change between runs of the same weights (resume,
``init_from``, export); what the weights mean is
:class:`~lightning_sp.model.architecture.Architecture`."""

from dataclasses import dataclass, field

from lightning_sp.errors import finite_number
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.parallel.fp8 import FP8Config

SELECTIVE = RecomputePolicy("selective")


@dataclass
class RunSettings:
    """The fields of a :class:`~lightning_sp.model.config.GPTConfig` that do not change what
    trained weights mean. ``recompute`` and ``recompute_rest`` are given as a config file
    writes them (a preset, a list of modules) and held parsed
    (:class:`~lightning_sp.model.recompute.RecomputePolicy`) from construction on."""

    seq_length: int = 2048
    """Sequence length (s): tokens per sample, and the number of learned positions."""

    hidden_dropout: float = 0.1
    """Dropout probability after the embedding and on both residual branches."""

    attention_dropout: float = 0.1
    """Dropout probability on the attention probabilities."""

    sequence_parallel: bool = False
    """Shard LayerNorm, dropout and residual activations along the sequence over the
    tensor-parallel group (paper §4.2.2). Needs seq_length divisible by the TP size."""

    recompute: RecomputePolicy = SELECTIVE
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

    recompute_rest: RecomputePolicy = SELECTIVE
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

    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation; the two output projections of
    each layer use init_std / sqrt(2 * num_layers)."""

    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times the tensor-parallel size."""

    hf_model_type: str | None = field(default=None, compare=False)
    """The Hugging Face ``model_type`` export writes (``llama``, ``mistral``, ``qwen2``,
    ``qwen3``, ``olmo2``, ``gpt2``); None: the first that holds the config (GPT-2, then Llama:
    a Mistral without a window computes as a Llama). Reading a directory sets it. Not part of
    the architecture (and not compared)."""

    seed: int = 1234
    """Seed of the weight initialisation and of the dropout streams. A model built from the
    same seed has the same weights under every parallel layout."""

    fp8: FP8Config | None = None
    """FP8 GEMMs in the layers' tensor-parallel linears (QKV, the attention projection, the
    MLP's input projections and ``fc2``), ``torchao.float8``'s recipe (``tensorwise`` or
    ``rowwise``) with agreed scales over the TP group; the embeddings, the LM head and the
    norms stay in the run's precision, and so do the master weights. ``emulate: true`` runs
    the float8 numerics without FP8 hardware (a CPU). Refused with a mixture of experts, LoRA,
    context parallelism, fewer key/value groups than TP ranks and float64 (one line each);
    ``null``: off. :mod:`lightning_sp.model.fp8`."""

    def __setattr__(self, name: str, value: object) -> None:
        """``recompute`` and ``recompute_rest`` are parsed whenever they are set (one
        :class:`~lightning_sp.errors.ConfigError` line for a value that is no policy)."""
        if name in ("recompute", "recompute_rest"):
            value = RecomputePolicy.parse(value, name, rest=name == "recompute_rest")
        super().__setattr__(name, value)

    def __post_init__(self) -> None:
        for name in ("hidden_dropout", "attention_dropout"):
            finite_number(name, getattr(self, name), "in [0, 1)", lambda v: 0 <= v < 1)
        finite_number("init_std", self.init_std, "a finite number >= 0", lambda v: v >= 0)
