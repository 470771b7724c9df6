"""Shared builders for model tests: tiny configs, a seeded batch, shard-vs-reference checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.recompute import NO_RECOMPUTE, RecomputePolicy
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.context import shard_for_context_parallel
from lightning_sp.parallel.grads import (
    finalize_grads,
)
from lightning_sp.parallel.init import local_slice


def tiny_config(architecture: str = "gpt2", **overrides: object) -> GPTConfig:
    """A 2-layer model of ``architecture`` (``GPTConfig.of``) small enough for float64 on
    four ranks; vocab 300 exercises padding. Llama: 2 key/value groups of 2 query heads,
    RoPE theta 500000, untied, SwiGLU of width 48."""
    fields: dict[str, object] = dict(
        vocab_size=300, seq_length=16, hidden_size=32, num_layers=2, num_heads=4,
        hidden_dropout=0.0, attention_dropout=0.0, seed=7,
    )  # fmt: skip
    if architecture == "llama":
        fields.update(num_query_groups=2, ffn_hidden_size=48)
    fields.update(overrides)
    return GPTConfig.of(architecture, **fields)


def moe_context(
    moe: MoEConfig,
    hidden_size: int,
    state: ParallelState | None = None,
    *,
    sequence_parallel: bool = False,
    recompute_act: bool = False,
    dtype: torch.dtype | None = None,
) -> BuildContext:
    """The build context of an MoE layer (or its router) of ``moe`` alone, over
    ``hidden_size``: a one-layer SwiGLU model of it on ``state`` (one rank if None), its
    ``mlp_act`` recompute module active with ``recompute_act``."""
    config = GPTConfig(
        vocab_size=256, seq_length=16, hidden_size=hidden_size, num_layers=1, num_heads=1,
        activation="swiglu", bias=False, feed_forward="moe", moe=moe,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    policy = RecomputePolicy(["mlp_act"]) if recompute_act else NO_RECOMPUTE
    return BuildContext.of(config, state or ParallelState.single(), policy, dtype=dtype)


def check_layout(world_size: int, t: int, p: int, c: int = 1) -> int:
    """The data-parallel size of ``(t, p, c)`` on ``world_size`` ranks: the layout record
    built (its sizes checked) and completed for the world (:meth:`ParallelConfig.
    for_world_size`, the one check of a layout against a world)."""
    layout = ParallelConfig(
        tensor_parallel_size=t, pipeline_parallel_size=p, context_parallel_size=c
    )
    return layout.for_world_size(world_size).data_parallel_size


def layout_at(t: int = 1, *, p: int = 1, c: int = 1, e: int = 1, etp: int = 1) -> ParallelConfig:
    """The layout record of these sizes (what shapes and per-rank counts are built from)."""
    return ParallelConfig(
        tensor_parallel_size=t, pipeline_parallel_size=p, context_parallel_size=c,
        expert_parallel_size=e, expert_tensor_parallel_size=etp,
    )  # fmt: skip


def shape_at(
    config: GPTConfig,
    t: int = 1,
    b: int = 1,
    c: int = 1,
    e: int = 1,
    etp: int = 1,
    *,
    sequence_parallel: bool | None = None,
) -> ActivationShape:
    """``config``'s activation shape at ``t, b, c, e, etp`` (``sequence_parallel``: the
    config's, or this)."""
    if sequence_parallel is not None:
        config = dataclasses.replace(config, sequence_parallel=sequence_parallel)
    return config.activation_shape(layout_at(t, c=c, e=e, etp=etp), b)


