"""``MoEConfig``: the mixture-of-experts feed-forward part's fields, one docstring each, in two
records (:class:`MoEArchitecture`: what the weights mean; :class:`MoETraining`: how a run
trains them), each checked at construction, and their checks against a layout (one line each,
before any work starts)."""

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_sp.errors import ConfigError, check_divisible, finite_number, positive_int
from lightning_sp.parallel.config import ParallelConfig

Score = Literal["softmax", "sigmoid"]
RouterDtype = Literal["fp32", "fp64", "input"]


@dataclass(frozen=True)
class MoEArchitecture:
    """What an MoE layer's weights mean: the experts, how the router chooses among them, the
    shared experts and whether a choice bias exists. A checkpoint, an exported model and a
    Hugging Face directory fix these (:attr:`MoEConfig.architecture`). The defaults are
    Mixtral's routing (softmax, top-2, renormalised)."""

    num_experts: int = 8
    """``E``: routed experts per MoE layer."""

    top_k: int = 2
    """``k``: experts each token is sent to (``k <= E``)."""

    expert_ffn_size: int = 256
    """``f_e``: the inner width of each expert's SwiGLU (``moe_intermediate_size``)."""

    score: Score = "softmax"
    """Router scores from the fp32 logits: ``softmax`` over the experts (Mixtral, Qwen3-MoE,
    OLMoE) or ``sigmoid`` per expert (DeepSeek-V3)."""

    normalize_top_k: bool = True
    """Divide the ``k`` chosen scores by their sum (Mixtral: yes; Qwen3-MoE:
    ``norm_topk_prob``; OLMoE: no), sigmoid scores alike (DeepSeek-V3: yes; ``false``: each
    choice weighs its own sigmoid score)."""

    num_shared_experts: int = 0
    """Shared experts every token passes through besides its routed ones (DeepSeek), as one
    tensor-parallel SwiGLU MLP of width ``shared_expert_ffn_size``; 0: none."""

    shared_expert_ffn_size: int | None = None
    """Width of the shared experts' MLP (with ``num_shared_experts > 0`` only); default
    ``num_shared_experts * expert_ffn_size``."""

    expert_bias: bool = False
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for
    the top-k *choice* only (not to the weights), moved by ``bias_update_rate`` towards balance
    after each optimizer step (:meth:`MoE.update_expert_bias`)."""

    def __post_init__(self) -> None:
        positive_int("moe.num_experts", self.num_experts)
        positive_int("moe.top_k", self.top_k)
        positive_int("moe.expert_ffn_size", self.expert_ffn_size)
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}; "
                f"top_k must be in 1..{self.num_experts}"
            )
        if self.score not in ("softmax", "sigmoid"):
            raise ConfigError(f"moe.score={self.score!r} is not one of softmax, sigmoid")
        if self.num_shared_experts < 0:
            raise ConfigError(f"moe.num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.shared_expert_ffn_size is not None:
            if not self.num_shared_experts:
                raise ConfigError(
                    f"moe.shared_expert_ffn_size={self.shared_expert_ffn_size!r} is given with "
                    "moe.num_shared_experts=0; set num_shared_experts >= 1 or leave it null"
                )
            positive_int("moe.shared_expert_ffn_size", self.shared_expert_ffn_size)


@dataclass(frozen=True)
class MoETraining:
    """How a run trains an MoE layer: capacity, the auxiliary losses' coefficients, the bias
    update rate, the router's dtype and the measurement switch. None of them changes what the
    weights mean: a run may resume a checkpoint with other values."""

    capacity_factor: float | None = None
    """``None``: dropless (every assignment computed). Else each expert takes at most
    ``ceil(capacity_factor · T·k / E)`` of the micro-batch's ``T`` tokens' assignments, those
    of highest routing weight; the rest are dropped (their rows pass through the residual only)
    and counted (:attr:`MoE.dropped`)."""

    aux_loss_coef: float = 0.0
    """Coefficient of the load-balancing loss ``E · Σ_i f_i · P_i`` (Switch / GShard, as
    transformers' ``load_balancing_loss_func`` for one layer: ``f_i`` the fraction of the
    micro-batch's tokens choosing expert ``i`` (summing to ``k``), ``P_i`` its mean router
    probability). Mixtral uses 0.02, Qwen3-MoE 0.001, OLMoE 0.01."""

    z_loss_coef: float = 0.0
    """Coefficient of the router z-loss: the mean over tokens of ``logsumexp(logits)²``
    (ST-MoE; OLMoE 0.001)."""

    bias_update_rate: float = 1e-3
    """``γ``: each step the bias of an expert with more than the mean load drops by ``γ`` and
    of one with less rises by ``γ`` (with ``expert_bias``)."""

    router_dtype: RouterDtype = "fp32"
    """The dtype of the router's logits and scores: ``fp32`` (Megatron's and transformers';
    the logits are cast after the matmul), ``fp64``, or ``input`` (the activations')."""

    force_balanced: bool = False
    """A measurement switch (Megatron's ``moe_router_force_load_balancing``): the choice of
    token ``i`` is experts ``(i·k + j) mod E`` for ``j < k``, whatever the scores (the weights
    are still the chosen scores), so every expert gets the same rows; for memory and speed
    measurements, never for training (``fit`` refuses it)."""

    @property
    def adds_auxiliary_losses(self) -> bool:
        """Whether the load-balancing or z loss has a coefficient > 0."""
        return bool(self.aux_loss_coef or self.z_loss_coef)

    def __post_init__(self) -> None:
        if self.capacity_factor is not None:
            finite_number(
                "moe.capacity_factor", self.capacity_factor, "> 0 and finite (or null: dropless)",
                lambda v: v > 0,
            )  # fmt: skip
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            finite_number(
                f"moe.{name}", getattr(self, name), "a finite number >= 0", lambda v: v >= 0
            )
        if self.router_dtype not in ("fp32", "fp64", "input"):
            raise ConfigError(
                f"moe.router_dtype={self.router_dtype!r} is not one of fp32, fp64, input"
            )


@dataclass(frozen=True)
class MoEConfig(MoETraining, MoEArchitecture):
    """A router choosing ``top_k`` of ``num_experts`` SwiGLU experts per token, optional shared
    experts every token passes through, and the load-balancing terms: the fields of
    :class:`MoEArchitecture` (what the weights mean) and of :class:`MoETraining` (how a run
    trains them), flat as YAML writes them (``model.config.moe.top_k``)."""

    def __post_init__(self) -> None:
        MoEArchitecture.__post_init__(self)
        MoETraining.__post_init__(self)

    def check_trainable(self) -> None:
        """:class:`ConfigError` (one line) if this config routes only for measurements
        (``force_balanced``): ``fit`` refuses it before any work."""
        if self.force_balanced:
            raise ConfigError(
                "moe.force_balanced=True routes every token to fixed experts whatever the "
                "scores, for memory and speed measurements only; fit with force_balanced: false"
            )

    @property
    def architecture(self) -> MoEArchitecture:
        """The fields that fix what the weights mean, as their own record (what a checkpoint's
        and a Hugging Face directory's MoE must equal)."""
        return MoEArchitecture(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(MoEArchitecture)}
        )

    @property
    def shared_ffn_size(self) -> int:
        """The shared experts' MLP width (0 without shared experts)."""
        if not self.num_shared_experts:
            return 0
        return self.shared_expert_ffn_size or self.num_shared_experts * self.expert_ffn_size

    def logits_dtype(self, activations: torch.dtype) -> torch.dtype:
        """The router's compute dtype for activations of ``activations``."""
        return {"fp32": torch.float32, "fp64": torch.float64}.get(self.router_dtype, activations)

    def check_layout(self, layout: ParallelConfig, sequence_parallel: bool) -> None:
        """This part against a layout (:func:`~lightning_sp.model.config_checks.
        check_model_layout` calls it; the layout checked its own sizes and the expert tensor
        parallel rule): :class:`ConfigError` (one line) unless ``e`` divides ``E``, tensor
        parallelism comes with sequence parallelism (each TP rank routes its own sequence
        shard, with ``t_e = t`` too; replicated tokens would be computed t times) and ``t_e``
        divides ``f_e``."""
        e, t = layout.expert_parallel_size, layout.tensor_parallel_size
        t_e = layout.expert_tensor_parallel_size
        check_divisible("moe.num_experts", self.num_experts, "expert_parallel_size", e)
        if t > 1 and not sequence_parallel:
            raise ConfigError(
                f"a mixture-of-experts model at tensor_parallel_size={t} needs "
                "sequence_parallel=True (each TP rank routes its own sequence shard)"
            )
        if self.expert_ffn_size % t_e:
            raise ConfigError(
                f"moe.expert_ffn_size={self.expert_ffn_size} is not divisible by "
                f"expert_tensor_parallel_size={t_e}"
            )
        if self.shared_ffn_size % t:
            raise ConfigError(
                f"moe.shared_expert_ffn_size={self.shared_ffn_size} is not divisible by "
                f"tensor_parallel_size={t}"
            )
