"""Our GPT's training step in FP8 vs bf16 on one GPU: ``python -m benchmarks.fp8_step [--smoke]
[--device cpu] [--out DIR]``.

The 1.2B GPT of :mod:`benchmarks.gpu` (s=2048, h=2048, 24 layers, 16 heads, b=4; SDPA, no
recompute, dropout 0), bf16 weights and activations, forward + backward per step, its layers'
linears (:mod:`lightning_sp.model.fp8`) in bf16, FP8 ``tensorwise`` and FP8 ``rowwise``; the
embeddings, the head and the attention core stay bf16. Every variant is built from the same
seed (the same weights). Timing: one step of each variant per round, rounds interleaved, each
between two device synchronisations; per variant tokens/s (median) and its step time over
bf16's as the median of the per-round ratios with a 95% bootstrap interval
(:mod:`benchmarks._stats`). Also per variant: the loss of the first step (FP8 within a few
per mille of bf16's), the bytes a layer keeps for backward (saved-tensor hooks) against the
formula, and the peak memory.

Without CUDA it refuses in one line (exit 2). ``--device cpu --smoke`` runs the same at a tiny
shape with torchao's emulated GEMMs to check the plumbing: its numbers mean nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
from typing import Any

import torch

from benchmarks import _format
from benchmarks._fit import FULL, Shape, batch, held_per_layer, train_step
from benchmarks._format import PLUMBING, ci, device_name, save, table
from benchmarks._stats import device_sync, interleaved, ratio_ci
from lightning_sp.memory.formulas import activation_bytes_per_layer, layernorm_stats_bytes_per_layer
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.fp8 import RECIPES, FP8Config
from lightning_sp.parallel.state import ParallelState

SMOKE = Shape(s=64, h=64, layers=2, heads=4, vocab=256, b=2)


def measure(shape: Shape, device: torch.device, warmup: int, rounds: int) -> dict[str, Any]:
    ids, labels = batch(shape.vocab, shape.b, shape.s, device)
    rows: dict[str, dict[str, Any]] = {}
    steps = {}
    for recipe in (None, *RECIPES):
        name = recipe or "bf16"
        fp8 = FP8Config(recipe, emulate=device.type != "cuda") if recipe else None
        config = shape.config("none", 0.0, attention="sdpa", fp8=fp8)
        model = GPT(config, ParallelState.single(device), dtype=torch.bfloat16, device=device)
        held, loss = held_per_layer(model.train(), ids, labels)
        loss.backward()
        model.zero_grad(set_to_none=True)
        formula = config.activation_shape(None, shape.b, device=device)
        rows[name] = {
            "loss": loss.item(),
            "held_bytes_per_layer": statistics.mean(held),
            "formula_bytes_per_layer": activation_bytes_per_layer(formula, "none")
            + layernorm_stats_bytes_per_layer(formula, "none"),
        }
        steps[name] = functools.partial(train_step, model, ids, labels)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = interleaved(steps, warmup, rounds, device_sync(device))
    for name, values in seconds.items():
        rows[name].update(
            seconds=statistics.median(values),
            tokens_per_sec=shape.b * shape.s / statistics.median(values),
            over_bf16=ratio_ci(values, seconds["bf16"]),
        )
    return {
        "device_name": device_name(device, "CPU (emulated)"),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else None,
        "shape": dataclasses.asdict(shape),
        "rows": [{"variant": name, **row} for name, row in rows.items()],
    }


def markdown(found: dict[str, Any]) -> str:
    header = ["variant", "tokens/s", "step / bf16 (95% CI)", "first loss", "held B/layer",
              "formula B/layer"]  # fmt: skip
    rows = [
        [r["variant"], f"{r['tokens_per_sec']:.0f}", ci(r["over_bf16"]), f"{r['loss']:.4f}",
         f"{r['held_bytes_per_layer']:.0f}", f"{r['formula_bytes_per_layer']:.0f}"]
        for r in found["rows"]
    ]  # fmt: skip
    name, s = found["device_name"], found["shape"]
    return (
        f"{PLUMBING if 'emulated' in name else ''}GPT training step (forward + backward), bf16 "
        f"vs FP8 linears, on {name}: s={s['s']} h={s['h']} L={s['layers']} a={s['heads']} "
        f"b={s['b']}, SDPA, no recompute.\n\n" + table(header, rows)
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = _format.parser(__doc__)
    _format.add_device(p)
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (10; smoke 2)")
    args = p.parse_args(argv)
    if _format.refused(args, "fp8_step", "a CUDA device with FP8 GEMMs"):
        return 2
    shape = SMOKE if args.smoke else FULL
    warmup, rounds = (1, args.rounds or 2) if args.smoke else (3, args.rounds or 10)
    found = measure(shape, torch.device(args.device), warmup, rounds)
    save(args, argv, "fp8_step", found, markdown(found), smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
