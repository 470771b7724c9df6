"""What the benchmarks that train our GPT share: the GPT's shape, a seeded batch, a timed step
(also between device synchronisations) and the bytes its layers keep; and for
:mod:`benchmarks.fit_overhead` (also :mod:`benchmarks.gpu`'s ``fit`` section) ``cli.py fit``'s
arguments, a plain loop's step over the same ``GPTModule``, and the split of a profiled fit
step into its parts."""

from __future__ import annotations

import collections
import cProfile
import dataclasses
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._stats import device_sync
from lightning_sp.memory.saved import SavedTensorTracker
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.optim.adamw import configure_adamw
from lightning_sp.training.gpt_module import GPTModule


@dataclasses.dataclass(frozen=True)
class Shape:
    """The GPT measured: ``s`` sequence, ``h`` hidden, ``layers``, ``heads``, ``vocab``, ``b``."""

    s: int
    h: int
    layers: int
    heads: int
    vocab: int
    b: int

    def config(self, recompute: str = "none", dropout: float = 0.1, **fields: Any) -> GPTConfig:
        """:func:`gpt_config` of this shape."""
        return gpt_config(self.vocab, self.s, self.h, self.layers, self.heads, recompute, dropout,
                          **fields)  # fmt: skip


def gpt_config(
    vocab: int, s: int, h: int, layers: int, heads: int, recompute: str = "none",
    dropout: float = 0.1, **fields: Any,
) -> GPTConfig:  # fmt: skip
    """Our GPT of these sizes, ``dropout`` on the hidden states and the attention probabilities,
    ``recompute`` the policy's name, and ``fields`` (``sequence_parallel``, ``attention`` ...)."""
    return GPTConfig(vocab_size=vocab, seq_length=s, hidden_size=h, num_layers=layers,
                     num_heads=heads, hidden_dropout=dropout, attention_dropout=dropout,
                     recompute=RecomputePolicy.parse(recompute), **fields)  # fmt: skip


FULL = Shape(s=2048, h=2048, layers=24, heads=16, vocab=51200, b=4)
"""The 1.2B GPT of the GPU benchmarks (:mod:`benchmarks.gpu`, :mod:`benchmarks.fp8_step`)."""


