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

from benchmarks._fit import Shape
from benchmarks._format import ci, parser, save, table
from benchmarks._stats import interleaved, ratio_ci
from lightning_sp.memory.formulas import activation_bytes_per_layer, layernorm_stats_bytes_per_layer
from lightning_sp.memory.saved import SavedTensorTracker
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.fp8 import RECIPES, FP8Config
from lightning_sp.parallel.state import ParallelState

FULL = Shape(s=2048, h=2048, layers=24, heads=16, vocab=51200, b=4)
SMOKE = Shape(s=64, h=64, layers=2, heads=4, vocab=256, b=2)


def _variant(shape: Shape, recipe: str | None, device: torch.device) -> tuple[GPT, Any]:
    emulate = device.type != "cuda"
    config = shape.config(
        attention="sdpa", recompute="none", hidden_dropout=0.0, attention_dropout=0.0,
        fp8=FP8Config(recipe, emulate=emulate) if recipe else None,
    )  # fmt: skip
    model = GPT(config, ParallelState.single(device), dtype=torch.bfloat16, device=device)
    return model.train(), config


def measure(shape: Shape, device: torch.device, warmup: int, rounds: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab, (shape.b, shape.s + 1), generator=generator)
    ids, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    rows: dict[str, dict[str, Any]] = {}
    steps = {}
    for recipe in (None, *RECIPES):
        name = recipe or "bf16"
        model, config = _variant(shape, recipe, device)
        with SavedTensorTracker.for_model(model) as tracker:
            loss = model(ids, labels)
        loss.backward()
        model.zero_grad(set_to_none=True)
        held = statistics.mean(tracker.report.bytes_of(f"layers.{i}") for i in range(shape.layers))
        formula = config.activation_shape(None, shape.b)
        rows[name] = {
            "loss": loss.item(),
            "held_bytes_per_layer": held,
            "formula_bytes_per_layer": activation_bytes_per_layer(formula, "none")
            + layernorm_stats_bytes_per_layer(formula, "none"),
        }

        def step(model: GPT = model) -> None:
            model(ids, labels).backward()
            model.zero_grad(set_to_none=True)

        steps[name] = step
    sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else None
    if sync is not None:
        torch.cuda.reset_peak_memory_stats(device)
    seconds = interleaved(steps, warmup, rounds, sync or (lambda: None))
    for name, values in seconds.items():
        rows[name].update(
            seconds=statistics.median(values),
            tokens_per_sec=shape.b * shape.s / statistics.median(values),
            over_bf16=ratio_ci(values, seconds["bf16"]),
        )
    return {
        "device_name": torch.cuda.get_device_name(device) if sync else "CPU (emulated)",
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if sync else None,
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
    note = "**Plumbing check on CPU: the numbers mean nothing.**\n\n" if "emulated" in name else ""
    return (
        f"{note}GPT training step (forward + backward), bf16 vs FP8 linears, on {name}: "
        f"s={s['s']} h={s['h']} L={s['layers']} a={s['heads']} b={s['b']}, SDPA, no "
        "recompute.\n\n" + table(header, rows)
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = parser(__doc__)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a plumbing check (--smoke)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (10; smoke 2)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: benchmarks.fp8_step needs a CUDA device with FP8 GEMMs and "
              "torch.cuda.is_available() is False (a CPU plumbing check: --device cpu --smoke)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cpu" and not args.smoke:
        print("error: --device cpu is a plumbing check only; add --smoke", file=sys.stderr)
        return 2
    rounds = args.rounds or (2 if args.smoke else 10)
    shape = SMOKE if args.smoke else FULL
    found = measure(shape, torch.device(args.device), 1 if args.smoke else 3, rounds)
    save(args, argv, "fp8_step", found, markdown(found), smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
