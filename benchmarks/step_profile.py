"""Where one micro-batch's forward + backward spends its time on a GPU, beside what the step-time
model prices: ``python -m benchmarks.step_profile [--cases ...] [--cluster h200] [--out DIR]``
(``--device cpu --smoke``: a plumbing check whose numbers mean nothing).

Each case is our ``GPT`` on one device (t = p = d = 1, micro-batch ``b``), bf16, recompute none:

* ``published-1.7B``: the model of Megatron-LM's H100 row ``megatron-h100-1.7B``
  (:mod:`lightning_sp.planner.published`: s = 4096, h = 2048, 24 layers, 16 heads, v = 131072,
  attention and hidden dropout 0.1, SDPA, b = 1), whose prediction is 18% short of the published
  step; ``published-1.7B-nodrop`` the same with dropout 0 (what dropout costs here);
* ``gpu_1b``: ``configs/gpu_1b.yaml``'s model (s = 2048, h = 2048, 24 layers, v = 257, b = 4,
  dropout 0);
* ``published-1.7B-nodrop-compiled`` and ``gpu_1b-compiled``: the same with each layer under
  ``torch.compile`` (:func:`lightning_sp.model.compile.compile_layers`, inductor; without dropout
  and recomputation a layer traces as one graph, so its norms, residual adds and GeLU run as
  generated fused kernels): a measured stand-in for a stack that fuses its memory-bound kernels
  (Megatron's TransformerEngine ones, which the step-time model prices at the HBM rate), and
  where compiling our layers gains or does not (the embedding, the output layer and the cross
  entropy stay eager).

Per case: the median wall seconds of forward + backward (:func:`lightning_sp.planner.calibrate.
time_it`), and from ``torch.profiler`` over a few steps the GPU kernel time per step by kind
(:func:`kind`: ``gemm``, ``attention`` (the fused core), ``memory`` (every other kernel:
norms, elementwise, dropout, softmax, cross entropy, copies, reductions)), the kernel count per
step and the ten longest ``memory`` kernels; beside them the step-time model's same parts
(``gemm``, ``attention``, ``memory`` summed over the layers, the output layer and the
embedding) on ``--cluster``, so the gap between the model and the card is named by kind. The
weights are drawn on the device (``normal_(0, 0.02)``: the timing does not depend on the values,
and the CPU draw of the model's own initialisation takes ~20 s at this size).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import torch

from benchmarks._fit import batch, train_step
from benchmarks._format import PLUMBING, add_device, device_name, parser, refused, save, table
from lightning_sp.model.compile import CompileOptions, compile_layers
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.recompute import NO_RECOMPUTE
from lightning_sp.parallel.init import materialize
from lightning_sp.parallel.state import ParallelState
from lightning_sp.planner.calibrate import dtype_for, time_it
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.presets import load_cluster
from lightning_sp.planner.steptime import step_time

PUBLISHED_17B = GPTConfig(
    vocab_size=131072, seq_length=4096, hidden_size=2048, num_layers=24, num_heads=16,
    tie_embeddings=False, hidden_dropout=0.1, attention_dropout=0.1, attention="sdpa",
    recompute=NO_RECOMPUTE,
)  # fmt: skip
PUBLISHED_17B_NODROP = dataclasses.replace(PUBLISHED_17B, hidden_dropout=0.0, attention_dropout=0.0)
GPU_1B = GPTConfig(
    vocab_size=257, seq_length=2048, hidden_size=2048, num_layers=24, num_heads=16,
    hidden_dropout=0.0, attention_dropout=0.0, attention="sdpa", recompute=NO_RECOMPUTE,
)  # fmt: skip
CASES: dict[str, tuple[GPTConfig, int, bool]] = {  # config, micro-batch, layers compiled
    "published-1.7B": (PUBLISHED_17B, 1, False),
    "published-1.7B-nodrop": (PUBLISHED_17B_NODROP, 1, False),
    "gpu_1b": (GPU_1B, 4, False),
    "published-1.7B-nodrop-compiled": (PUBLISHED_17B_NODROP, 1, True),
    "gpu_1b-compiled": (GPU_1B, 4, True),
}
SMOKE = GPTConfig(
    vocab_size=512, seq_length=64, hidden_size=64, num_layers=2, num_heads=4, attention="sdpa",
    hidden_dropout=0.0, attention_dropout=0.0, recompute=NO_RECOMPUTE,
)  # fmt: skip
KINDS = ("gemm", "attention", "memory")


def kind(kernel: str) -> str:
    """A kernel's kind by its name: cuBLAS / CUTLASS GEMMs (``gemm``, ``nvjet``, ``xmma``,
    ``cutlass``; on a CPU ``aten::mm`` and its kin), the fused attention core (``flash``,
    ``fmha``, ``attention``), else ``memory``."""
    name = kernel.lower()
    if any(key in name for key in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(key in name for key in ("gemm", "nvjet", "xmma", "cutlass")):
        return "gemm"
    if name.split("::")[-1] in ("mm", "bmm", "addmm", "baddbmm"):  # a CPU profile's op names
        return "gemm"
    return "memory"


def build(config: GPTConfig, device: torch.device, compiled: str = "") -> GPT:
    """``config``'s GPT on ``device`` with weights drawn there (see the module docstring);
    with ``compiled`` (a ``torch.compile`` backend) each layer compiled with it."""
    model = GPT(config, ParallelState.single(device), dtype=dtype_for(device), device="meta")
    materialize(model, device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
        for buffer in model.buffers():
            buffer.zero_()
    if compiled:
        compile_layers(model.layers, CompileOptions(backend=compiled))
    return model.train()


def predicted(config: GPTConfig, b: int, cluster_name: str) -> dict[str, float]:
    """The step-time model's forward + backward of one micro-batch (t = p = d = 1) by kind:
    ``total`` (its ``pipeline`` part) and ``gemm`` / ``attention`` / ``memory`` over the layers
    (the output layer and the embedding are in ``total`` only)."""
    from lightning_sp.planner.layertime import layer_time

    cluster = load_cluster(cluster_name)
    layout = Layout(config=config, micro_batch_size=b)
    layer = layer_time(config.activation_shape(None, b), cluster)
    parts = {k: config.num_layers * (layer.forward[k] + layer.backward[k]) for k in KINDS}
    return {"total": step_time(layout, cluster).parts["pipeline"], **parts}


def profiled(step: Any, device: torch.device, steps: int) -> dict[str, Any]:
    """GPU kernel seconds per step by :func:`kind`, kernels per step, the longest ``memory``
    kernels (name, seconds per step, calls per step)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    by_kind = dict.fromkeys(KINDS, 0.0)
    memory: dict[str, list[float]] = {}
    count = 0
    for event in prof.key_averages():
        # on a CPU (plumbing only) each op's self time: nested ops are not counted twice
        seconds = event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if seconds <= 0:
            continue
        count += event.count
        k = kind(event.key)
        by_kind[k] += seconds * 1e-6 / steps
        if k == "memory":
            memory[event.key[:90]] = [seconds * 1e-6 / steps, event.count / steps]
    longest = sorted(memory.items(), key=lambda kv: -kv[1][0])[:10]
    return {
        "kernel_seconds": by_kind,
        "kernels_per_step": count / steps,
        "longest_memory": [{"kernel": n, "seconds": s, "calls": c} for n, (s, c) in longest],
    }


