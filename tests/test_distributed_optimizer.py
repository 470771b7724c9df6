"""The distributed optimizer (ZeRO-1): 1/d of the optimizer state per rank, as the formula
says, and checkpoints that reshard across d and to and from the replicated optimizer.

Parity of its updates with today's path (dp=2, dp=4, t=2 x dp=2, p=2 x dp=2, with gradient
accumulation and clipping) runs in ``test_grad_buffer.py``'s spawn, beside the buffer's.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_sp import GPT, ParallelState
from lightning_sp.checkpoint import Checkpointer, Meta, read_full, rng_key
from lightning_sp.checkpoint.shards import flat_range_boxes
from lightning_sp.memory.model_state import distributed_optimizer_elements, model_state_bytes
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.optim.distributed import DistributedAdamW
from lightning_sp.parallel.buffer import GradBufferConfig
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.testing.spawn import run_distributed

from models import batch, tiny_config

BUCKET = 3000


def _optimizer_state_bytes(optimizer: DistributedAdamW) -> int:
    masters = [m for group in optimizer.param_groups for m in group["params"]]
    tensors = masters + [optimizer.state[m][k] for m in masters for k in ("exp_avg", "exp_avg_sq")]
    return sum(t.numel() * t.element_size() for t in tensors)


class Run:
    """A float64 GPT shard with a buffered optimizer (ZeRO-1 or replicated) in one layout."""

    def __init__(
        self, state: ParallelState, distributed: bool, dtype: torch.dtype = torch.float64
    ) -> None:
        self.state = state
        self.config = tiny_config(sequence_parallel=state.tensor_parallel_size > 1)
        self.model = GPT(self.config, state, dtype=dtype)
        self.optimizer = build_adamw(
            self.model, 1e-2, 0.1, (0.9, 0.95), 1e-8,
            GradBufferConfig(BUCKET, distributed=distributed),
        )  # fmt: skip

    def step(self, step: int) -> None:
        ids, labels = batch(self.config, 4, seed=step)
        d, r = self.state.data_parallel_size, self.state.data_parallel_rank
        rows = slice(r * 4 // d, (r + 1) * 4 // d)
        self.optimizer.zero_grad()
        self.model(ids[rows], labels[rows]).backward()
        finalize_grads(self.model, self.state, self.optimizer.grad_buffer)  # type: ignore[attr-defined]
        self.optimizer.step()

    def _layout(self) -> ParallelConfig:
        s = self.state
        t = s.tensor_parallel_size
        return ParallelConfig(tensor_parallel_size=t, data_parallel_size=s.data_parallel_size)

    def save(self, path: Path) -> None:
        s = self.state
        Checkpointer().save(
            path, self.model, [self.optimizer],
            meta=Meta(2, self._layout(), dataclasses.asdict(self.config)),
            lightning_state={"global_step": 2},
            rng=(rng_key(0, s.data_parallel_rank, s.tensor_parallel_rank), None),
        )  # fmt: skip

    def load(self, path: Path) -> None:
        Checkpointer().load(
            path, self.model, [self.optimizer], layout=self._layout(),
            model_config=dataclasses.asdict(self.config), rng_name="rng.none",
        )  # fmt: skip


def _no_gather(*args: object, **kwargs: object) -> None:
    raise AssertionError("a checkpoint of the distributed optimizer gathered its state")


def _worker(rank: int, world_size: int, root: str) -> dict[str, list[int]]:
    # optimizer-state bytes per rank against the formula at d = 1, 2, 4
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cpu = torch.device("cpu")
    states = {
        1: ParallelState.single(),
        2: ParallelState(1, 1, 2, 0, 0, rank % 2, None, None, groups[rank // 2], cpu),
        4: ParallelState.from_process_group(),
    }
    measured: dict[str, list[int]] = {}
    for d, state in states.items():
        run = Run(state, distributed=True)
        run.step(0)
        buckets = [b.offsets[-1] + b.params[-1].numel() for b in run.optimizer.grad_buffer.buckets]
        elements = distributed_optimizer_elements(buckets, d, state.data_parallel_rank)
        got = _optimizer_state_bytes(run.optimizer)  # type: ignore[arg-type]
        assert got == 3 * 8 * elements, (d, got, elements)  # float64 master, exp_avg, exp_avg_sq
        n = sum(p.numel() for p in run.model.parameters())
        formula = model_state_bytes(n, data_parallel_size=d, distributed_optimizer=True)
        measured[f"d{d}"] = [got, n, round(formula), len(buckets)]

    # checkpoints: ZeRO-1 at t=2 x d=2 -> ZeRO-1 at d=4 -> replicated at d=4 -> ZeRO-1 at d=4
    root_path = Path(root)
    # each rank writes and reads only its own segments: the state is never gathered
    saved = Run(ParallelState.from_process_group(tensor_parallel_size=2), distributed=True)
    for step in range(2):
        saved.step(step)
    saved.optimizer.grad_buffer.gather = _no_gather  # type: ignore[attr-defined, method-assign]
    saved.save(root_path / "zero_t2d2")
    zero4 = Run(states[4], distributed=True)
    zero4.optimizer.grad_buffer.gather = _no_gather  # type: ignore[attr-defined, method-assign]
    zero4.load(root_path / "zero_t2d2")
    zero4.save(root_path / "zero_d4")
    replicated = Run(states[4], distributed=False)
    replicated.load(root_path / "zero_d4")
    replicated.save(root_path / "replicated_d4")
    again = Run(states[4], distributed=True)
    again.load(root_path / "replicated_d4")
    for run in (zero4, again):  # a full-precision weight is its own master: none is saved
        for segment in run.optimizer.segments():  # type: ignore[attr-defined]
            weights = segment.param.detach().reshape(-1)[segment.start : segment.end]
            assert torch.equal(segment.master, weights), (
                "after a load, the master of a full-precision weight is not the loaded weight"
            )
            assert set(segment.state) == {"step", "exp_avg", "exp_avg_sq"}
    again.save(root_path / "zero_again")
    # bf16 weights: the fp32 masters are saved as chunks too, and load into the replicated
    # optimizer's whole masters (and back)
    bf16 = Run(states[4], distributed=True, dtype=torch.bfloat16)
    bf16.step(0)
    bf16.save(root_path / "zero_bf16")
    whole = Run(states[4], distributed=False, dtype=torch.bfloat16)
    whole.load(root_path / "zero_bf16")
    whole.save(root_path / "replicated_bf16")
    back = Run(states[2], distributed=True, dtype=torch.bfloat16)
    back.load(root_path / "replicated_bf16")
    back.save(root_path / "zero_bf16_d2")  # two d=2 replicas: identical chunks, written once
    return measured


@pytest.mark.slow
def test_state_bytes_per_rank_and_resharding(tmp_path: Path) -> None:
    results = run_distributed(_worker, 4, str(tmp_path))
    for d in (1, 2, 4):
        per_rank = [r[f"d{d}"][0] for r in results]
        n = results[0][f"d{d}"][1]
        # every element's state is kept once over the d ranks of a replica group
        assert sum(per_rank) == (4 // d) * 24 * n, (d, per_rank)
        # the planner's 12/d bytes (fp32) per parameter, to within the bucket padding
        replicated_part = 6 * n
        fp32_state = [r[f"d{d}"][2] - replicated_part for r in results]
        assert all(abs(s - 12 * n / d) < 1e-6 for s in fp32_state), fp32_state
        assert all(abs(b / 2 - 12 * n / d) <= 12 * results[0][f"d{d}"][3] for b in per_rank)
    zero, replicated = read_full(tmp_path / "zero_t2d2"), read_full(tmp_path / "replicated_d4")
    keys = [k for k in zero if k.startswith(("model.", "optim.")) and torch.is_tensor(zero[k])]
    assert any(k.endswith(".exp_avg_sq") for k in keys)
    for other in ("zero_d4", "zero_again"):
        full = read_full(tmp_path / other)
        for key in keys:
            assert torch.equal(full[key], zero[key]), f"{other}: {key} differs"
    for key in keys:  # neither keeps a master apart from a full-precision weight
        assert not key.endswith(".master"), key
        assert torch.equal(replicated[key], zero[key]), f"replicated: {key} differs"
    bf16 = read_full(tmp_path / "zero_bf16")
    bf16_keys = [k for k in bf16 if k.startswith(("model.", "optim.")) and torch.is_tensor(bf16[k])]
    masters = [k for k in bf16_keys if k.endswith(".master")]
    assert masters and all(bf16[k].dtype == torch.float32 for k in masters)
    for other in ("replicated_bf16", "zero_bf16_d2"):
        full = read_full(tmp_path / other)
        assert all(k in full for k in bf16_keys), other
        for key in bf16_keys:
            assert torch.equal(full[key], bf16[key]), f"{other}: {key} differs"


def test_flat_range_boxes_cover_the_range_in_order() -> None:
    """A flat range of a row-major tensor as rectangular boxes: each box is the next
    contiguous piece of the range, and the boxes are the whole range (at most two partial
    pieces per dimension)."""
    generator = torch.Generator().manual_seed(0)
    for shape in [(7,), (5, 3), (4, 3, 5), (2, 1, 3, 4)]:
        numel = math.prod(shape)
        flat = torch.arange(numel).view(shape)
        for _ in range(40):
            start, end = sorted(torch.randint(0, numel + 1, (2,), generator=generator).tolist())
            boxes = flat_range_boxes(shape, start, end)
            pieces = [flat[tuple(slice(o, o + n) for o, n in zip(at, sizes, strict=True))]
                      for at, sizes in boxes]  # fmt: skip
            assert torch.equal(torch.cat([p.flatten() for p in pieces] or [torch.arange(0)]),
                               torch.arange(start, end)), (shape, start, end, boxes)  # fmt: skip
            assert len(boxes) <= 2 * len(shape) - 1, (shape, start, end, boxes)
