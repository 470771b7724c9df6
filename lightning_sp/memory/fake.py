"""One rank's activation bytes measured at full scale without the memory.

:func:`measure_activations`: one rank's shard of the real :class:`GPT` — rank 0,
i.e. tensor-parallel rank 0 on the first pipeline stage — is built under ``FakeTensorMode``
with a ``"fake"`` process group of the full world size, and run forward in training mode
under :class:`SavedTensorTracker`. The bytes are what the model's own autograd graph saves;
no formula enters that path. A 175B-parameter shard traces in well under a second, in no
memory.

Every private torch import of the package lives in this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from lightning_sp.errors import ConfigError
from lightning_sp.memory.saved import UNTRACKED, SavedTensorTracker
from lightning_sp.model.config import GPTConfig
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.state import ParallelState


@dataclass
class ActivationMeasurement:
    """Activation bytes measured on rank 0's shard of the real model, for one micro-batch."""

    per_layer_bytes: list[int] = field(default_factory=list)
    """Bytes each traced transformer layer saved for backward (parameters excluded)."""

    embedding_bytes: int = 0
    """Bytes the input embedding saved (dropout mask, token ids)."""

    head_bytes: int | None = None
    """Bytes the final LayerNorm, output layer and loss saved (``None``: not traced)."""

    @property
    def bytes_per_layer(self) -> int:
        """The largest per-layer figure among the traced layers (all are equal in practice)."""
        return max(self.per_layer_bytes)


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """Make this process rank 0 of a ``world_size`` world on the ``"fake"`` backend, whose
    collectives do nothing, and tear it down on exit.

    Refuses to run when a default process group already exists (it would be replaced).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError(
            "cannot measure under a fake process group: torch.distributed is already "
            "initialised in this process (measure before init_process_group, or use the formulas)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fake_parameters(module: nn.Module) -> None:
    """Replace every (meta) parameter and buffer of ``module`` by a CPU fake tensor of the same
    shape, dtype and attributes. Call under ``FakeTensorMode``."""
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if param is None:
                continue
            fake = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device="cpu"),
                requires_grad=param.requires_grad,
            )
            fake.__dict__.update(param.__dict__)  # shard / init / sequence_parallel tags
            mod._parameters[name] = fake
        for name, buf in list(mod._buffers.items()):
            if buf is not None:
                mod._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device="cpu")


def _trace(
    config: GPTConfig,
    state: ParallelState,
    micro_batch_size: int,
    layers: int,
    head: bool,
    dtype: torch.dtype,
) -> ActivationMeasurement:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_sp.model.gpt import GPT

    b, t, c = micro_batch_size, state.tensor_parallel_size, state.context_parallel_size
    s = config.seq_length // c  # this rank's tokens of each sequence
    # built on "meta" so that no initialisation runs (initialize_parameter skips meta; under
    # fake tensors its row-by-row loop takes ~30 s for one 175B layer), then made fake
    gpt = GPT(config, state, layer_range=range(0, layers), dtype=dtype, device="meta")
    last = config.num_layers
    tail = (
        GPT(config, state, layer_range=range(last - 1, last), dtype=dtype, device="meta")
        if head
        else None
    )
    result = ActivationMeasurement()
    with FakeTensorMode():
        _fake_parameters(gpt)
        gpt.train()
        ids = torch.zeros(b, s, dtype=torch.long)
        with SavedTensorTracker.for_model(gpt) as tracker:
            out = gpt.forward_layers(gpt.embed(ids))
        report = tracker.report
        result.per_layer_bytes = [report.bytes_of(f"layers.{i}") for i in range(layers)]
        result.embedding_bytes = report.bytes_of(UNTRACKED)
        del out
        if tail is not None:
            _fake_parameters(tail)
            tail.train()
            shard = s // t if config.sequence_parallel else s
            x = torch.empty(shard, b, config.hidden_size, dtype=dtype, requires_grad=True)
            with SavedTensorTracker(exclude=list(tail.parameters())) as tracker:
                loss = tail.loss(x, ids)
            result.head_bytes = tracker.report.total_bytes
            del loss
    return result


ONE_PROCESS = ParallelConfig()
"""The layout of one process (t = c = p = d = 1)."""


def measure_activations(
    config: GPTConfig,
    layout: ParallelConfig = ONE_PROCESS,
    *,
    micro_batch_size: int = 1,
    layers: int = 1,
    head: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> ActivationMeasurement:
    """Measure, for one micro-batch, the activation bytes rank 0 of the ``t × c × p × d`` ``layout``
    saves (under context parallelism ``c`` it holds ``s/c`` tokens of each sequence, CP rank
    0's two chunks, and runs the CP attention core, whose collectives the fake group skips):
    per transformer layer (the first ``layers`` layers, traced in training mode with the
    config's dropout and recompute policy), for the embedding, and with ``head`` for the final
    LayerNorm + output layer + loss (traced on a separate last-layer shard). ``attention:
    sdpa`` is traced without attention dropout: the fused CUDA kernels store the same tensors
    with dropout as without (their RNG seed and offset aside), while the CPU kernel would
    fall back to a math path storing ``s x s`` scores.

    Runs under ``FakeTensorMode`` and a fake process group of ``t·c·p·d`` ranks (see
    :func:`fake_world`): costs no activation memory and no weight initialisation; needs
    ``torch.distributed`` not to be initialised in this process.
    """
    if not 1 <= layers <= config.num_layers:
        raise ConfigError(f"layers={layers} must be between 1 and num_layers={config.num_layers}")
    config = config.for_measurement()  # balanced routing, read from no fake tensor
    if config.attention == "sdpa":
        # traced as the fused kernel: on CPU, SDPA with dropout leaves it for a math fallback
        # that stores s x s scores, which the GPUs the plan is for do not (their flash /
        # memory-efficient kernels draw dropout inside and store the same tensors as without)
        config = replace(config, attention_dropout=0.0)
    with fake_world(layout.world_size):  # e: the EP regroup's indices
        state = ParallelState.from_config(layout, device="cpu")
        return _trace(config, state, micro_batch_size, layers, head, dtype)
