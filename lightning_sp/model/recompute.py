"""Activation recomputation (paper §5): the recompute modules, their presets, and the one
autograd function that replays a region.

A *recompute module* is one descriptor in :data:`RECOMPUTE_MODULES`: what it wraps, which of
the layer's saved tensors it drops (terms of
:func:`lightning_sp.memory.formulas.layer_saved_terms`), and the forward FLOPs it redoes. The
model, the memory formulas, the FLOPs count, the planner and the callbacks all read these
descriptors; none switches on a policy string. ``GPTConfig.recompute`` is a list of module
names or a preset (:data:`PRESETS`, plus ``full`` and ``auto``).

How each module is realised (``lightning_sp.model``):

* ``core_attn``: :func:`recompute` around the attention core; only where the attention backend
  keeps ``s x s`` tensors (``math``). Under ``sdpa`` it would drop only SDPA's logsumexp for a
  second attention forward, so it is not applied (and the planner says so).
* ``layernorm``: each norm (LayerNorm or RMSNorm) is recomputed inside its consumer's backward
  (the QKV and MLP input linears save the norm's *input* instead of its output;
  :mod:`lightning_sp.model.fused`).
* ``mlp_act``: the MLP activation (GeLU, or SwiGLU's ``silu(gate)·up``) is recomputed inside
  fc2's backward (fc2 saves the activation's input, which is kept anyway, instead of its
  output).
* ``residual_mask``: the two residual dropouts regenerate their masks from the RNG stream in
  backward instead of storing them (:func:`lightning_sp.parallel.random.dropout`).

``full`` is not a module: the whole layer runs under :func:`recompute` (paper §5).

A region runs twice per step: once in forward, once replayed in backward. State that a forward
accumulates (an MoE router's choices per expert, a layer's routing totals) asks
:func:`replaying` and adds only in the first run, so it counts each token once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_sp.errors import ConfigError
from lightning_sp.model.cores import ATTENTION_BACKENDS
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.random import RNGStreams


@dataclass(frozen=True)
class RecomputeModule:
    """One recompute module: what it wraps, the saved tensors it drops, the FLOPs it redoes."""

    name: str
    wraps: str
    """What is recomputed, and inside which backward."""
    drops: tuple[str, ...]
    """Terms of :func:`lightning_sp.memory.formulas.layer_saved_terms` no longer stored."""
    redone_flops: Callable[[ActivationShape], float]
    """Matmul FLOPs of the forward work redone per layer for ``shape.b`` whole sequences (all
    ranks together). Elementwise work (LayerNorm, GeLU, masks) is not counted, as everywhere
    in the paper's FLOPs."""
    needs_scores: bool = False
    """Only applies where the attention backend keeps ``s x s`` tensors."""


RECOMPUTE_MODULES: dict[str, RecomputeModule] = {
    m.name: m
    for m in (
        RecomputeModule(
            "core_attn",
            "the attention core (QKᵀ, softmax, its dropout, attention over V), replayed "
            "before the projection's backward",
            ("attention_scores",),
            lambda x: 4.0 * x.b * x.s * x.s * x.a * x.head_dim,  # QKᵀ and probs·V, 2bs²·ad each
            needs_scores=True,
        ),
        RecomputeModule(
            "layernorm",
            "both norms, replayed inside the QKV / MLP input linears' backward",
            ("qkv_input", "fc1_input"),
            lambda x: 0.0,
        ),
        RecomputeModule(
            "mlp_act",
            "the MLP activation (GeLU or SwiGLU), replayed inside fc2's backward (an MoE "
            "layer's: the experts' and the shared experts', inside their down projections')",
            ("fc2_input", "expert_down_input", "shared_down_input"),
            lambda x: 0.0,
        ),
        RecomputeModule(
            "residual_mask",
            "the two residual-dropout masks, regenerated from the RNG stream in backward",
            ("attn_residual_mask", "mlp_residual_mask"),
            lambda x: 0.0,
        ),
    )
}
"""Every recompute module, by name."""

PRESETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "selective": ("core_attn",),
    "lean": ("core_attn", "layernorm", "mlp_act", "residual_mask"),
}
"""Named module sets. ``lean`` with TP+SP stores ``(34 - 4 - 8 - 2)sbh/t = 20sbh/t``."""

FULL, AUTO = "full", "auto"
POLICIES = (*PRESETS, FULL)
"""Concrete policies a layer can run under (``auto`` is resolved by the planner)."""

LayerRecompute = tuple[str, ...] | Literal["full"]
"""A parsed policy: ``"full"`` or a tuple of module names in registry order."""