def measure(name: str, config: GPTConfig, b: int, device: torch.device, cluster: str,
            seconds: float, steps: int, compiled: str = "") -> dict[str, Any]:  # fmt: skip
    """One case: wall time, profile and prediction; ``compiled``: the layers' ``torch.compile``
    backend (``""``: eager). The first timed call compiles (``time_it``'s warm-up call)."""
    from torch._dynamo.utils import counters

    ids, labels = batch(config.vocab_size, b, config.seq_length, device)
    step = functools.partial(train_step, build(config, device, compiled), ids, labels)
    breaks = sum(counters["graph_break"].values())
    wall = time_it(step, device, seconds)
    breaks = sum(counters["graph_break"].values()) - breaks  # 0 eager; compiled: 0 is one graph
    found = profiled(step, device, steps)
    model_parts = predicted(config, b, cluster)
    return {"case": name, "b": b, "compiled": compiled, "graph_breaks": breaks,
            "measured_seconds": wall, **found, "predicted": model_parts,
            "measured_over_predicted": wall / model_parts["total"]}  # fmt: skip


def markdown(found: dict[str, Any]) -> str:
    header = ["case", "measured ms", "predicted ms", "ratio", "kernels/step",
              *(f"{k} ms (model)" for k in KINDS)]  # fmt: skip
    rows = [
        [r["case"], f"{1e3 * r['measured_seconds']:.1f}", f"{1e3 * r['predicted']['total']:.1f}",
         f"{r['measured_over_predicted']:.3f}", f"{r['kernels_per_step']:.0f}",
         *(f"{1e3 * r['kernel_seconds'][k]:.1f} ({1e3 * r['predicted'][k]:.1f})" for k in KINDS)]
        for r in found["rows"]
    ]  # fmt: skip
    longest = [
        [r["case"], m["kernel"], f"{1e3 * m['seconds']:.2f}", f"{m['calls']:.0f}"]
        for r in found["rows"]
        for m in r["longest_memory"][:6]
    ]
    name = found["device_name"]
    return (
        f"{PLUMBING if name == 'CPU' else ''}One micro-batch's forward + backward on {name} "
        f"(bf16, t=p=d=1, no recompute) against the step-time model on `{found['cluster']}`; "
        "kernel time per step by kind, the model's figure (layers only) in brackets.\n\n"
        + table(header, rows)
        + "\n\nThe longest memory-bound kernels (ms per step, calls per step):\n\n"
        + table(["case", "kernel", "ms", "calls"], longest)
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = parser(__doc__, "the tiny model, seconds; its numbers mean nothing")
    add_device(p)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: "
                   + ", ".join(CASES))  # fmt: skip
    p.add_argument("--cluster", default="h200", help="the step-time model's preset or YAML")
    p.add_argument("--seconds", type=float, default=1.0, help="time per wall measurement")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    args = p.parse_args(argv)
    if refused(args, "step_profile"):
        return 2
    device = torch.device(args.device)
    # the smoke compiles with aot_eager (traced, no code generated: seconds on a CPU)
    smoke = {"smoke": (SMOKE, 2, False), "smoke-compiled": (SMOKE, 2, True)}
    cases = smoke if args.smoke else CASES
    names = list(cases) if args.smoke else args.cases.split(",")
    if unknown := [n for n in names if n not in cases]:
        print(f"error: --cases: unknown {', '.join(unknown)}; valid: {', '.join(CASES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = []
    for name in names:
        config, b, compiled = cases[name]
        seconds, steps = (0.05, 1) if args.smoke else (args.seconds, args.steps)
        backend = ("aot_eager" if args.smoke else "inductor") if compiled else ""
        rows.append(measure(name, config, b, device, args.cluster, seconds, steps, backend))
        if device.type == "cuda":  # the case's model is gone: its blocks go back
            torch.cuda.empty_cache()
        print(f"{name}: {1e3 * rows[-1]['measured_seconds']:.1f} ms, "
              f"{rows[-1]['measured_over_predicted']:.3f} of predicted", flush=True)  # fmt: skip
    found = {"device_name": device_name(device), "cluster": args.cluster,
             "torch": torch.__version__, "rows": rows}  # fmt: skip
    save(args, argv, "step_profile", found, markdown(found), smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