def batch(
    vocab: int, b: int, s: int, device: torch.device | None = None, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """Seeded token ids ``[b, s]`` and their next-token labels, on ``device``."""
    tokens = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def train_step(model: nn.Module, ids: Tensor, labels: Tensor) -> None:
    """Forward and backward of ``model``'s loss, then its gradients dropped: one timed step."""
    model(ids, labels).backward()
    model.zero_grad(set_to_none=True)


def layer_step(
    layer: nn.Module, x: Tensor, grad: Tensor, batch_first: bool = False
) -> tuple[Tensor, Tensor]:
    """Forward of a fresh leaf ``x`` ``[s, b, h]`` through ``layer`` (``[b, s, h]`` with
    ``batch_first``, as transformers' blocks take), backward of ``grad``, the parameters'
    gradients dropped first: ``(output, input gradient)`` in ``x``'s layout."""
    for param in layer.parameters():
        param.grad = None
    leaf = (x.transpose(0, 1) if batch_first else x).detach().requires_grad_()
    out = layer(leaf)
    out.backward(grad.transpose(0, 1) if batch_first else grad)
    assert leaf.grad is not None
    if batch_first:
        return out.detach().transpose(0, 1), leaf.grad.transpose(0, 1)
    return out.detach(), leaf.grad


def held_per_layer(model: nn.Module, ids: Tensor, labels: Tensor) -> tuple[list[int], Tensor]:
    """The bytes each of ``model.layers`` keeps for backward in one forward
    (:class:`~lightning_sp.memory.saved.SavedTensorTracker`), and that forward's loss."""
    with SavedTensorTracker.for_model(model) as tracker:
        loss = model(ids, labels)
    layers = len(model.layers)  # type: ignore[arg-type]
    return [tracker.report.bytes_of(f"layers.{i}") for i in range(layers)], loss


def seconds_per_step(
    step: Callable[[], None], device: torch.device, warmup: int, steps: int
) -> float:
    """Mean seconds of ``step`` over ``steps`` calls after ``warmup`` (two syncs in all)."""
    for _ in range(warmup):
        step()
    sync = device_sync(device)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def fit_argv(
    shape: Shape, recompute: str, dropout: float, accelerator: str, precision: str, steps: int
) -> list[str]:
    """``cli.py fit``'s arguments for ``shape`` on one device, no checkpoints, no validation,
    ``log_every_n_steps: 10``, with the activation-memory and MFU monitors."""
    return [
        f"--model.config.vocab_size={shape.vocab}", f"--model.config.seq_length={shape.s}",
        f"--model.config.hidden_size={shape.h}", f"--model.config.num_layers={shape.layers}",
        f"--model.config.num_heads={shape.heads}", f"--model.config.recompute={recompute}",
        f"--model.config.hidden_dropout={dropout}", f"--model.config.attention_dropout={dropout}",
        f"--data.batch_size={shape.b}", f"--trainer.accelerator={accelerator}",
        "--trainer.devices=1", "--trainer.strategy=megatron_sp",
        f"--trainer.precision={precision}", f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_checkpointing=false", "--trainer.log_every_n_steps=10",
        "--trainer.callbacks+=lightning_sp.ActivationMemoryMonitor",
        "--trainer.callbacks+=lightning_sp.MFUMonitor",
    ]  # fmt: skip


def plain_step(
    config: GPTConfig, total: int, device: torch.device, dtype: torch.dtype,
    optimizer_step: bool = True,
) -> Callable[[dict[str, torch.Tensor]], None]:  # fmt: skip
    """A plain loop's step over a seeded ``GPTModule`` (t = p = 1) built in ``dtype`` on
    ``device``: forward and backward of a batch, then (``optimizer_step``) the module's AdamW
    step and schedule step (``total`` steps) and ``zero_grad``, else only ``zero_grad``."""
    module = GPTModule(config).to(device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as precision="bf16-true" builds it
    try:
        module.configure_model()
    finally:
        torch.set_default_dtype(default)
    (gpt,) = module.chunks  # t = p = 1: one GPT chunk
    optimizers = configure_adamw(gpt, module.optimizer_config, total)
    optimizer, schedule = optimizers["optimizer"], optimizers["lr_scheduler"]
    scheduler = schedule["scheduler"] if isinstance(schedule, dict) else schedule

    def step(batch: dict[str, torch.Tensor]) -> None:
        ids = batch["input_ids"].to(device, non_blocking=True)
        gpt(ids, batch["labels"].to(device, non_blocking=True)).backward()
        if optimizer_step:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        else:
            gpt.zero_grad(set_to_none=True)

    return step


# -- the profile's parts -----------------------------------------------------------------------

PARTS: dict[str, tuple[str, ...]] = {
    "forward": ("training_step",),
    "backward": ("backward",),
    "gradient finalisation": ("finalize_grads",),
    "non-finite guard": ("check",),
    "clipping": ("configure_gradient_clipping",),
    "routing metrics / token mean": ("on_before_optimizer_step",),
    "data loading": ("__next__",),
    "logging": ("log", "on_batch_end", "update_train_step_metrics"),
}
"""Each part: function names whose cumulative time it is, matched with the file below."""

_FILES: dict[str, tuple[str, ...]] = {
    "forward": ("lightning_sp/training/gpt_module.py",),
    "backward": ("lightning_sp/training/optimizer_hooks.py",),
    "gradient finalisation": ("lightning_sp/pipeline/stages.py", "lightning_sp/parallel/grads.py"),
    "non-finite guard": ("lightning_sp/runtime/guard.py",),
    "clipping": ("lightning_sp/training/optimizer_hooks.py",),
    "routing metrics / token mean": ("lightning_sp/training/optimizer_hooks.py",),
    "data loading": ("lightning/pytorch/loops/fetchers.py",),
    "logging": ("lightning/pytorch/core/module.py", "logger_connector/logger_connector.py"),
}
"""Where each part's functions live (path fragments, ``/``-separated)."""
_CALLBACKS = ("lightning_sp/callbacks/", "lightning/pytorch/callbacks/progress/")


def _in_callbacks(filename: str) -> bool:
    return any(c in filename.replace(os.sep, "/") for c in _CALLBACKS)


def profile_parts(profile: cProfile.Profile, steps: int, wall: float) -> dict[str, float]:
    """Seconds per step of each part of :data:`PARTS`, the optimizer update (the optimizer's
    ``step`` less the closure it runs: Lightning's hooks before the step and clipping), the
    callbacks' hooks, and the rest of the whole step (``wall`` seconds over ``steps`` profiled
    steps)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    cumulative: dict[tuple[str, str], float] = collections.defaultdict(float)
    callbacks = 0.0
    for (filename, _line, name), (_cc, _nc, _tt, ct, callers) in stats.items():
        path = filename.replace(os.sep, "/")
        cumulative[(path, name)] += ct
        # a callback's hook, counted once: not again where another of these hooks called it
        hook = any(c in path for c in _CALLBACKS) and name.startswith("on_")
        if hook and not any(_in_callbacks(caller[0]) for caller in callers):
            callbacks += ct

    def seconds(fragment: str, name: str) -> float:
        return sum(v for (path, n), v in cumulative.items() if n == name and fragment in path)

    parts = {
        part: sum(seconds(f, n) for f in _FILES[part] for n in names)
        for part, names in PARTS.items()
    }
    parts["optimizer update"] = seconds("lightning_sp/optim/adamw.py", "step") - seconds(
        "lightning/pytorch/plugins/precision/precision.py", "_wrap_closure"
    )
    parts["callbacks"] = callbacks
    parts["rest (Lightning's loop and hooks)"] = wall - sum(parts.values())
    parts["step"] = wall
    return {k: v / steps for k, v in parts.items()}
