"""Time per token with document masking over without, at equal tokens, for ``math`` and
``sdpa`` (issue 35): one process, fp32, forward + backward of a small Llama.

Each round times, back to back, every (backend, masked) model on the same batch; a round's
ratio is masked over unmasked time of the same backend (paired: the shared machine's speed
drifts). Reported: the median ratio over the rounds with a 95% bootstrap interval
(:mod:`benchmarks._stats`), and the median seconds per 1000 tokens. The documents are seeded
lengths between ``min_doc`` and ``max_doc`` tokens, cut to fill each sequence.

    python benchmarks/documents.py                 # s=1024, 2 layers, 15 rounds
    python benchmarks/documents.py --seq 512 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks._stats import median_ci
from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.model.documents import Packing


def documents_of(batch: int, seq: int, min_doc: int, max_doc: int, seed: int) -> torch.Tensor:
    """``[b, s]`` int32 document ids of seeded random lengths."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths: list[int] = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(min_doc, max_doc + 1, (1,), generator=generator)))
        ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
        rows.append(ids[:seq])
    return torch.stack(rows)


def step_seconds(model: GPT, ids: torch.Tensor, documents: torch.Tensor | None) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(ids, ids, Packing(documents)).backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--min-doc", type=int, default=16)
    parser.add_argument("--max-doc", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    documents = documents_of(args.batch, args.seq, args.min_doc, args.max_doc, seed=1)
    models = {}
    for attention in ("math", "sdpa"):
        config = GPTConfig.of(
            "llama", vocab_size=1000, seq_length=args.seq, hidden_size=args.hidden,
            num_layers=args.layers, num_heads=args.heads, num_query_groups=args.heads // 2,
            ffn_hidden_size=4 * args.hidden, attention=attention, recompute="none",
        )  # fmt: skip
        models[attention] = GPT(config, ParallelState.single(), dtype=torch.float32)
    cases = [(a, masked) for a in models for masked in (False, True)]
    times: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    for round_ in range(args.warmup + args.rounds):
        for attention, masked in cases:
            seconds = step_seconds(models[attention], ids, documents if masked else None)
            if round_ >= args.warmup:
                times[(attention, masked)].append(seconds)
    tokens = args.batch * args.seq
    report: dict[str, object] = {
        "shape": vars(args),
        "documents_per_sequence": float(documents.amax(dim=1).float().mean() + 1),
    }
    for attention in models:
        ratios = [
            m / u for m, u in zip(times[(attention, True)], times[(attention, False)], strict=True)
        ]
        report[f"{attention}_masked_over_causal"] = [round(x, 4) for x in median_ci(ratios)]
        for masked in (False, True):
            name = f"{attention}_{'masked' if masked else 'causal'}_ms_per_1k_tokens"
            report[name] = round(1e6 * statistics.median(times[(attention, masked)]) / tokens, 3)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
