"""lightning-sp: tensor, sequence and pipeline parallel GPT training with selective activation
recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys 2023) for PyTorch Lightning.

Importing the package registers the ``"megatron_sp"`` strategy with Lightning.
"""

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
from lightning_sp.training.callbacks import ActivationMemoryMonitor
from lightning_sp.training.data import TextDataModule
from lightning_sp.training.module import GPTModule, OptimizerConfig
from lightning_sp.training.progress import ProgressBar
from lightning_sp.training.strategy import MegatronSPStrategy, register
from lightning_sp.training.throughput import MFUMonitor

register()

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
    "OptimizerConfig",
    "ParallelState",
    "Pipeline",
    "ProgressBar",
    "SavedTensorTracker",
    "TextDataModule",
    "measure_saved_activations",
]
