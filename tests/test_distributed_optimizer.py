"""The distributed optimizer (ZeRO-1): 1/d of the optimizer state per rank, as the formula
says, and checkpoints that reshard across d and to and from the replicated optimizer.

Parity of its updates with today's path (dp=2, dp=4, t=2 x dp=2, p=2 x dp=2, with gradient
accumulation and clipping) runs in ``test_grad_buffer.py``'s spawn, beside the buffer's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_sp import GPT, ParallelState
from lightning_sp.memory.formulas import distributed_optimizer_elements, model_state_bytes
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.training.checkpoint import Checkpointer, Layout, Meta, read_full, rng_key
from lightning_sp.training.distributed_optim import DistributedAdamW
from lightning_sp.training.optim import build_adamw

from models import batch, tiny_config
from spawn import run_distributed

BUCKET = 3000


def _optimizer_state_bytes(optimizer: DistributedAdamW) -> int:
    masters = [m for group in optimizer.param_groups for m in group["params"]]
    tensors = masters + [optimizer.state[m][k] for m in masters for k in ("exp_avg", "exp_avg_sq")]
    return sum(t.numel() * t.element_size() for t in tensors)


class Run:
    """A float64 GPT shard with a buffered optimizer (ZeRO-1 or replicated) in one layout."""

    def __init__(self, state: ParallelState, distributed: bool) -> None:
        self.state = state
        self.config = tiny_config(sequence_parallel=state.tensor_parallel_size > 1)
        self.model = GPT(self.config, state, dtype=torch.float64)
        self.optimizer = build_adamw(
            self.model, 1e-2, 0.1, (0.9, 0.95), 1e-8, bucket_numel=BUCKET,
            distributed_optimizer=distributed,
        )  # fmt: skip

    def step(self, step: int) -> None:
        ids, labels = batch(self.config, 4, seed=step)
        d, r = self.state.data_parallel_size, self.state.data_parallel_rank
        rows = slice(r * 4 // d, (r + 1) * 4 // d)
        self.optimizer.zero_grad()
        self.model(ids[rows], labels[rows]).backward()
        finalize_grads(self.model, self.state, self.optimizer.grad_buffer)  # type: ignore[attr-defined]
        self.optimizer.step()

    def _views(self) -> list:
        opt = self.optimizer
        return [opt.full_view() if isinstance(opt, DistributedAdamW) else opt]

    def _layout(self) -> Layout:
        s = self.state
        t = s.tensor_parallel_size
        return Layout(t, 1, s.data_parallel_size, 1, t > 1)

    def save(self, path: Path) -> None:
        s = self.state
        Checkpointer().save(
            path, self.model, self._views(),
            meta=Meta(2, self._layout(), dataclasses.asdict(self.config)),
            lightning_state={"global_step": 2},
            rng=(rng_key(0, s.data_parallel_rank, s.tensor_parallel_rank), None),
        )  # fmt: skip

    def load(self, path: Path) -> None:
        views = self._views()
        Checkpointer().load(
            path, self.model, views, layout=self._layout(),
            model_config=dataclasses.asdict(self.config), rng_name="rng.none",
        )  # fmt: skip
        if isinstance(self.optimizer, DistributedAdamW):
            self.optimizer.load_full_view(views[0])


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
    saved = Run(ParallelState.from_process_group(tensor_parallel_size=2), distributed=True)
    for step in range(2):
        saved.step(step)
    saved.save(root_path / "zero_t2d2")
    zero4 = Run(states[4], distributed=True)
    zero4.load(root_path / "zero_t2d2")
    zero4.save(root_path / "zero_d4")
    replicated = Run(states[4], distributed=False)
    replicated.load(root_path / "zero_d4")
    replicated.save(root_path / "replicated_d4")
    again = Run(states[4], distributed=True)
    again.load(root_path / "replicated_d4")
    again.save(root_path / "zero_again")
    return measured


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
    for key in keys:  # the replicated fp64 optimizer keeps no separate master
        if not key.endswith(".master"):
            assert torch.equal(replicated[key], zero[key]), f"replicated: {key} differs"
