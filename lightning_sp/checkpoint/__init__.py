"""Layout-independent checkpoints on ``torch.distributed.checkpoint`` (DCP).

Every tensor is saved under its identity in the *unsharded, unsplit* model: the parameter's
global name (global layer numbers, :meth:`GPT.global_name`) and the offsets of this rank's
shard inside the full tensor (the :class:`~lightning_sp.parallel.init.ShardSpec` that the
layout-independent init already uses). DCP writes each rank's shards to its own files and
records the global shapes; loading reads, for each shard of the *new* layout, the pieces of
whichever saved shards overlap it. A checkpoint saved with any (t, p, m, d, SP) therefore loads
into any other valid layout: resharding on load, no conversion step.

Keys::

    model.<global name>                 weights, e.g. model.layers.3.mlp.fc1.weight, and
                                        persistent buffers, whole (an MoE router's expert_bias)
    optim.<global name>.<field>         Adam's exp_avg, exp_avg_sq and step, and ``master``
                                        (fp32 master weights of bf16/fp16 models)
    optim.param_groups                  learning rates, betas, ... per parameter group
    rng.pp<p>.dp<d>.tp<t>               one rank's dropout streams and torch RNG state
    lightning                           Lightning's loop, callback, scheduler and datamodule state

and ``meta.json`` beside DCP's files: format version, layout
(:class:`~lightning_sp.parallel.config.ParallelConfig`), step, model config and a
CRC32 of every file (so a truncated or corrupt file is named before anything is read).

The vocabulary is padded to a multiple of ``128·t``, which depends on t: only the true
vocabulary rows are saved, and each layout keeps its own padding rows (which no output depends
on). The tied embedding's copy on the last pipeline stage is not saved; it loads from the one
entry. The distributed optimizer saves, per rank, only the flat ranges it owns, as chunks of the
same ``optim.`` keys (:mod:`.shards`). RNG streams are per rank and restored only into the same
layout; another layout starts its streams from the seed.

Modules: :mod:`.format` (``meta.json``, keys), :mod:`.shards` (global identities of weights and
optimizer state), :mod:`.dcp_planners` (DCP planners with global offsets), :mod:`.verify`
(completeness, checksums, shapes; ``read_full``), :mod:`.checkpointer` (save and load from
every rank, async save), :mod:`.commit` (crash-safe publishing by atomic rename).
"""

from lightning_sp.checkpoint.checkpointer import Checkpointer, CheckpointSaveError
from lightning_sp.checkpoint.format import Meta, rng_key
from lightning_sp.checkpoint.verify import read_full, verify

__all__ = ["CheckpointSaveError", "Checkpointer", "Meta", "read_full", "rng_key", "verify"]
