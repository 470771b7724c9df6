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
Targets (issue 34): ``moe / dense`` within 1.3 and ``moe / hf`` below 1. The same layers, rounds
and ratios on a GPU (:func:`measure_on`, bf16 at h=2048): ``python -m benchmarks.gpu --only moe``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._fit import layer_step
from benchmarks._format import ci, fixed, parser, save, table
from benchmarks._stats import clean_rounds, device_sync, interleaved, medians, ratios_over
from lightning_sp import GPTConfig, ParallelState
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.layer import MoE
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.parts.dense import MLP
from lightning_sp.parallel.init import initialize_parameter

IMPLEMENTATIONS = ("moe", "dense", "hf", "hf_eager")
OTHERS = IMPLEMENTATIONS[1:]
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
GPU_FULL = MoEShape(hidden_size=2048, num_experts=8, top_k=2, expert_ffn_size=4096,
                    tokens=16384, rounds=20, warmup=3)  # fmt: skip
GPU_SMOKE = MoEShape(hidden_size=64, num_experts=4, top_k=2, expert_ffn_size=128, tokens=256,
                     rounds=2, warmup=1)  # fmt: skip
"""The shapes of :func:`measure_on` (``python -m benchmarks.gpu --only moe``)."""
REL_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
"""Relative Frobenius error allowed between our layer and transformers' in :func:`measure_on`."""


def build(shape: MoEShape) -> dict[str, nn.Module]:
    """The four layers, fp32: ours (seeded), the dense SwiGLU of width ``k·f_e`` (seeded), and
    transformers' block in both expert implementations holding ours' weights."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    h, e, k, f = shape.hidden_size, shape.num_experts, shape.top_k, shape.expert_ffn_size
    config = MoEConfig(num_experts=e, top_k=k, expert_ffn_size=f)  # softmax, renormalised
    dense_config = GPTConfig(vocab_size=256, seq_length=shape.tokens, hidden_size=h,
                             num_layers=1, num_heads=8, activation="swiglu",
                             ffn_hidden_size=k * f, bias=False)  # fmt: skip
    moe_config = dataclasses.replace(dense_config, feed_forward="moe", moe=config)
    single = ParallelState.single()
    moe = MoE(BuildContext.of(moe_config, single, dtype=torch.float32), config)
    moe.reset_parameters(0)
    dense = MLP(BuildContext.of(dense_config, single, dtype=torch.float32))
    for name, param in dense.named_parameters():
        initialize_parameter(param, name, 0)
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


def check_agreement(
    layers: dict[str, nn.Module], x: Tensor, grad: Tensor, rel_tol: float | None = None
) -> dict[str, float]:
    """Our layer's output and input gradient against each transformers block's, on the timed
    input: their relative (Frobenius) errors, or AssertionError when they disagree: beyond fp32
    tolerance (``RTOL``, ``ATOL``), or with ``rel_tol`` a relative error at or above it."""
    ours = layer_step(layers["moe"], x, grad)
    errors = {}
    for name in ("hf", "hf_eager"):
        theirs = layer_step(layers[name], x, grad, batch_first=True)
        for what, a, b in zip(("output", "input_grad"), ours, theirs, strict=True):
            error = ((a.float() - b.float()).norm() / b.float().norm()).item()
            errors[f"{name}_{what}"] = error
            try:
                if rel_tol is None:
                    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
                else:
                    assert error < rel_tol, f"relative error {error:.3g}"
            except AssertionError as exc:
                raise AssertionError(f"moe and {name} disagree on the {what}: {exc}") from None
    return errors


def time_rounds(
    layers: dict[str, nn.Module], x: Tensor, grad: Tensor, shape: MoEShape,
    sync: Callable[[], None] = lambda: None,
) -> tuple[dict[str, dict[str, list[float]]], list[float]]:  # fmt: skip
    """``warmup + rounds`` rounds (:func:`benchmarks._stats.interleaved`), each running every
    layer once (forward and backward) in an order rotated round by round, ``sync()`` before and
    after each: the seconds per token of each layer after the warm-up by the wall clock and by
    this process's CPU time, ``{"wall" | "cpu": {layer: [per round]}}``, and per round the
    share of the CPUs other processes took (:mod:`benchmarks._cpu`)."""
    cpu: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}

    def timed(name: str) -> None:
        start = time.process_time()
        layer_step(layers[name], x, grad, name.startswith("hf"))
        cpu[name].append(time.process_time() - start)

    steps = {name: functools.partial(timed, name) for name in IMPLEMENTATIONS}
    shares: list[float] = []
    wall = interleaved(steps, shape.warmup, shape.rounds, sync, rotate=True, shares=shares)
    cpu = {name: values[shape.warmup :] for name, values in cpu.items()}
    seconds = {clock: {name: [v / shape.tokens for v in values] for name, values in s.items()}
               for clock, s in (("wall", wall), ("cpu", cpu))}  # fmt: skip
    return seconds, shares


def _inputs(
    shape: MoEShape, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, nn.Module], Tensor, Tensor]:
    """The four layers (seed 0) on ``device`` in ``dtype``, the input ``[T, b=1, h]`` and the
    output gradient."""
    torch.manual_seed(0)
    layers = {name: layer.to(device, dtype) for name, layer in build(shape).items()}
    x = torch.randn(shape.tokens, 1, shape.hidden_size, device=device, dtype=dtype)
    return layers, x, torch.randn_like(x)


def measure(shape: MoEShape) -> dict[str, Any]:
    """Seconds per token of each implementation (every round), the per-round ratios and their
    medians with 95% intervals."""
    layers, x, grad = _inputs(shape, torch.device("cpu"), torch.float32)
    check_agreement(layers, x, grad)
    seconds, shares = time_rounds(layers, x, grad, shape)
    used, rounds = clean_rounds(shares)
    return {
        "shape": dataclasses.asdict(shape),
        "threads": torch.get_num_threads(),
        **rounds,
        **{f"us_per_token_{c}": medians(seconds[c], used, 1e6) for c in seconds},
        **{f"ratios_{c}": ratios_over(seconds[c], "moe", OTHERS, used) for c in seconds},
        "samples": seconds,
        "targets": {"moe_over_dense": 1.3, "moe_over_hf": 1.0},
    }


def measure_on(shape: MoEShape, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The GPU run (:mod:`benchmarks.gpu`): the four layers on ``device`` in ``dtype``, checked
    to agree within :data:`REL_TOL`, then timed by the wall clock between two
    device synchronisations around each step, all rounds used: µs per token of each layer
    (medians) and our layer over each (median ratio, 95% CI)."""
    layers, x, grad = _inputs(shape, device, dtype)
    errors = check_agreement(layers, x, grad, REL_TOL[dtype])
    seconds = time_rounds(layers, x, grad, shape, device_sync(device))[0]["wall"]
    rounds = list(range(shape.rounds))
    return {
        "shape": dataclasses.asdict(shape),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "relative_errors": errors,
        "us_per_token": medians(seconds, rounds, 1e6),
        "ratios": ratios_over(seconds, "moe", OTHERS, rounds),
        "samples": seconds,
    }


