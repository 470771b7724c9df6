"""The MoE layer's forward + backward time per token on this CPU, beside a dense SwiGLU layer of
the same active FLOPs and beside transformers' own ``MixtralSparseMoeBlock`` on the same
weights: ``python -m benchmarks.moe`` (``--smoke`` for a seconds-long plumbing run).

One process, one intra-op thread, fp32, ``T`` tokens of width ``h`` routed top-``k`` over ``E``
SwiGLU experts of width ``f_e`` (softmax scores, renormalised top-k: Mixtral's router):

* ``moe``: :class:`~lightning_sp.model.moe.layer.MoE` (router, dispatch, grouped-GEMM experts,
  combine; no auxiliary loss in the gradient, as transformers' block has none);
* ``dense``: the dense :class:`~lightning_sp.model.parts.dense.MLP`, SwiGLU of width
  ``f = k·f_e``: the experts' active matmul FLOPs (``6·T·h·k·f_e`` forward); the MoE layer adds
  its router (``2·T·h·E``, ``E/(3·k·f_e)`` of that);
* ``hf``: transformers' ``MixtralSparseMoeBlock`` with ``experts_implementation="grouped_mm"``
  (what a transformers model resolves to on this torch), and ``hf_eager`` (its per-expert loop).

The weights are ours copied into transformers' block, and before any timing the outputs and the
input gradients must agree to fp32 tolerance (checked). Every round runs each implementation
once (forward, then backward of a fixed output gradient), in an order rotated round by round;
the reported ratios are medians of the per-round ratios with 95% bootstrap intervals
(:mod:`benchmarks._stats`), so the machine's drift hits all alike. Each round records the share
of the CPUs other processes took (:mod:`benchmarks._cpu`); the medians use the rounds under
:data:`benchmarks._cpu.CLEAN_SHARE` when at least half of them are, else all (``clean`` says
which). Each run is timed twice: wall clock, and this process's CPU time (one thread: the time
it computed, which other processes sharing the cores do not stretch, though they still share
caches and memory bandwidth); on a busy machine the CPU-time ratios are the steadier ones.
Targets (issue 34): ``moe / dense`` within 1.3 and ``moe / hf`` below 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import _cpu
from benchmarks._format import add_out_argument, ci, command, fixed, out_dir, table, write
from benchmarks._stats import median_ci
from lightning_sp import GPTConfig, ParallelState
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.layer import MoE
from lightning_sp.model.parts.dense import MLP
from lightning_sp.parallel.init import initialize_parameter

IMPLEMENTATIONS = ("moe", "dense", "hf", "hf_eager")
RTOL, ATOL = 1e-4, 1e-5
"""fp32 agreement of outputs and input gradients (sums of ``h`` or ``f_e`` products)."""


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The layer and the tokens measured."""

    hidden_size: int
    num_experts: int
    top_k: int
    expert_ffn_size: int
    tokens: int
    rounds: int
    warmup: int


FULL = MoEShape(hidden_size=512, num_experts=8, top_k=2, expert_ffn_size=1024, tokens=1024,
                rounds=20, warmup=2)  # fmt: skip
SMOKE = MoEShape(hidden_size=32, num_experts=4, top_k=2, expert_ffn_size=64, tokens=64,
                 rounds=2, warmup=1)  # fmt: skip


def _initialise(module: nn.Module, seed: int) -> None:
    for name, param in module.named_parameters():
        initialize_parameter(param, name, seed)


