"""LoRA fine-tuning: the settings (:class:`LoRAConfig`, ``peft``'s names) and which linears of a
model get an adapter (:func:`apply_lora`). The sharded math of an adapter is
:mod:`lightning_sp.parallel.lora`'s.

A model's adaptable linears are the projections of its layers' parts, named as we name them
(``query``, ``key``, ``value``, ``proj``; the MLP's ``fc1`` or ``gate`` and ``up``, and
``fc2``) or as Hugging Face does (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``, GPT-2's ``c_fc`` / ``c_proj``), a target matching
a linear by the last part(s) of its dotted name, as ``peft`` matches ``target_modules``;
``all-linear`` takes every one. The experts of a mixture-of-experts layer take no adapter (a
target naming them is refused in one line; the attention's linears of an MoE model do take
them), and neither does GPT-2's fused ``c_attn`` (one ``A`` shared by query, key and value
in ``peft``; name ``query``, ``key``, ``value`` to adapt them one by one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor, nn

from lightning_sp.errors import ConfigError
from lightning_sp.model.fp8 import refuse_with_lora
from lightning_sp.model.parts.attention import HF_ATTENTION
from lightning_sp.model.parts.dense import HF_MLP
from lightning_sp.model.shape import ActivationShape, AdapterShape
from lightning_sp.parallel.init import initialize_parameter
from lightning_sp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_sp.parallel.lora import Kind, LoRA

if TYPE_CHECKING:
    from lightning_sp.model.config import GPTConfig
    from lightning_sp.model.gpt import GPT

ALL_LINEAR = "all-linear"
"""The target that names every adaptable linear (``peft``'s spelling)."""

ADAPTABLE = {
    "attention": ("query", "key", "value", "proj"),
    "mlp": ("fc1", "gate", "up", "fc2"),
}
"""Per sublayer module, the linears that may take an adapter (those the part has)."""


def _hf_modules() -> dict[str, dict[str, tuple[str, ...]]]:
    """Hugging Face linear names (the last part of the module path) -> each Hugging Face
    module of that name (its path under a layer) -> our paths it holds, from the parts' own
    naming tables (every convention): GPT-2's ``c_attn`` holds three of ours; its ``c_proj``
    names two modules, one of ours each."""
    found: dict[str, dict[str, list[str]]] = {}
    for sub, table in (("attention", HF_ATTENTION), ("mlp", HF_MLP)):
        for names in table.values():
            for ours, theirs in names.items():
                if ours in ADAPTABLE[sub]:
                    module = found.setdefault(theirs.rsplit(".", 1)[-1], {}).setdefault(theirs, [])
                    if f"{sub}.{ours}" not in module:
                        module.append(f"{sub}.{ours}")
    return {k: {m: tuple(p) for m, p in v.items()} for k, v in found.items()}


HF_MODULES = _hf_modules()
"""Hugging Face linear names -> their modules under a layer -> our paths (``q_proj`` ->
``self_attn.q_proj`` -> ``attention.query``)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (``peft``'s LoRA) on a model's linears; the base weights are frozen."""

    r: int = 8
    """The adapters' rank."""

    lora_alpha: float = 16.0
    """The adapters' scaling numerator: the update is ``lora_alpha / r · B A x`` (with
    ``use_rslora``: ``lora_alpha / √r``)."""

    lora_dropout: float = 0.0
    """Dropout on each adapter's input, in [0, 1) (the base linear sees the input undropped)."""

    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])
    """The linears that get an adapter: our names (``query``, ``key``, ``value``, ``proj``,
    ``fc1``, ``gate``, ``up``, ``fc2``, or dotted: ``attention.query``), Hugging Face's
    (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``),
    or ``all-linear``."""

    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by ``lora_alpha / √r`` instead of ``lora_alpha / r``."""

    def validate(self) -> None:
        """:class:`ConfigError` (one line naming the field) for a value out of range."""
        r = self.r
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"lora.r={r!r} must be a positive integer")
        alpha = self.lora_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ConfigError(f"lora.lora_alpha={alpha!r} must be a positive finite number")
        if not math.isfinite(alpha) or alpha <= 0:
            raise ConfigError(f"lora.lora_alpha={alpha!r} must be a positive finite number")
        p = self.lora_dropout
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ConfigError(f"lora.lora_dropout={p!r} must be a finite number in [0, 1)")
        targets = self.target_modules
        if isinstance(targets, str) or not targets or not all(isinstance(t, str) for t in targets):
            raise ConfigError(
                f"lora.target_modules={targets!r} must be a non-empty list of linear names "
                f"(or [{ALL_LINEAR!r}])"
            )
        if not isinstance(self.use_rslora, bool):
            raise ConfigError(f"lora.use_rslora={self.use_rslora!r} must be true or false")

    @property
    def scaling(self) -> float:
        """``lora_alpha / r``, or ``lora_alpha / √r`` with ``use_rslora``."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def adaptable_linears(layer: nn.Module) -> dict[str, ColumnParallelLinear | RowParallelLinear]:
    """The linears of a transformer layer that may take an adapter, by path under the layer
    (``attention.query``, ``mlp.fc2``)."""
    found: dict[str, ColumnParallelLinear | RowParallelLinear] = {}
    for sub, names in ADAPTABLE.items():
        module = getattr(layer, sub, None)
        for name in names:
            linear = getattr(module, name, None) if module is not None else None
            if isinstance(linear, ColumnParallelLinear | RowParallelLinear):
                found[f"{sub}.{name}"] = linear
    return found