def parse_recompute(
    value: object, field: str = "recompute", *, whole: bool = True
) -> LayerRecompute | Literal["auto"]:
    """``value`` (a preset name, ``full``, ``auto``, a module name, a list of module names,
    their names joined by ``+``, or a :class:`RecomputePolicy`) as ``"full"``, ``"auto"`` or
    the module tuple in registry order; :class:`ConfigError` (one line naming ``field``) if it
    is none of these, or with ``whole=False`` if it is ``full`` or ``auto`` (what
    ``recompute_rest`` may not be)."""
    if isinstance(value, RecomputePolicy):  # parsed already
        return "full" if value.full else value.modules
    names = (*POLICIES, AUTO) if whole else tuple(PRESETS)
    valid = f"valid: {', '.join(names)} or a list of {', '.join(RECOMPUTE_MODULES)}"
    if isinstance(value, str):
        if value in (FULL, AUTO):
            if whole:
                return value  # type: ignore[return-value]
            raise ConfigError(
                f"{field}={value!r} cannot be what the layers beyond recompute_num_layers run; "
                f"{valid}"
            )
        if value in PRESETS:
            return PRESETS[value]
        if "+" not in value and value not in RECOMPUTE_MODULES:
            raise ConfigError(f"{field}={value!r} is not a recompute policy; {valid}")
        value = value.split("+")  # one module, or the form policy_name gives a module set
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{field}={value!r} is not a recompute policy; {valid}")
    for name in value:
        if name not in RECOMPUTE_MODULES:
            raise ConfigError(
                f"{field}={list(value)!r}: {name!r} is not a recompute module; "
                f"valid modules: {', '.join(RECOMPUTE_MODULES)}"
            )
    if len(set(value)) != len(value):
        raise ConfigError(f"{field}={list(value)!r} names a module twice")
    return tuple(name for name in RECOMPUTE_MODULES if name in value)


def parse_rest(value: object, field: str = "recompute_rest") -> tuple[str, ...]:
    """``value`` as the module tuple of a policy that can run on the layers of a chunk beyond
    ``recompute_num_layers`` (a preset or modules, as :func:`parse_recompute` reads them, but
    not ``full`` or ``auto``); :class:`ConfigError` (one line) otherwise."""
    parsed = parse_recompute(value, field, whole=False)
    assert not isinstance(parsed, str)
    return parsed


def policy_name(policy: str | Sequence[str] | RecomputePolicy) -> str:
    """A short name: the preset a module set equals, else the modules joined by ``+``."""
    parsed = parse_recompute(policy)
    if isinstance(parsed, str):
        return parsed
    for name, modules in PRESETS.items():
        if modules == parsed:
            return name
    return "+".join(parsed)


@dataclass(frozen=True)
class RecomputePolicy:
    """What one layer recomputes, parsed once (:meth:`parse`): the whole layer (``full``) or
    a set of recompute modules (``modules``, in registry order; ``()`` recomputes nothing).
    Layers, the memory formulas, the FLOPs count and the step-time model take it as it is."""

    full: bool = False
    """Recompute the whole layer from its input in backward."""

    modules: tuple[str, ...] = ()
    """The recompute modules that act (names of :data:`RECOMPUTE_MODULES`); empty with
    ``full``."""

    @classmethod
    def parse(cls, value: object, field: str = "recompute") -> RecomputePolicy:
        """``value`` as :func:`parse_recompute` reads it; ``auto`` must have been resolved
        (:class:`ConfigError`, one line)."""
        parsed = parse_recompute(value, field)
        if parsed == AUTO:
            raise ConfigError(f"{field}='auto' must be resolved before layers are built")
        if parsed == FULL:
            return cls(full=True)
        assert not isinstance(parsed, str)
        return cls(modules=parsed)

    @property
    def name(self) -> str:
        """``full``, the preset the modules equal, or the modules joined by ``+``
        (:func:`policy_name`)."""
        return policy_name(self)

    def active(self, attention: str) -> frozenset[str]:
        """The names of its modules that act under the ``attention`` backend."""
        return frozenset(m.name for m in active_modules(self.modules, attention))


def active_modules(modules: Sequence[str], attention: str) -> tuple[RecomputeModule, ...]:
    """The descriptors of ``modules`` that act under the ``attention`` backend (``core_attn``
    does nothing where the backend keeps no ``s x s`` tensor)."""
    keeps_scores = ATTENTION_BACKENDS[attention].keeps_scores
    return tuple(
        RECOMPUTE_MODULES[n]
        for n in modules
        if keeps_scores or not RECOMPUTE_MODULES[n].needs_scores
    )


_REPLAYING: ContextVar[bool] = ContextVar("recompute_replaying", default=False)


def replaying() -> bool:
    """Whether this thread is inside a :func:`recompute` region's replay in backward (the
    second run of a forward already counted)."""
    return _REPLAYING.get()


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Tensor], rng: RNGStreams, *inputs: Tensor) -> Tensor:
        ctx.fn, ctx.rng = fn, rng
        ctx.rng_state = rng.get_state()
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        after = ctx.rng.get_state()
        ctx.rng.set_state(ctx.rng_state)
        token = _REPLAYING.set(True)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            _REPLAYING.reset(token)
            ctx.rng.set_state(after)
        torch.autograd.backward(out, grad)
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))


def recompute(fn: Callable[..., Tensor], rng: RNGStreams, *inputs: Tensor) -> Tensor:
    """``fn(*inputs)``, storing only ``inputs`` for backward and recomputing the rest.

    Runs ``fn`` without building a graph and saves only its tensor inputs (through
    ``save_for_backward``, so saved-tensor hooks see exactly what is kept); in backward re-runs
    ``fn`` with the dropout streams rewound to where they were, which replays identical masks.
    ``fn`` must return one tensor and draw its randomness from ``rng``; during the replay
    :func:`replaying` is true.
    """
    return _Recompute.apply(fn, rng, *inputs)
