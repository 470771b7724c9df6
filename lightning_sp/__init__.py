"""lightning-sp: tensor, sequence and pipeline parallel GPT training with selective activation
recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys 2023) for PyTorch Lightning.

Importing the package registers the ``"megatron_sp"`` strategy with Lightning.
"""

from lightning_sp.activations import (
    ActivationReport,
    LiveActivationTracker,
    SavedTensorTracker,
    measure_saved_activations,
)
from lightning_sp.errors import ConfigError
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.module import GPTModule, OptimizerConfig
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.strategy import MegatronSPStrategy, register

register()

__all__ = [
    "GPT",
    "ActivationReport",
    "ConfigError",
    "GPTConfig",
    "GPTModule",
    "LiveActivationTracker",
    "MegatronSPStrategy",
    "OptimizerConfig",
    "ParallelState",
    "Pipeline",
    "SavedTensorTracker",
    "measure_saved_activations",
]
