"""``torch.compile`` per transformer layer (torchtitan's granularity): how a run compiles.

:class:`CompileOptions` is a run setting (how the layers compute, not what the weights mean):
the backend, the inductor mode, ``fullgraph`` and ``dynamic``, checked once
(:meth:`CompileOptions.validate` for the values, :func:`check_compile_options` against the
model and the device, before any step) and applied by :func:`compile_layers`.

Measured on CPU (torch 2.13, ``torch._dynamo.explain`` of one layer): with dropout 0 and
``recompute: none`` a layer is one graph at t=1 and at t=2 with sequence parallelism (our
autograd functions and their collectives trace without a break); the recompute modules'
RNG snapshot (``Generator.get_state``) breaks the graph at each recompute region
(``selective``: 4 graphs, ``lean``: 6; ``full``: 1 at t=1, 4 at t=2 + SP), and every dropout
that draws from our streams is a break as well (8 to 10 breaks at dropout 0.1). So
``fullgraph=True`` is honoured only with no dropout and ``recompute: none`` (refused
otherwise, in one line, before any step).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import nn

from lightning_sp.errors import ConfigError

INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``torch.compile``'s modes (inductor's)."""

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes that capture CUDA graphs (a CUDA device only)."""


@dataclasses.dataclass
class CompileOptions:
    """How ``compile_layers`` compiles each transformer layer (``torch.compile``'s arguments).

    Set only with ``compile_layers: true``; each field is checked before any step.
    """

    backend: str = "inductor"
    """A ``torch.compile`` backend (``torch._dynamo.list_backends``, plus the debugging
    ``eager`` / ``aot_eager``): ``inductor`` generates kernels (C++ on CPU, Triton on
    CUDA); ``aot_eager`` traces forward and backward without generating code."""
    mode: str = "default"
    """Inductor's mode: ``default``, ``reduce-overhead`` (CUDA graphs), ``max-autotune``
    (autotuned GEMMs, CUDA graphs) or ``max-autotune-no-cudagraphs``. Other backends take
    ``default`` only; the CUDA-graph modes need a CUDA device."""
    fullgraph: bool = False
    """Fail rather than break a layer into several graphs. Honoured only with hidden and
    attention dropout 0 and ``recompute: none`` on every layer (the measured cases that trace
    as one graph; see the module docstring)."""
    dynamic: bool = False
    """Compile for dynamic shapes (``True``) rather than the first batch's (``False``: a new
    shape, e.g. a shorter last batch, compiles once more)."""

    def validate(self, enabled: bool = True) -> None:
        """Every field's value, one line per failure (:class:`ConfigError`); with
        ``enabled=False`` (``compile_layers`` off) any field set away from its default is
        the failure (it would be ignored)."""
        if not enabled:
            default = CompileOptions()
            for field in dataclasses.fields(self):
                value = getattr(self, field.name)
                if value != getattr(default, field.name):
                    raise ConfigError(
                        f"compile_options.{field.name}={value!r} is set but compile_layers is "
                        "false; set compile_layers=true or leave compile_options at defaults"
                    )
            return
        for name in ("fullgraph", "dynamic"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"compile_options.{name}={getattr(self, name)!r} is invalid; "
                    "it must be true or false"
                )
        if self.mode not in INDUCTOR_MODES:
            raise ConfigError(
                f"compile_options.mode={self.mode!r} is invalid; valid: {', '.join(INDUCTOR_MODES)}"
            )
        backends = _backends()
        if self.backend not in backends:
            raise ConfigError(
                f"compile_options.backend={self.backend!r} is not a torch.compile backend; "
                f"valid: {', '.join(backends)}"
            )
        if self.mode != "default" and self.backend != "inductor":
            raise ConfigError(
                f"compile_options.mode={self.mode!r} applies to backend 'inductor' only, not "
                f"{self.backend!r}; use mode 'default' or backend 'inductor'"
            )


def _backends() -> list[str]:
    """``torch.compile``'s registered backends, the debugging ones included."""
    import torch._dynamo

    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"eager", "aot_eager"})


class LayerSettings(Protocol):
    """What the fullgraph check reads of a model's config."""

    hidden_dropout: float
    attention_dropout: float
    num_layers: int

    def layer_recompute(self, index_in_chunk: int) -> object: ...


def check_compile_options(
    options: CompileOptions, config: LayerSettings, device: torch.device
) -> None:
    """Raise :class:`ConfigError` (one line) where ``options`` cannot be honoured for this
    model on ``device``: a CUDA-graph mode off CUDA, ``fullgraph`` with a graph break the
    layers are known to have (dropout, a recompute region). (Inductor's compiler, a C++
    compiler on CPU or Triton on CUDA: :func:`~lightning_sp.training.checks.check_compile`.)"""
    if options.mode in CUDA_GRAPH_MODES and device.type != "cuda":
        valid = [m for m in INDUCTOR_MODES if m not in CUDA_GRAPH_MODES]
        raise ConfigError(
            f"compile_options.mode={options.mode!r} captures CUDA graphs and the device is "
            f"{device.type!r}; valid there: {', '.join(valid)}"
        )
    if options.fullgraph:
        for field in ("hidden_dropout", "attention_dropout"):
            if getattr(config, field):
                raise ConfigError(
                    f"compile_options.fullgraph=true with {field}={getattr(config, field)}: "
                    "each dropout on our RNG streams breaks the graph; set fullgraph=false "
                    "or the dropout to 0"
                )
        for index in range(config.num_layers):
            policy = config.layer_recompute(index)
            if getattr(policy, "full", False) or getattr(policy, "modules", ()):
                name = getattr(policy, "name", policy)
                raise ConfigError(
                    f"compile_options.fullgraph=true with recompute {name!r} on layer {index}: "
                    "a recompute region's RNG snapshot breaks the graph; set fullgraph=false "
                    "or recompute 'none'"
                )


def compile_layers(layers: nn.ModuleList | list[nn.Module], options: CompileOptions) -> None:
    """``torch.compile`` each of ``layers`` in place (``nn.Module.compile``) with
    ``options``; the layers' calls run compiled from the next call on."""
    kwargs: dict[str, object] = {
        "backend": options.backend,
        "fullgraph": options.fullgraph,
        "dynamic": options.dynamic,
    }
    if options.mode != "default":
        kwargs["mode"] = options.mode
    for layer in layers:
        layer.compile(**kwargs)
