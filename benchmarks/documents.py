"""Time per token with document masking over without, at equal tokens, for ``math`` and
``sdpa`` (issue 35): one process, fp32, forward + backward of a small Llama.

Each round times, back to back, every (backend, masked) model on the same batch; a round's
ratio is masked over unmasked time of the same backend (paired: the shared machine's speed
drifts). Reported: the median ratio over the rounds with a 95% bootstrap interval
(:mod:`benchmarks._stats`), and the median seconds per 1000 tokens. The documents are seeded
lengths between ``min_doc`` and ``max_doc`` tokens, cut to fill each sequence.

    python -m benchmarks.documents                 # s=1024, 2 layers, 15 rounds
    python -m benchmarks.documents --seq 512 --rounds 5 [--smoke] [--out DIR]

Writes ``documents.json`` and ``documents.md``.
"""

from __future__ import annotations

import functools
import statistics

import torch

from benchmarks._format import arguments, ci, fixed, save, table
from benchmarks._stats import interleaved, ratio_ci
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


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = arguments(__doc__, argv, "s=128, 1 layer, 2 rounds", seq=(1024, 128), batch=1,
                     hidden=256, heads=8, layers=(2, 1), min_doc=16, max_doc=(256, 64),
                     rounds=(15, 2), warmup=(2, 1), threads=1)  # fmt: skip
    torch.set_num_threads(args.threads)
    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    documents = documents_of(args.batch, args.seq, args.min_doc, args.max_doc, seed=1)
    steps = {}
    for attention in ("math", "sdpa"):
        config = GPTConfig.of(
            "llama", vocab_size=1000, seq_length=args.seq, hidden_size=args.hidden,
            num_layers=args.layers, num_heads=args.heads, num_query_groups=args.heads // 2,
            ffn_hidden_size=4 * args.hidden, attention=attention, recompute="none",
        )  # fmt: skip
        model = GPT(config, ParallelState.single(), dtype=torch.float32)
        for masked in ("causal", "masked"):
            packing = Packing(documents if masked == "masked" else None)
            steps[f"{attention}_{masked}"] = functools.partial(_step, model, ids, packing)
    times = interleaved(steps, args.warmup, args.rounds)
    tokens = args.batch * args.seq
    report: dict[str, object] = {
        "shape": {k: v for k, v in vars(args).items() if k not in ("out", "smoke")},
        "documents_per_sequence": float(documents.amax(dim=1).float().mean() + 1),
    }
    rows = []
    for attention in ("math", "sdpa"):
        ratio = ratio_ci(times[f"{attention}_masked"], times[f"{attention}_causal"])
        report[f"{attention}_masked_over_causal"] = [round(x, 4) for x in ratio]
        rows.append([f"{attention}: masked / causal [95% CI]", ci(list(ratio))])
        for masked in ("causal", "masked"):
            ms = round(1e6 * statistics.median(times[f"{attention}_{masked}"]) / tokens, 3)
            report[f"{attention}_{masked}_ms_per_1k_tokens"] = ms
            rows.append([f"{attention} {masked}, ms per 1k tokens", fixed(ms, 3)])
    save(args, argv, "documents", report, table(["measure", "value"], rows))
    return report


def _step(model: GPT, ids: torch.Tensor, packing: Packing) -> None:
    model.zero_grad(set_to_none=True)
    model(ids, ids, packing).backward()


if __name__ == "__main__":
    main()
