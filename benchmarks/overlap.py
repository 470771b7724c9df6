"""Step time with the data-parallel reduction overlapped with backward against after it:
``python -m benchmarks.overlap`` (``--smoke`` for a seconds-long run).

2 gloo ranks, data parallel d=2, a small fp32 GPT, gradients in a
:class:`~lightning_sp.parallel.buffer.GradBuffer`. Two models (overlap on and off, same init,
same buckets) step in interleaved rounds (AB AB ..., :func:`benchmarks._stats.interleaved`),
so the machine's drift hits both alike. A step's time is the slower rank's wall time of
zero-grad + forward + backward + finish + AdamW. Reported: the median step time overlapped
over not (with a 95% bootstrap interval), and the share of communication hidden:
``(T_off - T_on) / C`` where ``C`` is the median time the non-overlapped run spends in
:meth:`GradBuffer.finish` (all of its reduction).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks._fit import gpt_config
from benchmarks._format import arguments, ci, fixed, save, table
from benchmarks._stats import interleaved, ratio_of_medians_ci
from lightning_sp import GPT, ParallelState
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.parallel.buffer import GradBufferConfig
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.testing.spawn import run_distributed

MODES = ("overlap", "after")


def _rank(rank: int, world_size: int, rounds: int, hidden: int, bucket: int) -> dict:
    config = gpt_config(257, 128, hidden, 4, 8, dropout=0.0)
    state = ParallelState.from_process_group()
    models = {name: GPT(config, state) for name in MODES}
    optimizers = {
        name: build_adamw(models[name], 1e-4, 0.1, (0.9, 0.95), 1e-8,
                          GradBufferConfig(bucket, overlap=name == "overlap"))
        for name in MODES
    }  # fmt: skip
    tokens = torch.randint(0, 257, (4, 129), generator=torch.Generator().manual_seed(rank))
    comm: list[float] = []  # seconds in finish, the non-overlapped run's

    def step(name: str) -> None:
        model, optimizer = models[name], optimizers[name]
        optimizer.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        finish_start = time.perf_counter()
        finalize_grads(model, state, optimizer.grad_buffer)  # type: ignore[attr-defined]
        if name == "after":
            comm.append(time.perf_counter() - finish_start)
        optimizer.step()

    steps = {name: functools.partial(step, name) for name in MODES}
    times = interleaved(steps, 1, rounds, slowest_rank=True)  # round 0 warms up
    slowest = torch.tensor(comm[1:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    buckets = len(optimizers["overlap"].grad_buffer.buckets)  # type: ignore[attr-defined]
    return {"times": times, "comm": slowest.tolist(), "buckets": buckets}


def main(argv: list[str] | None = None) -> None:
    bucket = (1_000_000, 50_000, "elements per bucket")
    args = arguments(__doc__, argv, "3 rounds of a hidden-128 model",
                     rounds=(20, 3), hidden=(512, 128), bucket=bucket)  # fmt: skip
    result = run_distributed(_rank, 2, args.rounds, args.hidden, args.bucket)[0]
    on, off, comm = result["times"]["overlap"], result["times"]["after"], result["comm"]
    ratio, lo, hi = ratio_of_medians_ci(on, off)
    t_on, t_off, c = statistics.median(on), statistics.median(off), statistics.median(comm)
    summary = {
        "ratio": [ratio, lo, hi],
        "overlap_ms": t_on * 1e3,
        "after_ms": t_off * 1e3,
        "reduction_ms": c * 1e3,
        "share_hidden": (t_off - t_on) / c,
    }
    rows = [
        ["median step, overlapped, ms", fixed(t_on * 1e3, 1)],
        ["median step, reduced after backward, ms", fixed(t_off * 1e3, 1)],
        ["reduction after backward, ms", fixed(c * 1e3, 1)],
        ["step overlapped / after [95% CI]", ci([ratio, lo, hi])],
        ["share of the reduction hidden", fixed((t_off - t_on) / c)],
    ]
    save(args, argv, "overlap", {**summary, "samples": result},
         table(["measure", "value"], rows), rounds=len(on), hidden=args.hidden,
         buckets=result["buckets"])  # fmt: skip


if __name__ == "__main__":
    main()
