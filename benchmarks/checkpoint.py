"""Step time with checkpoints every N steps against none: ``python -m benchmarks.checkpoint``.

2 gloo ranks, tensor parallel t=2 with sequence parallelism, the tiny GPT of configs/tiny.yaml
(fp32, AdamW). Three schedules run in one process pair, interleaved in rounds (ABC ABC ...)
so that the machine's drift hits them alike: no checkpoints, DCP ``async_save`` every
``every`` steps, and a blocking save every ``every`` steps. A round's time is the wall time of
``every`` steps including the save it triggers (the slower rank's); the report gives, for each
schedule, the median round time over the no-checkpoint median, with a 95% bootstrap interval.
The async schedule waits for its previous save before the next (at most one in flight), as
training does.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from benchmarks._fit import gpt_config
from benchmarks._format import arguments, ci, save, table
from benchmarks._stats import interleaved, ratio_of_medians_ci
from lightning_sp import GPT, ParallelState
from lightning_sp.checkpoint import Checkpointer, Meta
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.testing.spawn import run_distributed

SCHEDULES = ("none", "async", "sync")


def _rank(rank: int, world_size: int, rounds: int, every: int, folder: str) -> dict:
    config = gpt_config(257, 256, 256, 4, 8, "selective", 0.0, sequence_parallel=True)
    state = ParallelState.from_process_group(2)
    model = GPT(config, state)
    optimizer = build_adamw(model, 1e-4, 0.1, (0.9, 0.95), 1e-8)
    tokens = torch.randint(0, 257, (8, 257), generator=torch.Generator().manual_seed(0))
    savers = {"async": Checkpointer(async_save=True), "sync": Checkpointer()}
    meta = Meta(0, ParallelConfig(tensor_parallel_size=2), config.values())

    def step() -> None:
        optimizer.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        finalize_grads(model, state)
        optimizer.step()

    def every_steps(name: str) -> None:
        for _ in range(every):
            step()
        if name != "none":
            savers[name].save(Path(folder) / f"{name}.ckpt", model, [optimizer], meta=meta,
                              lightning_state={}, rng=(f"rng.{rank}", None))  # fmt: skip

    step()  # warm-up; the first round pays one-off costs too (the async group, page cache)
    schedules = {name: functools.partial(every_steps, name) for name in SCHEDULES}
    times = interleaved(schedules, 1, rounds - 1, slowest_rank=True)
    savers["async"].wait()
    return times


def main(argv: list[str] | None = None) -> None:
    every = (5, 2, "steps between checkpoints")
    args = arguments(__doc__, argv, "2 rounds of 2 steps", rounds=(6, 2), every=every)
    with tempfile.TemporaryDirectory() as folder:
        times = run_distributed(_rank, 2, args.rounds, args.every, folder, threads=1)[0]
    base = times["none"]
    ratios = {name: ratio_of_medians_ci(times[name], base) for name in ("async", "sync")}
    rows = [[f"{name} save every {args.every} steps", ci(list(r))] for name, r in ratios.items()]
    result = {"ratio_over_none": {k: list(v) for k, v in ratios.items()}, "samples": times}
    markdown = table(["schedule", "round time / no checkpoints [95% CI]"], rows)
    save(args, argv, "checkpoint", result, markdown, every=args.every,
         rounds=len(base))  # fmt: skip


if __name__ == "__main__":
    main()
