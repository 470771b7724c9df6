"""(3) FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode``: forward, backward and
what each recompute policy adds, against the paper's formulas.

The real :class:`lightning_sp.GPT` runs under ``FakeTensorMode`` (shapes only: no memory, no
time, exact counts; the counter counts the matmul-like ops, as the paper does). Backward is
counted separately from forward; a policy's recomputation is its backward minus the backward
of ``none``. Counted:

* one transformer layer at the layer-time shape, whole (t = 1) and one rank's shard at t = 2
  (a ``"fake"`` process group of two ranks);
* one training iteration of the whole throughput model (t = 1), against
  :func:`lightning_sp.memory.flops.model_flops_per_iteration` and
  :func:`lightning_sp.memory.flops.hardware_flops_per_iteration`.

The paper: selective recomputation redoes the attention core, ``4bs²h`` FLOPs, which is
``s/(6h + s)`` of a layer's forward ``24bsh² + 4bs²h``; full recomputation redoes the forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from benchmarks._format import fixed, pct, table
from benchmarks.layer_time import LayerShape, layer_config
from benchmarks.throughput import ThroughputShape, model_config
from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.memory.fake import fake_world
from lightning_sp.memory.flops import hardware_flops_per_iteration, model_flops_per_iteration
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.testing.spawn import run_distributed

POLICIES: tuple[str, ...] = ("none", "selective", "full")


def _fake_parameters(module: nn.Module) -> None:
    """Replace the (meta) parameters of ``module`` by fake CPU tensors, keeping their tags.
    Call under ``FakeTensorMode``."""
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if param is None:
                continue
            fake = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="cpu"))
            fake.__dict__.update(param.__dict__)
            mod._parameters[name] = fake


def _count(gpt: GPT, forward: Callable[[], Tensor]) -> tuple[int, int]:
    """``(forward, backward)`` FLOPs of ``forward()`` (built under ``FakeTensorMode``, on
    ``gpt``'s parameters made fake) and of the backward of its output."""
    with FakeTensorMode():
        _fake_parameters(gpt)
        gpt.train()
        with FlopCounterMode(display=False) as counted_forward:
            out = forward()
        with FlopCounterMode(display=False) as counted_backward:
            out.backward(torch.ones_like(out))
    return counted_forward.get_total_flops(), counted_backward.get_total_flops()


def _count_layer(config: GPTConfig, state: ParallelState, b: int) -> tuple[int, int]:
    """``(forward, backward)`` FLOPs of one layer's shard on this rank."""
    gpt = GPT(config, state, dtype=torch.float32, device="meta")
    t = state.tensor_parallel_size
    rows = config.seq_length // t if config.sequence_parallel else config.seq_length
    shape = (rows, b, config.hidden_size)
    return _count(gpt, lambda: gpt.layers[0](torch.empty(shape, requires_grad=True)))


def _count_model(config: GPTConfig, b: int) -> tuple[int, int]:
    """``(forward, backward)`` FLOPs of one iteration of the whole model (t = 1)."""
    gpt = GPT(config, ParallelState.single(), dtype=torch.float32, device="meta")

    def forward() -> Tensor:
        ids = torch.zeros(b, config.seq_length, dtype=torch.long)
        return gpt(ids, ids)

    return _count(gpt, forward)


def _layer_rows(shape: LayerShape, t: int, sp: bool) -> list[dict[str, Any]]:
    s, b, h = shape.s, shape.b, shape.h
    paper_forward = (24 * b * s * h * h + 4 * b * s * s * h) / t
    paper_recompute = {"none": 0.0, "selective": 4 * b * s * s * h / t, "full": paper_forward}
    counts: dict[str, tuple[int, int]] = {}
    for policy in POLICIES:
        config = layer_config(shape, sp, policy)
        if t == 1:
            counts[policy] = _count_layer(config, ParallelState.single(), b)
        else:
            with fake_world(t):
                counts[policy] = _count_layer(config, ParallelState.from_process_group(t), b)
    rows = []
    for policy in POLICIES:
        forward, backward = counts[policy]
        recompute = backward - counts["none"][1]
        rows.append({
            "t": t, "sequence_parallel": sp, "recompute": policy,
            "forward_flops": forward, "backward_flops": backward, "recompute_flops": recompute,
            "paper_forward_flops": paper_forward, "paper_recompute_flops": paper_recompute[policy],
            "backward_over_forward": backward / forward,
            "recompute_over_forward": recompute / forward,
            "paper_recompute_over_forward": paper_recompute[policy] / paper_forward,
        })  # fmt: skip
    return rows


def run(layer: LayerShape, model: ThroughputShape) -> dict[str, Any]:
    """Counted FLOPs per layer (t = 1 and a t = 2 shard) and per iteration, with the formulas.

    Counts in a child process, whose fake process group then never touches this one.
    """
    return run_distributed(_count_all, 1, layer, model, init_group=False, start_method="fork")[0]


def _count_all(rank: int, world_size: int, layer: LayerShape, model: ThroughputShape) -> Any:
    layer_rows = _layer_rows(layer, 1, False) + _layer_rows(layer, layer.t, True)
    iteration = []
    for policy in POLICIES:
        config = dataclasses.replace(
            model_config(model), recompute=RecomputePolicy.parse(policy), sequence_parallel=False
        )
        forward, backward = _count_model(config, model.b)
        counted = forward + backward
        hardware = hardware_flops_per_iteration(config, model.b)
        iteration.append({
            "recompute": policy, "counted_flops": counted,
            "model_flops_formula": model_flops_per_iteration(config, model.b),
            "hardware_flops_formula": hardware,
            "counted_over_hardware_formula": counted / hardware,
        })  # fmt: skip
    s, h = layer.s, layer.h
    return {
        "layer_shape": dataclasses.asdict(layer),
        "model_shape": dataclasses.asdict(model),
        "paper_selective_fraction": s / (6 * h + s),
        "layer": layer_rows,
        "iteration": iteration,
    }


def markdown(section: dict[str, Any]) -> str:
    """One table: counted forward / backward / recompute GFLOP of one layer beside the paper's."""
    header = [
        "t", "recompute", "forward GFLOP", "backward GFLOP", "recompute GFLOP",
        "recompute / forward", "paper", "forward = paper",
    ]  # fmt: skip
    rows = [
        [
            r["t"],
            r["recompute"],
            fixed(r["forward_flops"] / 1e9),
            fixed(r["backward_flops"] / 1e9),
            fixed(r["recompute_flops"] / 1e9),
            pct(r["recompute_over_forward"], 2),
            pct(r["paper_recompute_over_forward"], 2),
            "yes" if r["forward_flops"] == r["paper_forward_flops"] else "no",
        ]
        for r in section["layer"]
    ]
    return table(header, rows)
