"""The MoE layer's forward + backward time per token on one CUDA GPU, beside a dense SwiGLU
of the same active FLOPs and transformers' ``MixtralSparseMoeBlock`` on the same weights:
``python -m benchmarks.moe_gpu [--smoke] [--device cpu]``.

The GPU twin of :mod:`benchmarks.moe` (whose CPU run is the issue's benchmark): the same four
layers built by :func:`benchmarks.moe.build`, moved to the device in ``--dtype`` (bf16 by
default, where ``torch._grouped_mm`` runs on Hopper), the same rotated rounds and per-round
ratios with 95% bootstrap intervals. Timing: a device synchronisation before and after each
layer's forward + backward, wall clock between them. Before any timing our layer's output and
input gradient must agree with transformers' blocks to the dtype's tolerance (relative
Frobenius error below :data:`REL_TOL`). ``--device cpu`` runs the plumbing on the CPU (numbers
meaningless there; :mod:`benchmarks.moe` is the CPU benchmark).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch
from torch import Tensor

from benchmarks._format import add_out_argument, ci, command, fixed, out_dir, table, write
from benchmarks.moe import IMPLEMENTATIONS, MoEShape, build, medians, ratios, step

REL_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
"""Relative Frobenius error allowed between our layer and transformers' (per dtype)."""

FULL = MoEShape(hidden_size=2048, num_experts=8, top_k=2, expert_ffn_size=4096, tokens=16384,
                rounds=20, warmup=3)  # fmt: skip
SMOKE = MoEShape(hidden_size=64, num_experts=4, top_k=2, expert_ffn_size=128, tokens=256,
                 rounds=2, warmup=1)  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _check(layers: dict[str, Any], x: Tensor, grad: Tensor, dtype: torch.dtype) -> dict[str, float]:
    """Our output and input gradient against each transformers block: the relative errors
    (raises AssertionError above :data:`REL_TOL`)."""
    ours = step(layers["moe"], x, grad, hf=False)
    errors = {}
    for name in ("hf", "hf_eager"):
        theirs = step(layers[name], x, grad, hf=True)
        for what, a, b in zip(("output", "input_grad"), ours, theirs, strict=True):
            error = ((a.float() - b.float()).norm() / b.float().norm()).item()
            errors[f"{name}_{what}"] = error
            assert error < REL_TOL[dtype], f"moe and {name} disagree on the {what}: {error:.3g}"
    return errors


def measure(shape: MoEShape, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """µs per token of each layer (medians) and our layer over each (median ratio, 95% CI)."""
    torch.manual_seed(0)
    layers = {name: layer.to(device, dtype) for name, layer in build(shape).items()}
    x = torch.randn(shape.tokens, 1, shape.hidden_size, device=device, dtype=dtype)  # [T, 1, h]
    grad = torch.randn_like(x)
    errors = _check(layers, x, grad, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for r in range(shape.warmup + shape.rounds):
        order = IMPLEMENTATIONS[r % 4 :] + IMPLEMENTATIONS[: r % 4]
        for name in order:
            sync()
            start = time.perf_counter()
            step(layers[name], x, grad, hf=name.startswith("hf"))
            sync()
            if r >= shape.warmup:
                seconds[name].append((time.perf_counter() - start) / shape.tokens)
    rounds = list(range(shape.rounds))
    return {
        "shape": dataclasses.asdict(shape),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "relative_errors": errors,
        "us_per_token": medians(seconds, rounds),
        "ratios": ratios(seconds, rounds),
        "samples": seconds,
    }


def markdown(result: dict[str, Any]) -> str:
    """One table: µs per token of each layer and our layer over each, with its interval."""
    ratios = {name: ci(result["ratios"][f"moe_over_{name}"]) for name in IMPLEMENTATIONS[1:]}
    rows = [
        [name, fixed(result["us_per_token"][name], 3), ratios.get(name, "")]
        for name in IMPLEMENTATIONS
    ]
    head = f"{result['device']}, {result['dtype']}, torch {result['torch']}\n\n"
    return head + table(["layer", "fwd+bwd µs / token", "ours / it [95% CI]"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, seconds")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "benchmarks.moe_gpu: no CUDA device here (--device cpu checks plumbing)\n")
    result = measure(SMOKE if args.smoke else FULL, torch.device(args.device), DTYPES[args.dtype])
    result["meta"] = {"command": command("benchmarks.moe_gpu", argv)}
    name = f"moe_gpu_{args.dtype}"
    write(out_dir(args.out, args.smoke or args.device == "cpu"), name, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
