"""Time per token with context parallelism c=2 against c=1 at equal tokens per rank:
``python -m benchmarks.context`` (``--smoke`` for a seconds-long run).

2 gloo ranks, a small fp32 GPT (the model-level CP of :mod:`lightning_sp.parallel.context`),
the same sequence length ``s`` in both layouts and ``s`` tokens per rank per step:

* ``c=1``: data parallel d=2, each rank one whole sequence; gradients averaged over dp;
* ``c=2``: one CP group, two sequences, each rank their load-balanced halves (``s/2`` tokens
  of each), the CP attention core (K/V all-gather forward; all-gather, replay and
  reduce-scatter backward); gradients summed over cp.

A step is zero-grad + forward + backward + the gradient reduction, timed as the slower rank's
wall time; the layouts alternate round by round (AB AB ...) so the machine's drift hits both
alike. Reported: median time per token c=2 over c=1 with a 95% bootstrap interval (the
ratio of step times, the token counts being equal), and each median.
"""

from __future__ import annotations

import functools
import statistics

import torch

from benchmarks._fit import gpt_config
from benchmarks._format import arguments, ci, fixed, save, table
from benchmarks._stats import interleaved, ratio_of_medians_ci
from lightning_sp import GPT, ParallelState
from lightning_sp.parallel.context import shard_for_context_parallel
from lightning_sp.parallel.grads import average_data_parallel_grads, sum_context_parallel_grads
from lightning_sp.testing.spawn import run_distributed

LAYOUTS = ("c1", "c2")


def _rank(rank: int, world_size: int, rounds: int, seq_length: int, hidden: int) -> dict:
    config = gpt_config(257, seq_length, hidden, 4, 8, dropout=0.0, attention="math")
    states = {
        "c1": ParallelState.from_process_group(),
        "c2": ParallelState.from_process_group(context_parallel_size=world_size),
    }
    torch.manual_seed(0)
    models = {name: GPT(config, states[name]) for name in LAYOUTS}
    tokens = torch.randint(
        0, 257, (world_size, seq_length + 1), generator=torch.Generator().manual_seed(0)
    )
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    batches = {  # s tokens per rank in both
        "c1": (ids[rank : rank + 1], labels[rank : rank + 1]),
        "c2": tuple(shard_for_context_parallel(x, 1, world_size, rank) for x in (ids, labels)),
    }
    reduce = {"c1": average_data_parallel_grads, "c2": sum_context_parallel_grads}

    def step(name: str) -> None:
        model, (x, y) = models[name], batches[name]
        assert x.numel() == seq_length
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        reduce[name](model, states[name])

    steps = {name: functools.partial(step, name) for name in LAYOUTS}
    times = interleaved(steps, 1, rounds, slowest_rank=True)  # round 0 warms up
    return {"times": times}


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run, print the ratio and write ``context.json`` + ``context.md``; returns ``{"ratio",
    "low", "high", "c1_ms", "c2_ms"}``."""
    args = arguments(__doc__, argv, "2 rounds of s=64, hidden 64",
                     rounds=(20, 2), seq_length=(1024, 64), hidden=(256, 64))  # fmt: skip
    result = run_distributed(_rank, 2, args.rounds, args.seq_length, args.hidden, threads=1)[0]
    c1, c2 = result["times"]["c1"], result["times"]["c2"]
    ratio, lo, hi = ratio_of_medians_ci(c2, c1)
    out = {
        "ratio": ratio,
        "low": lo,
        "high": hi,
        "c1_ms": statistics.median(c1) * 1e3,
        "c2_ms": statistics.median(c2) * 1e3,
    }
    rows = [
        ["c=1 (d=2), median step ms", fixed(out["c1_ms"], 1)],
        ["c=2, median step ms", fixed(out["c2_ms"], 1)],
        ["time per token c=2 / c=1 [95% CI]", ci([ratio, lo, hi])],
    ]
    result = {**out, "samples": {"c1": c1, "c2": c2}}
    save(args, argv, "context", result, table(["measure", "value"], rows),
         rounds=len(c1), seq_length=args.seq_length, hidden=args.hidden)  # fmt: skip
    return out


if __name__ == "__main__":
    main()
