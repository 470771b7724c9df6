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

The command is :mod:`benchmarks.gpu`'s ``fp8`` section (its options): without CUDA it refuses
(exit 2); ``--device cpu --smoke`` runs every variant with torchao's
emulated GEMMs at a tiny shape to check the plumbing (its numbers mean nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._fit import layer_step
from benchmarks._format import PLUMBING, ci, device_name, table
from benchmarks._stats import device_sync, interleaved, ratio_ci
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


def measure(shape: MLPShape, device: torch.device, compile_too: bool) -> dict[str, Any]:
    """Every variant checked against torchao's of its recipe, then timed in interleaved rounds."""
    emulate = device.type != "cuda"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape.tokens, 1, shape.h, generator=generator).to(device, torch.bfloat16)
    grad = torch.randn(shape.tokens, 1, shape.h, generator=generator).to(device, torch.bfloat16)
    steps: dict[str, Callable[[], tuple[Tensor, Tensor]]] = {}
    for name, model in _variants(shape, device, emulate).items():
        for compiled in (False, True) if compile_too else (False,):
            fn: nn.Module = torch.compile(model) if compiled else model  # type: ignore[assignment]
            label = f"{name}{' compiled' if compiled else ''}"
            steps[label] = functools.partial(layer_step, fn, x, grad)
    outputs = {label: step()[0] for label, step in steps.items()}  # compiles
    agreement = {}
    for label, out in outputs.items():
        if label.startswith("ours"):
            ref = outputs[label.replace("ours", "torchao")].float()
            agreement[label] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    seconds = interleaved(steps, shape.warmup, shape.rounds, device_sync(device))
    flops = 3 * 2 * 2 * shape.tokens * shape.h * shape.f  # two GEMMs, forward + 2 backward
    return {
        "device_name": device_name(device, "CPU (emulated)"),
        "shape": dataclasses.asdict(shape),
        "rows": [
            {
                "variant": label,
                "seconds": statistics.median(values),
                "tflops": flops / statistics.median(values) / 1e12,
                "over_bf16_eager": ratio_ci(values, seconds["bf16"]),
                "max_rel_diff_vs_torchao": agreement.get(label),
            }
            for label, values in seconds.items()
        ],
    }


def markdown(found: dict[str, Any]) -> str:
    """One table: per variant ms, TFLOP/s, the ratio to bf16 eager and the agreement."""
    rows = []
    for r in found["rows"]:
        diff = r["max_rel_diff_vs_torchao"]
        cells = [f"{1e3 * r['seconds']:.2f}", f"{r['tflops']:.1f}", ci(r["over_bf16_eager"])]
        rows.append([r["variant"], *cells, "" if diff is None else f"{diff:.1e}"])
    header = ["variant", "ms", "TFLOP/s", "/ bf16 eager (95% CI)", "vs torchao (max rel)"]
    name, s = found["device_name"], found["shape"]
    return (
        f"{PLUMBING if 'emulated' in name else ''}FP8 MLP forward + backward on {name}: "
        f"{s['tokens']} tokens, h={s['h']}, f={s['f']}, bf16, {s['rounds']} interleaved rounds.\n\n"
        + table(header, rows)
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.gpu --only fp8`` with these arguments (its exit status)."""
    from benchmarks import gpu

    return gpu.main(["--only", "fp8", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
