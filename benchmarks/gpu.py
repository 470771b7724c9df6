"""(6) One GPU, one run: ``python -m benchmarks.gpu [--smoke] [--out DIR]``.

Measures, on one CUDA device, forward + backward of a GPT (default: the issue's shape, s=2048
h=2048 L=24 a=16 v=51200 b=4, bf16):

* our ``GPT`` (t=1) for every attention backend ``GPTConfig`` accepts (``math``, and ``sdpa``
  where the config has an ``attention`` field) x every recompute policy, eager, and compiled
  per transformer layer (``torch.compile``) where that runs;
* the same GPT in plain PyTorch (:mod:`benchmarks.dtensor_gpt`'s modules, not parallelised)
  with ``F.scaled_dot_product_attention``, eager and under ``torch.compile``, and with the
  math attention core, eager;
* ``python cli.py fit``'s path (the CLI's parser and defaults, ``Trainer``, strategy
  ``megatron_sp``, the monitors and the progress bar) against a plain loop over the same
  ``GPTModule`` (forward, backward, AdamW, schedule) on the same data.

For each: tokens/s, MFU against the bf16 GEMM rate measured in the same run
(:func:`lightning_sp.memory.flops.measure_peak_flops`, 8192² matmuls), peak memory
(``torch.cuda.max_memory_allocated``) and bytes held per layer (saved-tensor hooks, beside the
formula the ActivationMemoryMonitor uses). Timing: ``warmup`` steps, then ``steps`` steps
between two device synchronisations. Writes ``gpu.md`` and ``gpu.json`` into ``--out``
(default ``benchmarks/results``).

Without CUDA it refuses in one line (exit 2). ``--device cpu --smoke`` runs every piece on the
CPU at a tiny shape to check the plumbing; its numbers mean nothing and its report says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks import dtensor_gpt
from benchmarks._gpu_fit import fit_section
from lightning_sp.callbacks.memory import ActivationMemoryMonitor
from lightning_sp.errors import ConfigError
from lightning_sp.memory.flops import measure_peak_flops, model_flops_per_iteration
from lightning_sp.memory.saved import SavedTensorTracker
from lightning_sp.model.config import RECOMPUTE_POLICIES, GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.state import ParallelState

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Shape:
    """The GPT measured: ``s`` sequence, ``h`` hidden, ``layers``, ``heads``, ``vocab``, ``b``."""

    s: int
    h: int
    layers: int
    heads: int
    vocab: int
    b: int

    def config(self, **fields: Any) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab, seq_length=self.s, hidden_size=self.h,
            num_layers=self.layers, num_heads=self.heads, **fields,
        )  # fmt: skip


FULL = Shape(s=2048, h=2048, layers=24, heads=16, vocab=51200, b=4)
SMOKE = Shape(s=128, h=128, layers=2, heads=4, vocab=512, b=2)


def attention_backends() -> list[str]:
    """The attention backends ``GPTConfig`` accepts: ``["math"]`` while it has no
    ``attention`` field, else the values of its annotation that ``validate`` lets through."""
    if "attention" not in {f.name for f in dataclasses.fields(GPTConfig)}:
        return ["math"]
    try:
        candidates = typing.get_args(typing.get_type_hints(GPTConfig)["attention"])
    except (NameError, TypeError):
        candidates = ()
    valid = []
    for name in candidates or ("math", "sdpa"):
        try:
            GPTConfig(attention=name).validate()
        except ConfigError:
            continue
        valid.append(name)
    return valid


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_step(
    step: Callable[[], None], device: torch.device, warmup: int, steps: int
) -> float:
    """Mean seconds of ``step`` over ``steps`` calls after ``warmup`` (two syncs in all)."""
    for _ in range(warmup):
        step()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize(device)
    return (time.perf_counter() - start) / steps


class PlainSDPAAttention(dtensor_gpt.Attention):
    """The plain-PyTorch attention with ``F.scaled_dot_product_attention`` as its core."""

    def _core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, s, d = q.shape  # [b·a, s, d] -> [b, a, s, d] (what the fused kernels take)
        heads = n // self._batch
        q, k, v = (x.view(self._batch, heads, s, d) for x in (q, k, v))
        p = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return out.view(n, s, d)

    def forward(self, x: Tensor) -> Tensor:
        self._batch = x.shape[1]  # [s, b, h]
        return super().forward(x)


def plain_gpt(config: GPTConfig, sdpa: bool) -> nn.Module:
    """The same GPT in plain PyTorch (``nn.Linear``, ``F.dropout``), attention core SDPA or
    math; recomputation as ``config.recompute`` (``torch.utils.checkpoint``)."""
    model = dtensor_gpt.DTensorGPT(config)
    if sdpa:
        for layer in model.layers:
            plain = typing.cast(dtensor_gpt.Attention, layer.attention)
            attention = PlainSDPAAttention(config, plain.selective)
            attention.load_state_dict(plain.state_dict())
            layer.attention = attention
    return model


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each transformer layer of ``model`` in place."""
    for layer in model.layers:  # type: ignore[union-attr]
        layer.compile()


