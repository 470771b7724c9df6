"""Random-number streams for dropout, and dropout with a 1-byte mask.

Two streams per rank (paper §4.2.2, Megatron's "model-parallel RNG"):

* ``replicated``: seeded identically on every rank of a tensor-parallel group. Dropout on a
  tensor that is replicated over the group (the residual dropouts without sequence
  parallelism, the embedding dropout) must draw the same mask everywhere, or the replicas
  diverge.
* ``sharded``: seeded differently per tensor-parallel rank. Dropout on a tensor whose shards
  differ per rank (attention probabilities in the TP region; every dropout under sequence
  parallelism) must draw independent masks, or the shards are correlated.

Both depend on the pipeline and data-parallel coordinates, so replicas see independent masks,
and under context parallelism (``c > 1``) on the context-parallel rank too: CP ranks hold
different tokens, so even the ``replicated`` stream (identical over TP only) must differ
between them. With ``c = 1`` the seeds are those of a layout without CP.
Recomputation snapshots and restores both streams, which replays identical masks.

The generators live on the device of the tensors they draw for (``ParallelState.device``; a
CUDA generator for CUDA activations), so drawing a mask never crosses devices. A state built
for the ``meta`` device (deferred initialisation) gets CPU generators.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_sp.parallel.state import ParallelState


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that is a stable function of ``parts`` (not Python's salted ``hash``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def default_generator(device: torch.device) -> torch.Generator:
    """The generator torch's own random ops draw from on ``device``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    if device.type == "cpu":
        return torch.default_generator
    raise ValueError(f"no default generator to swap on a {device.type} device")


@contextmanager
def drawing_from(generator: torch.Generator) -> Iterator[None]:
    """Inside the block, torch's default generator of ``generator``'s device *is* ``generator``:
    random ops that take no generator (``scaled_dot_product_attention``'s dropout) draw from it,
    and ``generator`` advances by what they drew; the default generator's own state is
    restored on exit. As Megatron's CUDA RNG tracker, this only swaps generator states, which
    live on the host for CPU and CUDA generators alike: no device synchronisation (drawing a
    seed from a CUDA generator would be one)."""
    default = default_generator(generator.device)
    saved = default.get_state()
    default.set_state(generator.get_state())
    try:
        yield
        generator.set_state(default.get_state())
    finally:
        default.set_state(saved)


class RNGStreams:
    """The ``replicated`` and ``sharded`` dropout generators of one rank."""

    def __init__(self, seed: int, state: ParallelState, chunk: int = 0) -> None:
        """``chunk`` tells apart the model chunks one rank holds under an interleaved pipeline
        schedule (the chunk's first layer index serves)."""
        device = state.device if state.device.type != "meta" else torch.device("cpu")
        self.device = device
        pp, dp, tp = (
            state.pipeline_parallel_rank,
            state.data_parallel_rank,
            state.tensor_parallel_rank,
        )
        # the CP coordinate joins the seeds only when there is one (c = 1 keeps old streams)
        cp = (state.context_parallel_rank,) if state.context_parallel_size > 1 else ()
        self.replicated = torch.Generator(device=device)
        self.replicated.manual_seed(derive_seed(seed, "replicated", pp, dp, chunk, *cp))
        self.sharded = torch.Generator(device=device)
        self.sharded.manual_seed(derive_seed(seed, "sharded", pp, dp, tp, chunk, *cp))

    def get_state(self) -> tuple[Tensor, Tensor]:
        """Snapshot both generators (a copy, safe to keep)."""
        return self.replicated.get_state(), self.sharded.get_state()

    def set_state(self, states: tuple[Tensor, Tensor]) -> None:
        """Restore both generators from :meth:`get_state`."""
        self.replicated.set_state(states[0])
        self.sharded.set_state(states[1])

    def state_dict(self) -> dict[str, Tensor]:
        return {"replicated": self.replicated.get_state(), "sharded": self.sharded.get_state()}

    def load_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Restore from :meth:`state_dict`; a state saved by a generator of another device type
        (CPU's Mersenne Twister vs CUDA's Philox) cannot be restored and raises ``ValueError``."""
        expected = self.replicated.get_state().numel()
        saved = state_dict["replicated"].numel()
        if saved != expected:
            raise ValueError(
                f"rng_streams hold a {saved}-byte generator state; this rank's {self.device.type} "
                f"generators take {expected} bytes: resume on the device type they were saved on"
            )
        self.set_state((state_dict["replicated"], state_dict["sharded"]))


class _Dropout(torch.autograd.Function):
    """Inverted dropout that saves only a ``bool`` mask (1 byte per element).

    ``F.dropout`` on CPU saves a 2-byte noise tensor; the paper counts 1 byte.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float, generator: torch.Generator) -> Tensor:
        keep = 1.0 - p
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        mask.bernoulli_(keep, generator=generator)
        ctx.scale = 1.0 / keep
        ctx.save_for_backward(mask)
        return torch.mul(x, mask).mul_(ctx.scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return torch.mul(grad, mask).mul_(ctx.scale), None, None


class _RegeneratedDropout(torch.autograd.Function):
    """Inverted dropout that stores no mask: it keeps the generator's state from before the
    draw (a few bytes on CUDA, 5 KB for the CPU Mersenne twister, whatever the tensor size)
    and draws the identical mask again in backward from a private generator set to that
    state. The stream advances exactly as :class:`_Dropout`'s, so both give the same masks."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float, generator: torch.Generator) -> Tensor:
        keep = 1.0 - p
        ctx.rng_state, ctx.keep, ctx.shape = generator.get_state(), keep, x.shape
        ctx.device = generator.device
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        mask.bernoulli_(keep, generator=generator)
        return torch.mul(x, mask).mul_(1.0 / keep)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        replay = torch.Generator(device=ctx.device)
        replay.set_state(ctx.rng_state)
        mask = torch.empty(ctx.shape, dtype=torch.bool, device=grad.device)
        mask.bernoulli_(ctx.keep, generator=replay)
        return torch.mul(grad, mask).mul_(1.0 / ctx.keep), None, None


def dropout(
    x: Tensor,
    p: float,
    generator: torch.Generator,
    training: bool = True,
    *,
    regenerate: bool = False,
) -> Tensor:
    """Dropout with probability ``p`` drawn from ``generator``; identity if ``p == 0`` or eval.

    Stores a 1-byte mask for backward, or, with ``regenerate``, no mask (it is drawn again
    from the same stream position in backward). Both draw the same mask."""
    if not training or p == 0.0:
        return x
    if generator.device.type != x.device.type:
        raise RuntimeError(
            f"dropout on a {x.device.type} tensor with a {generator.device.type} generator: build "
            f"the model with ParallelState.device = {x.device} so its RNG streams live there"
        )
    if regenerate and torch.is_grad_enabled():
        return _RegeneratedDropout.apply(x, p, generator)
    return _Dropout.apply(x, p, generator)
