"""Activation recomputation (paper §5): the recompute modules, their presets, and the one
autograd function that replays a region.

A *recompute module* is one descriptor in :data:`RECOMPUTE_MODULES`: what it wraps, which of
the layer's saved tensors it drops (terms of
:func:`lightning_sp.memory.formulas.layer_saved_terms`), and the forward FLOPs it redoes. The
model, the memory formulas, the FLOPs count, the planner and the callbacks all read these
descriptors; none switches on a policy string. ``GPTConfig.recompute`` holds a
:class:`RecomputePolicy`, parsed once from a list of module names or a preset
(:data:`PRESETS`, plus ``full`` and ``auto``) when the config is built.

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
from typing import Any, Literal, Union

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

FULL = "full"
POLICIES = (*PRESETS, FULL)
"""Concrete policies a layer can run under (``auto`` is resolved by the planner)."""

LayerRecompute = tuple[str, ...] | Literal["full"]
"""A parsed policy in the older tuple form: ``"full"`` or a tuple of module names in registry
order (:func:`parse_recompute`)."""

RecomputeValue = Union[str, Sequence[str], "RecomputePolicy"]
"""What a config file or a caller may give: a preset, ``full``, ``auto``, a module, a list of
modules, their names joined by ``+``, or a parsed :class:`RecomputePolicy`."""


class RecomputePolicy(str):
    """What a layer (or, as configured, a model) recomputes, parsed once from a
    :data:`RecomputeValue` (``RecomputePolicy("lean")``, :meth:`parse`): the whole layer
    (``full``), a set of recompute modules (``modules``, in registry order; ``()`` recomputes
    nothing), or, as configured only, ``auto`` (the planner's choice, resolved when the model
    is configured: :meth:`check_resolved`).

    The policy *is* its name, a string (``full``, ``auto``, the preset its modules equal, or
    its modules joined by ``+``), so that a config holding it compares, hashes and is written
    (JSON, ``dataclasses.asdict``) as that spelling, which :meth:`parse` reads back. Layers,
    the memory formulas, the FLOPs count and the step-time model query its fields, never the
    string."""

    full: bool
    """Recompute the whole layer from its input in backward."""
    modules: tuple[str, ...]
    """The recompute modules that act (names of :data:`RECOMPUTE_MODULES`); empty with
    ``full`` or ``auto``."""
    auto: bool
    """Not yet a policy: the least recomputation that fits, which the planner resolves
    (:func:`lightning_sp.planner.estimate.auto_recompute_config`)."""

    def __new__(
        cls, value: object = "none", field: str = "recompute", *, rest: bool = False
    ) -> RecomputePolicy:
        """``value`` as a policy; :class:`ConfigError` (one line naming ``field``) if it is
        none, or with ``rest`` if it is ``full`` or ``auto`` (what ``recompute_rest`` may not
        be)."""
        if isinstance(value, RecomputePolicy) and not (rest and (value.full or value.auto)):
            return value
        full, modules, auto = _parse(value, field, rest)
        name = FULL if full else "auto" if auto else _modules_name(modules)
        policy = super().__new__(cls, name)
        for attribute, given in (("full", full), ("modules", modules), ("auto", auto)):
            object.__setattr__(policy, attribute, given)
        return policy

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"RecomputePolicy is immutable; {name} cannot be set")

    def __getnewargs__(self) -> tuple[str]:
        return (str(self),)  # copies and pickles parse the name again

    @classmethod
    def parse(
        cls, value: object, field: str = "recompute", *, rest: bool = False
    ) -> RecomputePolicy:
        """``value`` as a policy (the constructor; a policy is returned as it is)."""
        return cls(value, field, rest=rest)

    @property
    def name(self) -> str:
        """``full``, ``auto``, the preset the modules equal, or the modules joined by ``+``."""
        return str(self)

    @property
    def value(self) -> str | list[str]:
        """The YAML spelling (what checkpoints and ``hparams.yaml`` record): :attr:`name`, or
        the list of modules where no preset equals them."""
        return list(self.modules) if "+" in self else str(self)

    def check_resolved(self, field: str = "recompute") -> RecomputePolicy:
        """This policy, unless it is ``auto``: :class:`ConfigError` (one line) then."""
        if self.auto:
            raise ConfigError(
                f"{field}={self.name!r} must be resolved before layers are built "
                "(lightning_sp.planner.estimate.resolve_recompute; GPTModule does it)"
            )
        return self

    def active(self, attention: str) -> frozenset[str]:
        """The names of its modules that act under the ``attention`` backend."""
        return frozenset(m.name for m in active_modules(self.modules, attention))

    def acts(self, module: str, attention: str) -> bool:
        """Whether the recompute module ``module`` acts in a layer under this policy and the
        ``attention`` backend (``core_attn`` does not where no ``s x s`` tensor is kept)."""
        return module in self.active(attention)

    def __repr__(self) -> str:
        return f"RecomputePolicy({str(self)!r})"


def _modules_name(modules: tuple[str, ...]) -> str:
    """The preset ``modules`` equal, else the modules joined by ``+``."""
    for name, preset in PRESETS.items():
        if preset == modules:
            return name
    return "+".join(modules)


def _parse(value: object, field: str, rest: bool) -> tuple[bool, tuple[str, ...], bool]:
    """``(full, modules, auto)`` of ``value`` (see :class:`RecomputePolicy`)."""
    names = tuple(PRESETS) if rest else (*POLICIES, "auto")
    valid = f"valid: {', '.join(names)} or a list of {', '.join(RECOMPUTE_MODULES)}"
    if isinstance(value, str):
        value = str(value)
        if value in (FULL, "auto"):
            if not rest:
                return value == FULL, (), value == "auto"
            raise ConfigError(
                f"{field}={value!r} cannot be what the layers beyond recompute_num_layers "
                f"run; {valid}"
            )
        if value in PRESETS:
            return False, PRESETS[value], False
        if "+" not in value and value not in RECOMPUTE_MODULES:
            raise ConfigError(f"{field}={value!r} is not a recompute policy; {valid}")
        value = value.split("+")  # one module, or the name of a module set
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
    return False, tuple(name for name in RECOMPUTE_MODULES if name in value), False


NO_RECOMPUTE = RecomputePolicy("none")
"""Store everything (``none``): what a model built only for its shapes or weights runs."""
AUTO = RecomputePolicy("auto")
"""``recompute: auto``, as configured before the planner resolves it."""


def parse_recompute(
    value: object, field: str = "recompute", *, whole: bool = True
) -> LayerRecompute | Literal["auto"]:
    """``value`` (a :data:`RecomputeValue`) as ``"full"``, ``"auto"`` or the module tuple in
    registry order (:meth:`RecomputePolicy.parse`; ``whole=False``: not ``full`` or
    ``auto``)."""
    policy = RecomputePolicy.parse(value, field, rest=not whole)
    if policy.full or policy.auto:
        return "full" if policy.full else "auto"
    return policy.modules


def parse_rest(value: object, field: str = "recompute_rest") -> tuple[str, ...]:
    """``value`` as the module tuple of a policy that can run on the layers of a chunk beyond
    ``recompute_num_layers`` (:meth:`RecomputePolicy.parse` with ``rest``)."""
    return RecomputePolicy.parse(value, field, rest=True).modules


def policy_name(policy: RecomputeValue) -> str:
    """A short name: the preset a module set equals, else the modules joined by ``+``
    (:attr:`RecomputePolicy.name`)."""
    return RecomputePolicy.parse(policy).name


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
