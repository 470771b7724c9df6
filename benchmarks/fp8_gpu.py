"""FP8 GEMMs on one GPU: ``python -m benchmarks.fp8_gpu [--smoke] [--device cpu] [--out DIR]``.

Forward + backward of the 1.2B GPT's MLP (``h=2048 -> f=8192 -> h``, GeLU, no bias, 8,192
tokens: ``benchmarks.gpu``'s shape), bf16 weights and activations, in these variants, eager and
under ``torch.compile``:

* ``bf16``: two ``nn.Linear``;
* ``torchao tensorwise`` / ``rowwise``: the same converted by ``convert_to_float8_training``;
* ``ours tensorwise`` / ``rowwise``: :func:`lightning_sp.parallel.fp8.fp8_column_parallel_linear`
  and :func:`~lightning_sp.parallel.fp8.fp8_row_parallel_matmul` at ``t = 1``.

Timing: every variant once per round, rounds interleaved, each step between two device
synchronisations; per variant the median seconds, and its ratio to bf16 eager as the median of
the per-round ratios with a 95% bootstrap interval (:mod:`benchmarks._stats`). Each FP8 variant's
output is checked against torchao's of the same recipe (relative to the largest value).

Without CUDA it refuses (exit 2); ``--device cpu --smoke`` runs every variant with torchao's
emulated GEMMs at a tiny shape to check the plumbing (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._format import add_out_argument, ci, command, out_dir, table, write
from benchmarks._stats import median_ci
from lightning_sp.parallel.fp8 import (
    RECIPES,
    FP8Config,
    Recipe,
    fp8_column_parallel_linear,
    fp8_row_parallel_matmul,
)


@dataclasses.dataclass(frozen=True)
class MLPShape:
    tokens: int = 8192
    h: int = 2048
    f: int = 8192
    warmup: int = 3
    rounds: int = 10


FULL = MLPShape()
SMOKE = MLPShape(tokens=64, h=32, f=64, warmup=1, rounds=2)


class OurFP8MLP(nn.Module):
    """The MLP through our FP8 parallel linears at ``t = 1``."""

    def __init__(self, plain: nn.Sequential, recipe: Recipe) -> None:
        super().__init__()
        first, second = plain[0], plain[2]
        assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
        self.w1, self.w2 = first.weight, second.weight
        self.recipe = recipe

    def forward(self, x: Tensor) -> Tensor:
        z = fp8_column_parallel_linear(x, self.w1, None, self.recipe, None, False)
        return fp8_row_parallel_matmul(nn.functional.gelu(z), self.w2, self.recipe, None)


def _variants(shape: MLPShape, device: torch.device, emulate: bool) -> dict[str, nn.Module]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def plain() -> nn.Sequential:
        torch.manual_seed(0)
        with torch.device(device):
            mlp = nn.Sequential(nn.Linear(shape.h, shape.f, bias=False), nn.GELU(),
                                nn.Linear(shape.f, shape.h, bias=False))  # fmt: skip
        return mlp.to(torch.bfloat16)

    variants: dict[str, nn.Module] = {"bf16": plain()}
    for recipe in RECIPES:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        variants[f"torchao {recipe}"] = convert_to_float8_training(plain(), config=config)
        variants[f"ours {recipe}"] = OurFP8MLP(plain(), Recipe.build(FP8Config(recipe, emulate)))
    return variants


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(fn: Any, x: Tensor, grad: Tensor) -> Tensor:
    """Forward + backward of ``fn`` on a fresh leaf ``x``; the output."""
    out = fn(x.detach().requires_grad_(True))
    out.backward(grad)
    return out.detach()


def measure(shape: MLPShape, device: torch.device, compile_too: bool) -> dict[str, Any]:
    emulate = device.type != "cuda"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape.tokens, 1, shape.h, generator=generator).to(device, torch.bfloat16)
    grad = torch.randn(shape.tokens, 1, shape.h, generator=generator).to(device, torch.bfloat16)
    models = _variants(shape, device, emulate)
    steps: dict[str, Callable[[], Tensor]] = {}
    for name, model in models.items():
        for compiled in (False, True) if compile_too else (False,):
            fn = torch.compile(model) if compiled else model
            label = f"{name}{' compiled' if compiled else ''}"

            steps[label] = functools.partial(_step, fn, x, grad)
    outputs = {label: step() for label, step in steps.items()}  # compiles
    agreement = {}
    for label, out in outputs.items():
        if label.startswith("ours"):
            ref = outputs[label.replace("ours", "torchao")].float()
            agreement[label] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    for _ in range(shape.warmup):
        for step in steps.values():
            step()
    seconds: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(shape.rounds):
        for label, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            seconds[label].append(time.perf_counter() - start)
    base = seconds["bf16"]
    flops = 3 * 2 * 2 * shape.tokens * shape.h * shape.f  # two GEMMs, forward + 2 backward
    return {
        "rows": [
            {
                "variant": label,
                "seconds": statistics.median(values),
                "tflops": flops / statistics.median(values) / 1e12,
                "over_bf16_eager": median_ci([v / b for v, b in zip(values, base, strict=True)]),
                "max_rel_diff_vs_torchao": agreement.get(label),
            }
            for label, values in seconds.items()
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8_gpu", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shape (seconds)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: benchmarks.fp8_gpu needs a CUDA device (for a CPU plumbing check: "
              "--device cpu --smoke)", file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cpu" and not args.smoke:
        print("error: --device cpu is a plumbing check only; add --smoke", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    shape = SMOKE if args.smoke else FULL
    measured = measure(shape, device, args.compile)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (emulated)"
    result = {
        "meta": {
            "command": command("benchmarks.fp8_gpu", argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device_name": name,
            "torch": torch.__version__,
            "shape": dataclasses.asdict(shape),
            "smoke": args.smoke,
        },
        **measured,
    }
    rows = []
    for r in measured["rows"]:
        diff = r["max_rel_diff_vs_torchao"]
        cells = [f"{1e3 * r['seconds']:.2f}", f"{r['tflops']:.1f}", ci(r["over_bf16_eager"])]
        rows.append([r["variant"], *cells, "" if diff is None else f"{diff:.1e}"])
    header = ["variant", "ms", "TFLOP/s", "/ bf16 eager (95% CI)", "vs torchao (max rel)"]
    note = (
        "" if device.type == "cuda" else "**Plumbing check on CPU: the numbers mean nothing.**\n\n"
    )
    markdown = (
        f"{note}FP8 MLP forward + backward on {name}: {shape.tokens} tokens, h={shape.h}, "
        f"f={shape.f}, bf16, {shape.rounds} interleaved rounds.\n\n" + table(header, rows)
    )
    write(out_dir(args.out, args.smoke), "fp8_gpu", result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