def measure_model(
    model: nn.Module, config: GPTConfig, shape: Shape, args: argparse.Namespace, peak: float,
    formula: Callable[[nn.Module], float] | None = None, held_bytes: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Tokens/s, MFU, peak memory and bytes per layer of forward + backward of ``model``."""
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab, (shape.b, shape.s + 1), generator=generator)
    ids, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    model.train()

    def step() -> None:
        model(ids, labels).backward()
        model.zero_grad(set_to_none=True)

    result: dict[str, Any] = {}
    if held_bytes:  # before any compiled call: saved-tensor hooks see the eager layers
        with SavedTensorTracker.for_model(model) as tracker:
            loss = model(ids, labels)
        del loss
        per_layer = [tracker.report.bytes_of(f"layers.{i}") for i in range(shape.layers)]
        sbh = shape.s * shape.b * shape.h
        result["held_sbh_per_layer"] = statistics.mean(per_layer) / sbh
        if formula is not None:
            result["formula_sbh_per_layer"] = formula(model) / sbh
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        seconds = seconds_per_step(step, device, args.warmup, args.steps)
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


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def models_section(shape: Shape, args: argparse.Namespace, peak: float) -> list[dict[str, Any]]:
    """Our GPT per backend x policy (eager, and compiled for ``none``), and the plain GPT."""
    device, dtype = torch.device(args.device), torch.bfloat16
    rows: list[dict[str, Any]] = []
    dropout = {"hidden_dropout": args.dropout, "attention_dropout": args.dropout}
    monitor = ActivationMemoryMonitor()  # its formula: what a training run reports beside

    def formula(model: nn.Module) -> float:
        assert isinstance(model, GPT)
        return monitor._formula_per_layer(model, shape.b, shape.s)

    for backend in [b for b in attention_backends() if b in args.backends]:
        extra = {"attention": backend} if _has_attention_field() else {}
        for policy in [p for p in RECOMPUTE_POLICIES if p in args.policies]:
            config = shape.config(recompute=policy, **dropout, **extra)
            variants = [False, True] if policy == "none" and args.compile else [False]
            for compiled in variants:
                torch.manual_seed(0)
                model = GPT(config, ParallelState.single(device), dtype=dtype, device=device)
                if compiled:
                    compile_layers(model)
                row = measure_model(
                    model, config, shape, args, peak, formula, held_bytes=not compiled
                )
                rows.append(
                    {
                        "model": "lightning-sp",
                        "attention": backend,
                        "recompute": policy,
                        "compiled": compiled,
                        **row,
                    }
                )
                print(_line(rows[-1]), flush=True)
                del model
                _free(device)
    for sdpa, compiled in ((True, False), (True, True), (False, False)):
        if (compiled and not args.compile) or not args.plain:
            continue
        config = shape.config(recompute="none", **dropout)
        with torch.device(device):  # initialised there: on the CPU 1.2B took over a minute
            plain: nn.Module = plain_gpt(config, sdpa).to(dtype=dtype)
        if compiled:
            plain = torch.compile(plain)  # type: ignore[assignment]
        row = measure_model(plain, config, shape, args, peak, held_bytes=not compiled)
        rows.append(
            {
                "model": "plain PyTorch",
                "attention": "sdpa" if sdpa else "math",
                "recompute": "none",
                "compiled": compiled,
                **row,
            }
        )
        print(_line(rows[-1]), flush=True)
        del plain
        _free(device)
    return rows


def _has_attention_field() -> bool:
    return "attention" in {f.name for f in dataclasses.fields(GPTConfig)}


def _line(row: dict[str, Any]) -> str:
    name = f"{row['model']} {row['attention']} {row['recompute']}" + (
        " compiled" if row["compiled"] else ""
    )
    if "error" in row:
        return f"{name}: {row['error']}"
    return f"{name}: {row['tokens_per_sec']:.0f} tok/s, MFU {100 * row['mfu']:.1f}%"


def _markdown(result: dict[str, Any]) -> str:
    meta, lines = result["meta"], []
    lines.append("## One GPU: lightning-sp vs plain PyTorch, and the Trainer path\n")
    if meta["device"] != "cuda":
        lines.append(
            "**Plumbing check on CPU (`--device cpu`), not a GPU measurement: the numbers "
            "below mean nothing.**\n"
        )
    lines.append(
        f"{meta['device_name']}, torch {meta['torch']}; GPT s={meta['shape']['s']} "
        f"h={meta['shape']['h']} L={meta['shape']['layers']} a={meta['shape']['heads']} "
        f"v={meta['shape']['vocab']} b={meta['shape']['b']}, bf16, dropout {meta['dropout']}, "
        f"forward+backward; MFU against the bf16 GEMM rate measured in this run "
        f"({meta['gemm_tflops']:.3g} TFLOP/s).\n"
    )
    lines.append("| model | attention | recompute | compiled | tokens/s | MFU | peak memory | "
                 "held per layer (sbh) | formula (sbh) |")  # fmt: skip
    lines.append("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in result["models"]:
        if "error" in row:
            cells = [row["error"], "", "", "", ""]
        else:
            peak = row.get("peak_memory_bytes")
            cells = [
                f"{row['tokens_per_sec']:,.0f}",
                f"{100 * row['mfu']:.1f}%",
                f"{peak / 2**30:.1f} GiB" if peak else "—",
                f"{row['held_sbh_per_layer']:.2f}" if "held_sbh_per_layer" in row else "—",
                f"{row['formula_sbh_per_layer']:.2f}" if "formula_sbh_per_layer" in row else "—",
            ]
        lines.append(
            f"| {row['model']} | {row['attention']} | {row['recompute']} | "
            f"{'yes' if row['compiled'] else 'no'} | " + " | ".join(cells) + " |"
        )
    fit = result.get("fit")
    if fit:
        lines.append(
            f"\n`cli.py fit` ({fit['recompute']}): {fit['fit_tokens_per_sec']:,.0f} tokens/s; "
            f"a plain loop over the same GPTModule: {fit['loop_tokens_per_sec']:,.0f} tokens/s; "
            f"ratio {fit['ratio']:.3f} (goal >= 0.95)."
        )
    for goal in result.get("goals", []):
        lines.append(f"- {goal}")
    return "\n".join(lines) + "\n"


def _goals(rows: list[dict[str, Any]]) -> list[str]:
    def find(model: str, attention: str, compiled: bool) -> dict[str, Any] | None:
        for row in rows:
            if (row["model"], row["attention"], row["recompute"], row["compiled"]) == (
                model, attention, "none", compiled,
            ) and "error" not in row:  # fmt: skip
                return row
        return None

    goals = []
    for compiled in (False, True):
        ours, plain = (
            find("lightning-sp", "sdpa", compiled),
            find("plain PyTorch", "sdpa", compiled),
        )
        if ours and plain:
            ratio = ours["tokens_per_sec"] / plain["tokens_per_sec"]
            goals.append(
                f"sdpa none {'compiled' if compiled else 'eager'}: lightning-sp / plain = "
                f"{ratio:.3f} (goal >= 1.0), MFU {100 * ours['mfu']:.1f}%"
            )
    return goals


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shape (seconds)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a plumbing check only (with --smoke)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where gpu.md/json go")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (3; smoke 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (10; smoke 2)")
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the torch.compile variants")  # fmt: skip
    parser.add_argument(
        "--backends",
        type=lambda v: v.split(","),
        default=attention_backends(),
        help="attention backends of our GPT, comma-separated (default: all)",
    )
    parser.add_argument(
        "--policies",
        type=lambda v: v.split(","),
        default=RECOMPUTE_POLICIES,
        help="recompute policies of our GPT, comma-separated (default: all)",
    )
    parser.add_argument(
        "--no-plain", dest="plain", action="store_false", help="skip the plain PyTorch GPTs"
    )
    parser.add_argument("--no-fit", dest="fit", action="store_false",
                        help="skip cli.py fit vs the plain loop")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: benchmarks.gpu needs a CUDA device and torch.cuda.is_available() is False "
            "(for a CPU plumbing check: --device cpu --smoke)",
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu" and not args.smoke:
        print("error: --device cpu is a plumbing check only; add --smoke", file=sys.stderr)
        return 2
    shape = SMOKE if args.smoke else FULL
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 10)
    device = torch.device(args.device)
    peak = measure_peak_flops(torch.bfloat16, device, size=256 if args.smoke else 8192)
    print(f"bf16 GEMM rate: {peak / 1e12:.1f} TFLOP/s", flush=True)
    result: dict[str, Any] = {
        "meta": {
            "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__,
            "shape": dataclasses.asdict(shape),
            "smoke": args.smoke,
            "dropout": args.dropout,
            "warmup": args.warmup,
            "steps": args.steps,
            "gemm_tflops": peak / 1e12,
            "backends": attention_backends(),
        },
    }
    result["models"] = models_section(shape, args, peak)
    result["goals"] = _goals(result["models"])
    if args.fit:
        result["fit"] = fit_section(shape, args)
        print(f"fit / loop: {result['fit']['ratio']:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "gpu.md").write_text(_markdown(result))
    print(f"wrote {args.out / 'gpu.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