def build(shape: MoEShape) -> dict[str, nn.Module]:
    """The four layers, fp32: ours (seeded), the dense SwiGLU of width ``k·f_e`` (seeded), and
    transformers' block in both expert implementations holding ours' weights."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    h, e, k, f = shape.hidden_size, shape.num_experts, shape.top_k, shape.expert_ffn_size
    config = MoEConfig(num_experts=e, top_k=k, expert_ffn_size=f)  # softmax, renormalised
    moe = MoE(h, config, ParallelState.single(), sequence_parallel=False, dtype=torch.float32)
    moe.reset_parameters(0)
    dense_config = GPTConfig(vocab_size=256, seq_length=shape.tokens, hidden_size=h,
                             num_layers=1, num_heads=8, activation="swiglu",
                             ffn_hidden_size=k * f, bias=False)  # fmt: skip
    dense = MLP(dense_config, ParallelState.single(), dtype=torch.float32)
    _initialise(dense, 0)
    layers: dict[str, nn.Module] = {"moe": moe, "dense": dense}
    for name, implementation in (("hf", "grouped_mm"), ("hf_eager", "eager")):
        hf_config = transformers.MixtralConfig(
            hidden_size=h, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k,
            router_jitter_noise=0.0,
        )  # fmt: skip
        hf_config._experts_implementation = implementation
        block = MixtralSparseMoeBlock(hf_config).float()
        with torch.no_grad():
            block.gate.weight.copy_(moe.router.weight)
            block.experts.gate_up_proj.copy_(moe.experts.gate_up)
            block.experts.down_proj.copy_(moe.experts.down)
        layers[name] = block
    return layers


def step(layer: nn.Module, x: Tensor, grad: Tensor, hf: bool) -> tuple[Tensor, Tensor]:
    """Forward and backward of ``x`` ``[T, 1, h]``; ``(output, input gradient)`` in that
    layout (transformers' block takes ``[b, s, h]``)."""
    for param in layer.parameters():
        param.grad = None
    leaf = (x.transpose(0, 1) if hf else x).detach().requires_grad_()
    out = layer(leaf)
    out.backward(grad.transpose(0, 1) if hf else grad)
    assert leaf.grad is not None
    if hf:
        return out.detach().transpose(0, 1), leaf.grad.transpose(0, 1)
    return out.detach(), leaf.grad


def check_agreement(layers: dict[str, nn.Module], x: Tensor, grad: Tensor) -> None:
    """Our layer's output and input gradient equal each transformers block's (fp32
    tolerance), on the timed input; raises AssertionError otherwise."""
    ours = step(layers["moe"], x, grad, hf=False)
    for name in ("hf", "hf_eager"):
        theirs = step(layers[name], x, grad, hf=True)
        for what, a, b in zip(("output", "input gradient"), ours, theirs, strict=True):
            try:
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
            except AssertionError as error:
                raise AssertionError(f"moe and {name} disagree on the {what}: {error}") from None


def measure(shape: MoEShape) -> dict[str, Any]:
    """Seconds per token of each implementation (every round), the per-round ratios and their
    medians with 95% intervals."""
    torch.manual_seed(0)
    layers = build(shape)
    x = torch.randn(shape.tokens, 1, shape.hidden_size)  # [T, b=1, h]
    grad = torch.randn_like(x)
    check_agreement(layers, x, grad)
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    seconds: dict[str, dict[str, list[float]]] = {
        c: {name: [] for name in IMPLEMENTATIONS} for c in clocks
    }
    shares: list[float] = []
    for r in range(shape.warmup + shape.rounds):
        order = IMPLEMENTATIONS[r % 4 :] + IMPLEMENTATIONS[: r % 4]
        before = _cpu.sample()
        times: dict[tuple[str, str], float] = {}
        for name in order:
            start = {c: clock() for c, clock in clocks.items()}
            step(layers[name], x, grad, hf=name.startswith("hf"))
            for c, clock in clocks.items():
                times[c, name] = (clock() - start[c]) / shape.tokens
        if r >= shape.warmup:
            shares.append(_cpu.foreign_share(before, _cpu.sample()))
            for (c, name), value in times.items():
                seconds[c][name].append(value)
    clean = [i for i, share in enumerate(shares) if share < _cpu.CLEAN_SHARE]
    used = clean if 2 * len(clean) >= len(shares) else list(range(len(shares)))
    return {
        "shape": dataclasses.asdict(shape),
        "threads": torch.get_num_threads(),
        "rounds_used": len(used),
        "clean": len(used) == len(clean),
        "other_processes_share": shares,
        **{f"us_per_token_{c}": medians(seconds[c], used) for c in clocks},
        **{f"ratios_{c}": ratios(seconds[c], used) for c in clocks},
        "samples": seconds,
        "targets": {"moe_over_dense": 1.3, "moe_over_hf": 1.0},
    }


def medians(seconds: dict[str, list[float]], used: list[int]) -> dict[str, float]:
    """µs per token of each implementation: the median over the rounds ``used``."""
    return {n: 1e6 * statistics.median([v[i] for i in used]) for n, v in seconds.items()}


def ratios(seconds: dict[str, list[float]], used: list[int]) -> dict[str, list[float]]:
    """``moe_over_X``: the median of the per-round ratios ours / X, with its 95% interval."""
    return {
        f"moe_over_{other}": list(median_ci([seconds["moe"][i] / seconds[other][i] for i in used]))
        for other in IMPLEMENTATIONS[1:]
    }


def markdown(result: dict[str, Any]) -> str:
    """One table: µs per token of each layer (wall clock and CPU time), and our layer over
    each with its interval."""
    labels = {
        "moe": "ours: MoE (grouped GEMM)",
        "dense": "dense SwiGLU, f = k·f_e",
        "hf": "transformers MixtralSparseMoeBlock (grouped_mm)",
        "hf_eager": "transformers MixtralSparseMoeBlock (eager loop)",
    }
    clocks = ("wall", "cpu")
    rows = [
        [labels[n]]
        + [fixed(result[f"us_per_token_{c}"][n], 2) for c in clocks]
        + ["" if n == "moe" else ci(result[f"ratios_{c}"][f"moe_over_{n}"]) for c in clocks]
        for n in IMPLEMENTATIONS
    ]
    header = ["layer", "fwd+bwd µs / token (wall)", "(CPU)", "ours / it, wall [95% CI]", "CPU"]
    return table(header, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, seconds")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(SMOKE if args.smoke else FULL)
    meta = {"command": command("benchmarks.moe", argv)}
    write(out_dir(args.out, args.smoke), "moe", {"meta": meta, **result}, markdown(result))
    return result


if __name__ == "__main__":
    main()