def markdown(result: dict[str, Any]) -> str:
    """One table: µs per token of each layer, and our layer over each with its interval, per
    clock the result holds (``us_per_token_wall`` and ``_cpu`` from :func:`measure`;
    ``us_per_token``, one clock, from :func:`measure_on`, with a line naming the device)."""
    labels = {
        "moe": "ours: MoE (grouped GEMM)",
        "dense": "dense SwiGLU, f = k·f_e",
        "hf": "transformers MixtralSparseMoeBlock (grouped_mm)",
        "hf_eager": "transformers MixtralSparseMoeBlock (eager loop)",
    }
    clocks = [key.removeprefix("us_per_token") for key in result if key.startswith("us_per_")]
    rows = [
        [labels[n]]
        + [fixed(result[f"us_per_token{c}"][n], 3) for c in clocks]
        + ["" if n == "moe" else ci(result[f"ratios{c}"][f"moe_over_{n}"]) for c in clocks]
        for n in IMPLEMENTATIONS
    ]
    names = [c.replace("_", ", ") for c in clocks]
    header = ["layer", *(f"fwd+bwd µs / token{c}" for c in names)]
    header += [f"ours / it{c} [95% CI]" for c in names]
    if "device" not in result:
        return table(header, rows)
    return f"{result['device']}, {result['dtype']}, torch {result['torch']}\n\n" + table(
        header, rows
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser(__doc__).parse_args(argv)
    torch.set_num_threads(1)
    result = measure(SMOKE if args.smoke else FULL)
    save(args, argv, "moe", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
