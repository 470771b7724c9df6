"""lightning-sp: tensor, sequence and pipeline parallel GPT training with selective activation
recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys 2023) for PyTorch Lightning."""

from lightning_sp.activations import ActivationReport, SavedTensorTracker, measure_saved_activations
from lightning_sp.errors import ConfigError
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.state import ParallelState

__all__ = [
    "GPT",
    "ActivationReport",
    "ConfigError",
    "GPTConfig",
    "ParallelState",
    "SavedTensorTracker",
    "measure_saved_activations",
]
