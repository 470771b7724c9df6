"""(6) One GPU, one run: ``python -m benchmarks.gpu [--smoke] [--only SECTIONS] [--out DIR]``.

On one CUDA device (default GPT: the issue's shape, s=2048 h=2048 L=24 a=16 v=51200 b=4, bf16):

* ``models``: forward + backward of our ``GPT`` (t=1) per attention backend x recompute policy,
  eager, and compiled per layer (``torch.compile``) without recomputation; of the same GPT in
  plain PyTorch (:class:`lightning_sp.testing.dtensor_gpt.DTensorGPT`, not parallelised) with
  SDPA, eager and compiled, and with the math core. Each: tokens/s, MFU against the bf16 GEMM
  rate measured in the run (8192² matmuls), peak memory and bytes held per layer (saved-tensor
  hooks, beside the ActivationMemoryMonitor's formula); ``warmup`` steps, then ``steps``
  between two syncs.
* ``fit``: ``cli.py fit``'s path (the CLI's parser and defaults, ``Trainer``, ``megatron_sp``,
  ``bf16-true``, the monitors, the progress bar) against a plain loop over the same
  ``GPTModule`` (forward, backward, AdamW, schedule) on the same batches, ``recompute:
  selective``: :func:`benchmarks.fit_overhead.measure` on the device, ``steps`` interleaved
  rounds after ``warmup`` fit steps, each step between two device synchronisations.
* ``moe``: :func:`benchmarks.moe.measure_on`, the MoE layer beside a dense SwiGLU and
  transformers' block in ``--dtype`` at h=2048, E=8, f_e=4096, top-2, 16,384 tokens.
* ``fp8`` (only when named; ``python -m benchmarks.fp8_gpu`` is the same):
  :func:`benchmarks.fp8_gpu.measure`, the MLP's GEMMs in bf16 and FP8, ours and torchao's.

Writes ``gpu.md``/``.json`` (models, fit), ``moe_gpu_DTYPE.md``/``.json`` and
``fp8_gpu.md``/``.json`` into ``--out``.
Without CUDA it refuses in one line (exit 2). ``--device cpu --smoke`` runs every piece on the
CPU at tiny shapes to check the plumbing; its numbers mean nothing and its report says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks import _fit, _format, fit_overhead, fp8_gpu, moe
from benchmarks._fit import FULL, Shape
from benchmarks._fit_rounds import FitShape
from benchmarks._format import ci, command, device_name, out_dir, stamp, table, write
from lightning_sp.callbacks.memory import ActivationMemoryMonitor
from lightning_sp.memory.flops import measure_peak_flops, model_flops_per_iteration
from lightning_sp.model.config import RECOMPUTE_POLICIES, GPTConfig
from lightning_sp.model.cores import ATTENTION_BACKENDS
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing import dtensor_gpt

SECTIONS = ("models", "fit", "moe", "fp8")
DEFAULT_SECTIONS = SECTIONS[:3]
"""``fp8`` (:mod:`benchmarks.fp8_gpu`, needs torchao) runs only when named."""


SMOKE = Shape(s=128, h=128, layers=2, heads=4, vocab=512, b=2)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def attention_backends() -> list[str]:
    """The attention backends ``GPTConfig`` accepts (``ATTENTION_BACKENDS``)."""
    return list(ATTENTION_BACKENDS)


def measure_model(
    model: nn.Module, config: GPTConfig, shape: Shape, args: argparse.Namespace, peak: float,
    formula: Callable[[nn.Module], float] | None = None, held_bytes: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Tokens/s, MFU, peak memory and bytes per layer of forward + backward of ``model``."""
    device = torch.device(args.device)
    ids, labels = _fit.batch(shape.vocab, shape.b, shape.s, device)
    model.train()
    result: dict[str, Any] = {}
    if held_bytes:  # before any compiled call: saved-tensor hooks see the eager layers
        per_layer = _fit.held_per_layer(model, ids, labels)[0]
        sbh = shape.s * shape.b * shape.h
        result["held_sbh_per_layer"] = statistics.mean(per_layer) / sbh
        if formula is not None:
            result["formula_sbh_per_layer"] = formula(model) / sbh
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        step = functools.partial(_fit.train_step, model, ids, labels)
        seconds = _fit.seconds_per_step(step, device, args.warmup, args.steps)
    except Exception as error:  # a variant that cannot run here is reported, not fatal
        return {**result, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    flops = model_flops_per_iteration(config, shape.b)
    result.update(
        seconds_per_step=seconds,
        tokens_per_sec=shape.b * shape.s / seconds,
        model_tflops_per_sec=flops / seconds / 1e12,
        mfu=flops / seconds / peak,
    )
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def models_section(shape: Shape, args: argparse.Namespace, peak: float) -> list[dict[str, Any]]:
    """Our GPT per backend x policy (eager, and compiled for ``none``), and the plain GPT."""
    device = torch.device(args.device)
    monitor = ActivationMemoryMonitor()  # its formula: what a training run reports beside

    def formula(model: nn.Module) -> float:
        assert isinstance(model, GPT)
        return monitor._formula_per_layer(model, shape.b, shape.s)

    cases = [  # (model, attention, recompute, compiled)
        ("lightning-sp", attention, policy, compiled)
        for attention in attention_backends() if attention in args.backends
        for policy in RECOMPUTE_POLICIES if policy in args.policies
        for compiled in ([False, True] if policy == "none" and args.compile else [False])
    ]  # fmt: skip
    if args.plain:
        cases += [("plain PyTorch", "sdpa", "none", False)]
        cases += [("plain PyTorch", "sdpa", "none", True)] if args.compile else []
        cases += [("plain PyTorch", "math", "none", False)]
    rows: list[dict[str, Any]] = []
    for name, attention, policy, compiled in cases:
        config = shape.config(policy, args.dropout, attention=attention)
        torch.manual_seed(0)
        model: nn.Module
        if name == "lightning-sp":
            model = GPT(config, ParallelState.single(device), dtype=torch.bfloat16, device=device)
            for layer in model.layers if compiled else []:
                layer.compile()
        else:
            with torch.device(device):  # initialised there: on the CPU 1.2B took over a minute
                model = dtensor_gpt.DTensorGPT(config).to(dtype=torch.bfloat16)
            model = torch.compile(model) if compiled else model  # type: ignore[assignment]
        ours = formula if name == "lightning-sp" else None
        row = measure_model(model, config, shape, args, peak, ours, held_bytes=not compiled)
        rows.append({"model": name, "attention": attention, "recompute": policy,
                     "compiled": compiled, **row})  # fmt: skip
        print(_line(rows[-1]), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def fit_section(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`benchmarks.fit_overhead.measure` on the device, ``bf16-true``, ``selective``: the
    tokens/s of ``cli.py fit`` and of the plain loop (medians over interleaved rounds), and the
    ratio of the two."""
    fit = FitShape(**dataclasses.asdict(shape), warmup=args.warmup, rounds=args.steps,
                   counted_steps=1, profiled_steps=1)  # fmt: skip
    measured = fit_overhead.measure(fit, torch.device(args.device), "bf16-true", args.dropout)
    seconds = measured["median_seconds"]
    tokens = shape.b * shape.s
    return {"recompute": fit.recompute, "fit_tokens_per_sec": tokens / seconds["fit"],
            "loop_tokens_per_sec": tokens / seconds["bare"],
            "ratio": seconds["bare"] / seconds["fit"], "measured": measured}  # fmt: skip


def _line(row: dict[str, Any]) -> str:
    name = f"{row['model']} {row['attention']} {row['recompute']}"
    name += " compiled" if row["compiled"] else ""
    return f"{name}: " + (
        row.get("error") or f"{row['tokens_per_sec']:.0f} tok/s, MFU {100 * row['mfu']:.1f}%"
    )


def _goals(rows: list[dict[str, Any]]) -> list[str]:
    """Ours over plain PyTorch, both sdpa without recomputation, eager and compiled."""
    found = {
        (row["model"], row["compiled"]): row
        for row in rows
        if row["attention"] == "sdpa" and row["recompute"] == "none" and "error" not in row
    }
    goals = []
    for compiled in (False, True):
        ours, plain = found.get(("lightning-sp", compiled)), found.get(("plain PyTorch", compiled))
        if ours and plain:
            ratio = ours["tokens_per_sec"] / plain["tokens_per_sec"]
            goals.append(
                f"sdpa none {'compiled' if compiled else 'eager'}: lightning-sp / plain = "
                f"{ratio:.3f} (goal >= 1.0), MFU {100 * ours['mfu']:.1f}%"
            )
    return goals


def _markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = ["## One GPU: lightning-sp vs plain PyTorch, and the Trainer path\n"]
    if meta["device"] != "cuda":
        lines.append(_format.PLUMBING)
    shape = " ".join(f"{k}={v}" for k, v in meta["shape"].items())
    lines.append(
        f"{meta['device_name']}, torch {meta['torch']}; GPT {shape}, bf16, dropout "
        f"{meta['dropout']}, forward+backward; MFU against the bf16 GEMM rate measured in this "
        f"run ({meta['gemm_tflops']:.3g} TFLOP/s).\n"
    )
    rows = []
    for row in result.get("models", []):
        sbh = [
            f"{row[k]:.2f}" if k in row else "—"
            for k in ("held_sbh_per_layer", "formula_sbh_per_layer")
        ]
        peak = row.get("peak_memory_bytes")
        cells = [row["error"], "", "", "", ""] if "error" in row else [
            f"{row['tokens_per_sec']:,.0f}", f"{100 * row['mfu']:.1f}%",
            f"{peak / 2**30:.1f} GiB" if peak else "—", *sbh,
        ]  # fmt: skip
        compiled = "yes" if row["compiled"] else "no"
        rows.append([row["model"], row["attention"], row["recompute"], compiled, *cells])
    header = ["model", "attention", "recompute", "compiled", "tokens/s", "MFU", "peak memory",
              "held per layer (sbh)", "formula (sbh)"]  # fmt: skip
    lines.append(table(header, rows) if rows else "")
    if fit := result.get("fit"):
        lines.append(
            f"\n`cli.py fit` ({fit['recompute']}): {fit['fit_tokens_per_sec']:,.0f} tokens/s; "
            f"a plain loop over the same GPTModule: {fit['loop_tokens_per_sec']:,.0f} tokens/s; "
            f"ratio {fit['ratio']:.3f} (goal >= 0.95; fit / loop step time, median of the rounds' "
            f"ratios: {ci(fit['measured']['fit_over_bare'])})."
        )
    return "\n".join(lines + [f"- {goal}" for goal in result.get("goals", [])]) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    parser = _format.parser(__doc__, "tiny shapes (seconds)")
    add = parser.add_argument
    _format.add_device(parser)
    _format.add_only(parser, SECTIONS, DEFAULT_SECTIONS)
    add("--warmup", type=int, default=None, help="untimed steps (3; smoke 1)")
    add("--steps", type=int, default=None, help="timed steps (10; smoke 2)")
    add("--dropout", type=float, default=0.1, help="hidden and attention")
    add("--no-compile", dest="compile", action="store_false", help="skip torch.compile variants")
    _format.add_only(parser, attention_backends(), attention_backends(), "backends")
    _format.add_only(parser, RECOMPUTE_POLICIES, RECOMPUTE_POLICIES, "policies")
    add("--no-plain", dest="plain", action="store_false", help="skip the plain PyTorch GPTs")
    add("--dtype", default="bf16", choices=sorted(DTYPES), help="of the MoE layers")
    args = parser.parse_args(argv)
    if _format.refused(args, "gpu"):
        return 2
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 10)
    device, out = torch.device(args.device), out_dir(args.out, args.smoke)
    shape = SMOKE if args.smoke else FULL
    meta = {"command": command("benchmarks.gpu", argv)}
    if "models" in args.only or "fit" in args.only:
        peak = measure_peak_flops(torch.bfloat16, device, size=256 if args.smoke else 8192)
        print(f"bf16 GEMM rate: {peak / 1e12:.1f} TFLOP/s", flush=True)
        result: dict[str, Any] = {"meta": {
            **meta, "device": device.type, "device_name": device_name(device),
            "torch": torch.__version__,
            "shape": dataclasses.asdict(shape), "smoke": args.smoke, "dropout": args.dropout,
            "warmup": args.warmup, "steps": args.steps, "gemm_tflops": peak / 1e12,
            "backends": attention_backends(),
        }}  # fmt: skip
        if "models" in args.only:
            result["models"] = models_section(shape, args, peak)
            result["goals"] = _goals(result["models"])
        if "fit" in args.only:
            result["fit"] = fit_section(shape, args)
            print(f"fit / loop: {result['fit']['ratio']:.3f}", flush=True)
        write(out, "gpu", result, _markdown(result))
    if "moe" in args.only:
        layers = moe.GPU_SMOKE if args.smoke else moe.GPU_FULL
        found = moe.measure_on(layers, device, DTYPES[args.dtype])
        write(out, f"moe_gpu_{args.dtype}", {"meta": meta, **found}, moe.markdown(found))
    if "fp8" in args.only:
        found = fp8_gpu.measure(fp8_gpu.SMOKE if args.smoke else fp8_gpu.FULL, device, args.compile)
        write(out, "fp8_gpu", {"meta": {**meta, **stamp(), "smoke": args.smoke}, **found},
              fp8_gpu.markdown(found))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
