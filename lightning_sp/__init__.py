"""lightning-sp: tensor, sequence and pipeline parallel GPT training with selective activation
recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys 2023) for PyTorch Lightning.

Importing the package registers the ``"megatron_sp"`` strategy with Lightning. With
``LIGHTNING_SP_LAZY=1`` in the environment it does not import Lightning (about 5 s per process
on a 2-core machine): the model, parallel and memory names load as usual, the Lightning ones
(``GPTModule``, ``MegatronSPStrategy``, ...) on first use, which also registers the strategy.
For processes that need only the model, such as spawned test ranks or a torchrun script.
"""

import os
from importlib import import_module
from typing import TYPE_CHECKING, Any

from lightning_sp.errors import ConfigError
from lightning_sp.memory.saved import (
    ActivationReport,
    LiveActivationTracker,
    SavedTensorTracker,
    measure_saved_activations,
)
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline

if TYPE_CHECKING:
    from lightning_sp.callbacks.memory import ActivationMemoryMonitor
    from lightning_sp.callbacks.model_checkpoint import ModelCheckpoint
    from lightning_sp.callbacks.progress import ProgressBar
    from lightning_sp.callbacks.throughput import MFUMonitor
    from lightning_sp.data import TextDataModule
    from lightning_sp.optim.adamw import OptimizerConfig
    from lightning_sp.training.gpt_module import GPTModule
    from lightning_sp.training.strategy import MegatronSPStrategy

_LIGHTNING_NAMES = {
    "ActivationMemoryMonitor": "lightning_sp.callbacks.memory",
    "TextDataModule": "lightning_sp.data",
    "GPTModule": "lightning_sp.training.gpt_module",
    "ModelCheckpoint": "lightning_sp.callbacks.model_checkpoint",
    "OptimizerConfig": "lightning_sp.optim.adamw",
    "ProgressBar": "lightning_sp.callbacks.progress",
    "MegatronSPStrategy": "lightning_sp.training.strategy",
    "MFUMonitor": "lightning_sp.callbacks.throughput",
}
"""The names that import Lightning, and their modules."""


def _load_lightning_names() -> None:
    """Import the Lightning integration, register ``megatron_sp``, bind its names here."""
    import_module("lightning_sp.training.strategy").register()
    for name, module in _LIGHTNING_NAMES.items():
        globals()[name] = getattr(import_module(module), name)


def __getattr__(name: str) -> Any:
    if name not in _LIGHTNING_NAMES:
        raise AttributeError(f"module 'lightning_sp' has no attribute {name!r}")
    _load_lightning_names()
    return globals()[name]


if os.environ.get("LIGHTNING_SP_LAZY") != "1":
    _load_lightning_names()

__all__ = [
    "GPT",
    "ActivationMemoryMonitor",
    "ActivationReport",
    "ConfigError",
    "GPTConfig",
    "GPTModule",
    "LiveActivationTracker",
    "MFUMonitor",
    "MegatronSPStrategy",
    "ModelCheckpoint",
    "OptimizerConfig",
    "ParallelState",
    "Pipeline",
    "ProgressBar",
    "SavedTensorTracker",
    "TextDataModule",
    "measure_saved_activations",
]
