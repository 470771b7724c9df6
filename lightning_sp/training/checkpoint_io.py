"""What ``MegatronSPStrategy``'s checkpoint hooks do with Lightning's checkpoint dict, on every
rank: save it beside the live module's and optimizers' tensors as one layout-independent
checkpoint (:class:`~lightning_sp.checkpoint.Checkpointer`), and load it back in place into
any layout.

Lightning's ``state_dict`` and ``optimizer_states`` are never materialised: the weights and
optimizer state are read from (and loaded into) the live objects. The RNG streams a module
hands in as ``rng_streams`` are saved with this process's torch RNG state under this rank's
key (:func:`rank_rng_key`), and come back only into the layout that saved them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from lightning_sp.checkpoint import Checkpointer, Meta, rng_key
from lightning_sp.checkpoint.shards import gpt_chunks
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.state import ParallelState


def model_config_of(module: LightningModule) -> dict[str, Any]:
    """The model config a checkpoint records (its first GPT chunk's; ``{}`` for a module
    without one)."""
    chunks = gpt_chunks(module)
    return chunks[0].config.values() if chunks else {}


def rank_rng_key(state: ParallelState) -> str:
    """The key of this rank's RNG state in a checkpoint (its CP rank only under CP)."""
    cp_rank = state.context_parallel_rank if state.context_parallel_size > 1 else None
    return rng_key(
        state.pipeline_parallel_rank, state.data_parallel_rank, state.tensor_parallel_rank,
        cp_rank,
    )  # fmt: skip


def save_lightning_checkpoint(
    checkpointer: Checkpointer,
    module: LightningModule,
    optimizers: list[Optimizer],
    checkpoint: dict[str, Any],
    path: Path,
    layout: ParallelConfig,
    state: ParallelState,
) -> None:
    """Write ``checkpoint`` (Lightning's, less its ``state_dict`` and ``optimizer_states``)
    with ``module``'s weights and ``optimizers``' state to ``path`` (the same on every
    rank)."""
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    streams = {"streams": checkpoint.pop("rng_streams", None), "torch": torch.get_rng_state()}
    meta = Meta(checkpoint.get("global_step", 0), layout, model_config_of(module))
    checkpointer.save(
        path,
        module,
        optimizers,
        meta=meta,
        lightning_state=checkpoint,
        rng=(rank_rng_key(state), streams),
    )


def load_lightning_checkpoint(
    checkpointer: Checkpointer,
    module: LightningModule,
    optimizers: list[Optimizer],
    checkpoint_path: str | Path,
    layout: ParallelConfig,
    state: ParallelState,
) -> dict[str, Any]:
    """Load weights, persistent buffers and optimizer state in place (any saved layout) and
    return Lightning's state, with this rank's ``rng_streams`` (restoring the torch RNG
    state). A checkpoint without the model's buffers (MoE router biases, before they were
    saved) loads them as zero, with one notice line."""
    checkpoint = checkpointer.load(
        Path(checkpoint_path),
        module,
        optimizers,
        layout=layout,
        model_config=model_config_of(module),
        rng_name=rank_rng_key(state),
    )
    missing = checkpoint.pop("missing_buffers", [])
    if missing:
        rank_zero_info(
            f"{checkpoint_path} holds no {missing[0]}"
            + (f" (nor {len(missing) - 1} more buffers)" if len(missing) > 1 else "")
            + ": saved before checkpoints held MoE router biases; they start at zero"
        )
    streams = checkpoint.pop("rng_streams", None) or {}
    if streams.get("torch") is not None:
        torch.set_rng_state(streams["torch"])
    checkpoint["rng_streams"] = streams.get("streams")
    checkpoint["optimizer_states"] = []  # loaded in place; Lightning checks the key
    return checkpoint
