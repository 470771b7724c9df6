"""The model configuration: one flat dataclass as config files write it (``model.config.*``),
composed of two records, one docstring per field: :class:`~lightning_sp.model.architecture.
Architecture` (what the weights mean; ``GPTConfig.architecture``) and
:class:`~lightning_sp.model.run_settings.RunSettings` (how a run computes). The architecture is
data: the norm, the positions, the MLP activation, the key/value groups, biases and tied
embeddings are fields naming descriptors of :mod:`lightning_sp.model.spec`; ``ARCHITECTURES``
holds the field values of each family (``GPTConfig.of("llama", ...)`` builds one)."""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from lightning_sp.errors import ConfigError, divisors
from lightning_sp.model.architecture import (
    Activation,
    Architecture,
    Normalization,
    PositionEmbedding,
)
from lightning_sp.model.config_checks import BIAS_PROJECTIONS, check_config
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.ops import RopeScaling
from lightning_sp.model.parts.block import Block, block_of
from lightning_sp.model.recompute import POLICIES, RecomputePolicy
from lightning_sp.model.run_settings import RunSettings
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.fp8 import FP8Config

ONE_RANK = ParallelConfig()
"""The layout of one rank (a frozen record, built once: the FLOP counts ask for it per call)."""

RECOMPUTE_POLICIES = POLICIES
"""The named policies: the presets ``none``, ``selective``, ``lean`` and ``full``."""

__all__ = [
    "ARCHITECTURES", "BIAS_PROJECTIONS", "Activation", "Architecture", "GPTConfig",
    "Normalization", "PositionEmbedding", "RunSettings",
]  # fmt: skip