def valid_targets(paths: list[str]) -> list[str]:
    """Every target name that matches one of ``paths`` (ours, short and dotted, then Hugging
    Face's), for the error that lists them."""
    ours = [p.split(".")[-1] for p in paths]
    theirs = [
        hf
        for hf, modules in HF_MODULES.items()
        if all(len(m) == 1 for m in modules.values())
        and any(set(m) <= set(paths) for m in modules.values())
    ]
    return sorted(set(ours)) + sorted(set(paths)) + sorted(theirs) + [ALL_LINEAR]


def resolve_targets(targets: list[str], paths: list[str]) -> list[str]:
    """The paths (of ``paths``, a layer's adaptable linears) that ``targets`` name, in layer
    order; :class:`ConfigError` (one line) for a target that matches none, listing the valid
    ones."""
    chosen: set[str] = set()
    for target in targets:
        if target == ALL_LINEAR:
            chosen.update(paths)
            continue
        matched = [p for p in paths if p == target or p.endswith("." + target)]
        if not matched and target in HF_MODULES:
            for mapped in HF_MODULES[target].values():
                if len(mapped) > 1 and set(mapped) <= set(paths):
                    raise ConfigError(
                        f"lora.target_modules: {target!r} is one Hugging Face linear holding "
                        f"{', '.join(mapped)} (peft gives it one A); name those one by one"
                    )
                matched += [p for p in paths if p in mapped]
        if not matched:
            hint = ""
            if "expert" in target or target in ("w1", "w2", "w3", "gate_up_proj"):
                hint = " (the experts of an MoE layer take no adapters)"
            raise ConfigError(
                f"lora.target_modules: {target!r} matches no linear of this model{hint}; "
                f"valid: {', '.join(valid_targets(paths))}"
            )
        chosen.update(matched)
    return [p for p in paths if p in chosen]


def check_lora(config: LoRAConfig, model: GPTConfig) -> list[str]:
    """Everything :func:`apply_lora` checks, before any work: the settings, and that each
    target names a linear of ``model``'s layers (a one-layer model on the ``meta`` device
    answers). Returns the adapted linears' paths under a layer."""
    from lightning_sp.model.gpt import GPT
    from lightning_sp.model.recompute import NO_RECOMPUTE
    from lightning_sp.parallel.state import ParallelState

    config.validate()
    refuse_with_lora(model)
    one = dataclasses.replace(model, num_layers=1, recompute=NO_RECOMPUTE, sequence_parallel=False)
    layer = GPT(one, ParallelState.single(), device="meta").layers[0]
    return resolve_targets(list(config.target_modules), list(adaptable_linears(layer)))


def adapter_shape(config: LoRAConfig, model: GPTConfig) -> AdapterShape:
    """The record the memory formulas read for ``config``'s adapters on ``model``'s layers
    (``ActivationShape.lora``; checked as :func:`check_lora` checks)."""
    targets = frozenset(check_lora(config, model))
    return AdapterShape(config.r, targets, config.lora_dropout > 0)


def with_adapters(
    shape: ActivationShape, config: LoRAConfig | None, model: GPTConfig
) -> ActivationShape:
    """``shape`` with ``config``'s adapters (``shape`` itself for ``config=None``: a full
    fine-tune)."""
    if config is None:
        return shape
    return dataclasses.replace(shape, lora=adapter_shape(config, model))


def _require_input_grad(module: nn.Module, inputs: object, output: Tensor) -> Tensor:
    """A frozen embedding's output made to require a gradient, so that the layers' recompute
    regions (which take only their inputs) see a graph to run back through to the adapters."""
    if output.is_floating_point() and not output.requires_grad and output.grad_fn is None:
        return output.requires_grad_(True)
    return output


def apply_lora(model: GPT, config: LoRAConfig) -> list[str]:
    """Freeze every parameter of ``model`` (one rank's shard) and attach an adapter to each
    linear ``config.target_modules`` names, in every layer it holds, sharded as the linear is
    (:class:`~lightning_sp.parallel.lora.LoRA`) and initialised from the model's seed as
    ``peft`` initialises (``A`` kaiming-uniform, ``B`` zero), the same in every layout.
    Returns the adapted linears' global names (``layers.0.attention.query``)."""
    config.validate()
    refuse_with_lora(model.config)
    layers = list(model.layers)
    paths = list(adaptable_linears(layers[0])) if layers else []
    chosen = resolve_targets(list(config.target_modules), paths)
    for param in model.parameters():
        param.requires_grad_(False)
    t = model.state.tensor_parallel_size
    adapted = []
    for index, layer in enumerate(layers):
        linears = adaptable_linears(layer)
        for path in chosen:
            linear = linears[path]
            kind: Kind = "column" if isinstance(linear, ColumnParallelLinear) else "row"
            adapter = LoRA(kind, linear.weight, config.r, config.scaling, config.lora_dropout, t)
            adapter.rng = model.rng
            linear.lora = adapter
            name = model.global_name(f"layers.{index}.{path}")
            for which in ("A", "B"):
                initialize_parameter(
                    getattr(adapter, which), f"{name}.lora.{which}", model.config.seed
                )
            adapted.append(name)
    if model.has_embedding:
        model.word_embeddings.register_forward_hook(_require_input_grad)
    return adapted


def lora_parameters(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' parameters of ``model`` by name (what a LoRA run trains and saves)."""
    return {n: p for n, p in model.named_parameters() if getattr(p, "lora", False)}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside: every linear of ``model`` runs without its LoRA adapter, i.e. the frozen base
    (``peft``'s ``disable_adapter()``): a DPO reference with no second copy of the weights.
    The adapters are detached from their linears and put back on exit, untouched."""
    held = [
        (linear, linear.lora)
        for linear in model.modules()
        if isinstance(linear, ColumnParallelLinear | RowParallelLinear) and linear.lora is not None
    ]
    for linear, _ in held:
        linear.lora = None
    try:
        yield
    finally:
        for linear, adapter in held:
            linear.lora = adapter