def small_config(**overrides: object) -> GPTConfig:
    """A small GPT-2 config (v=300, s=32, h=64, 4 layers of 4 heads, dropout 0.1) with
    ``overrides``: the memory and model-state tests' model."""
    fields: dict[str, object] = dict(
        vocab_size=300, seq_length=32, hidden_size=64, num_layers=4, num_heads=4,
        hidden_dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


def batch(
    config: GPTConfig, batch_size: int = 2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels ``[b, s]``, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(
        0, config.vocab_size, (batch_size, config.seq_length + 1), generator=generator
    )
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model: GPT, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One forward/backward; gradients finished as the trainer does, by the package's own
    :func:`finalize_grads` (SP grads and replicated KV heads summed over TP, averaged over DP,
    summed over the CP group under context parallelism, where ``ids`` and ``labels`` are this
    rank's shards: :func:`context_shards`)."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels)
    loss.backward()
    finalize_grads(model, model.state)
    return loss.detach()


def context_shards(state: ParallelState, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This CP rank's load-balanced shards ``[b, s/c]`` of full ``[b, s]`` batches (the
    tensors themselves for ``c = 1``)."""
    c, r = state.context_parallel_size, state.context_parallel_rank
    return tuple(shard_for_context_parallel(x, 1, c, r) for x in tensors)


PolicyResult = tuple[str, list[torch.Tensor], dict[str, torch.Tensor]]
"""``(policy, the losses of two steps, the gradients after the second)``."""


def two_steps(model: GPT, policy: str) -> PolicyResult:
    """Two forward/backward passes of ``model`` on its config's batch (dropout draws anew)."""
    ids, labels = batch(model.config)
    losses = [loss_and_grads(model, ids, labels) for _ in range(2)]
    return policy, losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_policies_agree(results: list[PolicyResult], what: str) -> None:
    """Every result equals the first (losses and gradients to 1e-12): the recompute policies
    replayed the masks the first one drew; and the first drew different masks each step."""
    base, base_losses, base_grads = results[0]
    assert base_losses[0] != base_losses[1], "dropout drew the same masks twice"
    floor = gradient_floor(base_grads.values())
    for policy, losses, grads in results[1:]:
        case = f"{what}: {policy} vs {base}"
        for a, b in zip(losses, base_losses, strict=True):
            assert relative_error(a, b) <= 1e-12, f"{case}: loss {a} vs {b}"
        for name, grad in grads.items():
            err = relative_error(grad, base_grads[name], floor)
            assert err <= 1e-12, f"{case}: {name} gradient relative error {err:.2e}"


def reference_model(config: GPTConfig) -> GPT:
    """The one-process float64 model from the same seed."""
    return GPT(config, ParallelState.single(), dtype=torch.float64)


def relative_error(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``‖a - b‖ / ‖b‖``, with ``‖b‖`` taken as at least ``floor`` (and 1 where both are 0)."""
    scale = max(b.norm().item(), floor)
    return (a - b).norm().item() / (scale if scale > 0 else 1.0)


VOCAB_PARAMETER = "word_embeddings.weight"
"""The embedding, sharded along the (padded) vocabulary: its rows past ``vocab_size`` are
padding, whose number depends on ``t``, not model weights (so are an untied output layer's,
marked ``padded_vocab`` like it)."""

NULL_GRADIENT_FLOOR = 1e-6
"""A gradient that is zero in exact arithmetic (the key bias: softmax ignores a shift common to
all keys) is rounding noise; its error is taken relative to this fraction of the largest
reference gradient's norm instead of its own."""


def gradient_floor(grads: Iterable[torch.Tensor | None]) -> float:
    """:data:`NULL_GRADIENT_FLOOR` times the largest norm among ``grads``: the ``floor`` of
    :func:`relative_error` for comparing a model's gradients."""
    return NULL_GRADIENT_FLOOR * max(g.norm().item() for g in grads if g is not None)


@dataclass
class Comparison:
    """What :func:`assert_matches_reference` compared (so a caller can see it was not nothing).

    ``elements``: weight elements compared with the reference (each also compared by gradient);
    ``padding_rows``: padded vocabulary rows of the model's shards whose gradient was asserted to
    be exactly zero; ``padding_only``: shards that hold padding rows only (compared over zero
    elements, which is allowed for these and nothing else).
    """

    parameters: int = 0
    elements: int = 0
    padding_rows: int = 0
    padding_only: list[str] = field(default_factory=list)


def _true_rows(model: nn.Module, name: str, param: torch.Tensor) -> int:
    """How many of ``param``'s leading rows are real model weights (all of them except for
    the vocabulary shard, whose rows at or past ``vocab_size`` are padding)."""
    if not getattr(param, "padded_vocab", False):
        return param.shape[0]
    vocab_size: int = model.config.vocab_size  # type: ignore[union-attr]
    return max(0, min(param.shape[0], vocab_size - param.shard.start))


def _aligned(
    model: nn.Module, name: str, param: torch.Tensor, ref: torch.Tensor, what: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local weight, local grad, reference weight, reference grad)`` restricted to the real
    weights of this shard; raises if the reference does not hold all of them."""
    rows = _true_rows(model, name, param)
    local, grad = param.detach()[:rows], param.grad[:rows]
    ref_param = local_slice(param, ref.detach())[: local.shape[0]]
    ref_grad = local_slice(param, ref.grad)[: local.shape[0]]
    assert ref_param.shape == local.shape, (
        f"{what} {name}: shard {tuple(local.shape)} is not inside the reference "
        f"{tuple(ref.shape)} (reference slice {tuple(ref_param.shape)})"
    )
    return local, grad, ref_param, ref_grad


def _assert_padding_has_no_gradient(
    model: nn.Module, name: str, param: torch.Tensor, what: str
) -> int:
    """Padded vocabulary rows get probability 0, so their gradient is exactly 0; returns the
    number of padded rows checked."""
    rows = _true_rows(model, name, param)
    padded = param.grad[rows:]
    if padded.numel():
        start = param.shard.start + rows
        assert torch.count_nonzero(padded) == 0, (
            f"{what} {name}: padded vocabulary rows {start}..{start + padded.shape[0] - 1} "
            f"have a nonzero gradient (max |g| {padded.abs().max().item():.3e}): padded "
            "logits got probability"
        )
    return padded.shape[0]


def assert_matches_reference(
    model: nn.Module, reference: GPT, rtol: float, what: str = ""
) -> Comparison:
    """Every parameter (and gradient) shard of ``model`` equals its slice of ``reference``.

    The vocabulary shard is compared over its rows below ``vocab_size`` only (padding depends
    on t); its padded rows, and the reference's, must have exactly zero gradient. A shard that
    is compared over zero elements fails unless it holds padding only. Returns what was
    compared.
    """
    reference_params = dict(reference.named_parameters())
    for name, ref_param in reference_params.items():
        if getattr(ref_param, "padded_vocab", False):
            _assert_padding_has_no_gradient(reference, name, ref_param, f"{what} reference")
    floor = gradient_floor(p.grad for p in reference_params.values())
    result = Comparison()
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{what} {name}: no gradient"
        ref = reference_params[model.global_name(name)]
        local, grad, ref_param, ref_grad = _aligned(model, name, param, ref, what)
        result.padding_rows += _assert_padding_has_no_gradient(model, name, param, what)
        if local.numel() == 0:
            assert param.numel() > 0 and _true_rows(model, name, param) == 0, (
                f"{what} {name}: compared over zero elements, and it is not all padding"
            )
            result.padding_only.append(name)
        assert torch.equal(local.to(ref_param.dtype), ref_param), f"{what} {name}: weights differ"
        err = relative_error(grad.to(ref_grad.dtype), ref_grad, floor)
        assert err <= rtol, f"{what} {name}: gradient relative error {err:.3e} > {rtol}"
        result.parameters += 1
        result.elements += local.numel()
    return result


def max_gradient_error(model: nn.Module, reference: nn.Module) -> tuple[float, str]:
    """The largest relative gradient error of ``model``'s shards against ``reference`` (same
    slicing as :func:`assert_matches_reference`), and the parameter it occurs in."""
    reference_params = dict(reference.named_parameters())
    floor = gradient_floor(p.grad for p in reference_params.values())
    worst, worst_name = 0.0, ""
    for name, param in model.named_parameters():
        ref = reference_params[model.global_name(name)]
        _, grad, _, ref_grad = _aligned(model, name, param, ref, "")
        err = relative_error(grad.to(ref_grad.dtype), ref_grad, floor)
        if err >= worst:
            worst, worst_name = err, name
    return worst, worst_name


def feed_forward_terms() -> set[str]:
    """The names of the saved terms of a layer of every feed-forward part: the dense MLP's
    (GPT-2 and Llama) and the mixture of experts' (with a shared expert), which the recompute
    modules may name."""
    from lightning_sp.memory.formulas import layer_saved_terms
    from lightning_sp.model.moe.config import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=16, num_shared_experts=1)
    configs = (
        tiny_config("gpt2"),
        tiny_config("llama"),
        tiny_config("llama", feed_forward="moe", moe=moe),
    )
    return {name for c in configs for name in layer_saved_terms(c.activation_shape())}