@dataclass
class GPTConfig(RunSettings, Architecture):
    """A decoder-only transformer. The defaults are a GPT-3 style decoder (paper §3): learned
    positions, pre-LayerNorm, GeLU MLP with biases, multi-head attention, tied input/output
    embeddings, dropout after the embedding, on attention probabilities and on both residual
    branches. The Llama family (``ARCHITECTURES["llama"]``) is RMSNorm, RoPE, SwiGLU,
    grouped-query attention, no biases, untied embeddings, no dropout."""

    moe: MoEConfig | None = None
    """The mixture-of-experts settings with ``feed_forward: moe``: its shape
    (:class:`~lightning_sp.model.moe.config.MoEArchitecture`: experts, top-k, router scores,
    shared experts) and its training settings (capacity, auxiliary-loss coefficients, router
    dtype, bias update rate); unused otherwise."""

    def __post_init__(self) -> None:
        """Every field checked once, when the config is built (its float settings, then
        :func:`~lightning_sp.model.config_checks.check_config`): a built config is valid, and
        nothing downstream checks it again. :class:`ConfigError`, one line: field, value,
        what is valid. The one check against a layout is
        :func:`~lightning_sp.model.config_checks.check_model_layout`."""
        Architecture.__post_init__(self)
        RunSettings.__post_init__(self)
        check_config(self)

    @property
    def architecture(self) -> "Architecture":
        """What the weights mean, as its own record written one way
        (:meth:`Architecture.canonical`): what checkpoints, export, ``init_from`` and the
        resume check compare, whole."""
        return Architecture.canonical(self)

    def values(self) -> dict[str, Any]:
        """The fields as a config file writes them (JSON values: a policy as its YAML
        spelling, a record as a mapping): what ``hparams.yaml``, a checkpoint's ``meta.json``
        and :meth:`from_values` read back."""
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("recompute", "recompute_rest"):
            plain[name] = plain[name].value
        for name in ("moe", "rope_scaling", "fp8"):
            if plain[name] is not None:
                plain[name] = dataclasses.asdict(plain[name])
        return plain

    @classmethod
    def of(cls, architecture: str, **overrides: Any) -> "GPTConfig":
        """A config of the family ``architecture`` (:data:`ARCHITECTURES`) with ``overrides``."""
        if architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture={architecture!r} is not known; valid: {', '.join(ARCHITECTURES)}"
            )
        return cls(**{**ARCHITECTURES[architecture], **overrides})

    @classmethod
    def from_values(cls, values: Any) -> "GPTConfig":
        """A config from plain values (a YAML mapping, a checkpoint's record, a parsed
        namespace): ``rope_scaling`` and ``moe`` given as mappings become a
        :class:`~lightning_sp.model.ops.RopeScaling` and a
        :class:`~lightning_sp.model.moe.config.MoEConfig`."""
        fields = dict(values) if isinstance(values, dict) else dict(vars(values))
        records = (("rope_scaling", RopeScaling), ("moe", MoEConfig), ("fp8", FP8Config))
        for name, record in records:
            given = fields.get(name)
            if given is not None and not isinstance(given, record):
                fields[name] = record(**(dict(given) if isinstance(given, dict) else vars(given)))
        return cls(**fields)

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

    def for_measurement(self) -> "GPTConfig":
        """This config as the memory measurement traces it (under fake tensors, which hold no
        values): a mixture of experts routes force-balanced (``moe.force_balanced``), the
        balanced routing its formulas assume, with no count read from the device."""
        if self.moe is None:
            return self
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, force_balanced=True))

    def block(self) -> Block:
        """The layer's parts (:func:`lightning_sp.model.parts.block.block_of`)."""
        return block_of(self)

    def activation_shape(
        self,
        layout: ParallelConfig | None = None,
        micro_batch_size: int = 1,
        *,
        seq_length: int | None = None,
        activation_bytes: float = 2,
        mask_bytes: float = 1,
        documents: bool = False,
        device: torch.device | None = None,
    ) -> ActivationShape:
        """The shape of this config's layers laid out as ``layout`` (its t, c, e and expert
        tensor parallel size; None: one rank) at micro-batch ``b`` (``seq_length`` overrides
        the config's, for shorter inputs; it is the whole sequence, of which a rank holds
        ``s/c`` under CP); ``documents``: attention masked by packed documents
        (``data.document_mask``); ``device``: where the layers run, whose kernels decide what
        they save beside the formula's terms: a CUDA device gives
        :meth:`ActivationShape.on_cuda` (LayerNorm's statistics in fp32, the fused attention
        kernel's Philox state), any other device or None the CPU's terms. Built once per
        (model, layout, micro-batch) and passed whole; its ``block`` is this config's parts."""
        layout = ONE_RANK if layout is None else layout
        shape = ActivationShape(
            s=seq_length or self.seq_length,
            b=micro_batch_size,
            h=self.hidden_size,
            a=self.num_heads,
            t=layout.tensor_parallel_size,
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
            c=layout.context_parallel_size,
            d=self.kv_channels or 0,
            documents=documents,
            e=layout.expert_parallel_size,
            block=self.block(),
            etp=layout.expert_tensor_parallel_size,
            fp8=self.fp8.recipe if self.fp8 is not None else None,
        )
        return shape.on_cuda() if device is not None and device.type == "cuda" else shape

    @property
    def output_init_std(self) -> float:
        """Init std of each layer's two output projections: ``init_std / sqrt(2L)``."""
        return self.init_std / math.sqrt(2 * self.num_layers)

    def layer_recompute(self, index_in_chunk: int) -> RecomputePolicy:
        """The policy one layer runs: with ``full``, ``full`` for the first
        ``recompute_num_layers`` layers of a chunk (all, if None) and ``recompute_rest`` for
        the others; otherwise the configured policy (``auto`` must have been resolved:
        :class:`ConfigError`, one line)."""
        policy = self.recompute.check_resolved()
        limit = self.recompute_num_layers
        if not policy.full or limit is None or index_in_chunk < limit:
            return policy
        return self.recompute_rest

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """The vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * t``."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple


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
