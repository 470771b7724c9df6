"""(1) Activation bytes per layer per rank: this project vs PyTorch DTensor, beside Table 2.

One set of gloo ranks per tensor-parallel size ``t``. On every rank, for each implementation,
sequence parallelism on/off and recompute policy none / selective / full, a 2-layer GPT in
bf16 runs forward in training mode (dropout on) under
:class:`~lightning_sp.SavedTensorTracker`, which counts every storage autograd saves once,
parameters excluded; backward then runs on what was saved. The figure is the bytes attributed
to one transformer layer (both layers agree; the largest over layers and ranks is reported).

Implementations, identical math and inputs:

* ``ours``: :class:`lightning_sp.GPT`.
* ``dtensor``: :class:`lightning_sp.testing.dtensor_gpt.DTensorGPT` parallelised with
  ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` / ``PrepareModuleInput``,
  ``F.dropout``, ``torch.utils.checkpoint`` — what a PyTorch user writes.
* ``dtensor_native_dropout``: the same with ``torch.native_dropout`` (1-byte ``bool`` masks),
  which isolates what DTensor's sequence parallelism itself keeps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from benchmarks._fit import batch, gpt_config, held_per_layer
from benchmarks._format import fixed, table
from lightning_sp import GPT, GPTConfig, ParallelState, SavedTensorTracker
from lightning_sp.memory.formulas import activation_bytes_per_layer
from lightning_sp.model.shape import ActivationShape
from lightning_sp.testing import dtensor_gpt
from lightning_sp.testing.spawn import run_distributed

POLICIES = ("none", "selective", "full")
IMPLEMENTATIONS = ("ours", "dtensor", "dtensor_native_dropout")


@dataclasses.dataclass(frozen=True)
class BytesShape:
    """The model measured: ``s, b, h, a`` and the tensor-parallel sizes."""

    s: int = 256
    b: int = 2
    h: int = 256
    a: int = 8
    layers: int = 2
    vocab: int = 512
    sizes: tuple[int, ...] = (2, 4)


FULL = BytesShape()
SMOKE = BytesShape(s=64, b=1, h=64, a=4, sizes=(2,))


class DTensorSavedTensorTracker(SavedTensorTracker):
    """:class:`SavedTensorTracker` that counts a saved DTensor by its local shard's storage
    (a DTensor is a wrapper; the bytes live in ``_local_tensor``)."""

    def __init__(self, modules: dict[str, nn.Module], exclude: list[Tensor]) -> None:
        super().__init__(modules, exclude=[_local(t) for t in exclude])

    def _pack(self, t: Tensor) -> Tensor:
        super()._pack(_local(t))
        return t


OURS_ONLY = {  # TP+SP, no DTensor analogue: name -> (recompute, attention)
    "sp_lean": ("lean", "math"),
    "sp_sdpa_none": ("none", "sdpa"),
    "sp_sdpa_lean": ("lean", "sdpa"),
}


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _measure_ours(config: GPTConfig, state: ParallelState, ids: tuple[Tensor, Tensor]) -> list[int]:
    held, loss = held_per_layer(GPT(config, state, dtype=torch.bfloat16).train(), *ids)
    loss.backward()
    return held


def _measure_dtensor(
    config: GPTConfig, mesh: Any, ids: tuple[Tensor, Tensor], native: bool
) -> list[int]:
    torch.manual_seed(0)
    model = dtensor_gpt.DTensorGPT(config, native_dropout=native).to(torch.bfloat16)
    dtensor_gpt.parallelize(model, mesh, config.sequence_parallel)
    model.train()
    modules = {f"layers.{i}": layer for i, layer in enumerate(model.layers)}
    exclude = [*model.parameters(), *model.buffers()]
    with DTensorSavedTensorTracker(modules, exclude) as tracker:
        loss = model(*ids)
    with loss_parallel():
        loss.backward()
    return [tracker.report.bytes_of(f"layers.{i}") for i in range(config.num_layers)]


def _worker(rank: int, world_size: int, shape: BytesShape) -> dict[str, list[int]]:
    t = world_size
    state = ParallelState.from_process_group(tensor_parallel_size=t)
    mesh = init_device_mesh("cpu", (t,))
    ids = batch(shape.vocab, shape.b, shape.s)
    out: dict[str, list[int]] = {}
    sizes = shape.vocab, shape.s, shape.h, shape.layers, shape.a
    for sp in (False, True):
        for policy in POLICIES:
            config = gpt_config(*sizes, policy, sequence_parallel=sp)
            key = f"{int(sp)}:{policy}"
            out[f"ours:{key}"] = _measure_ours(config, state, ids)
            out[f"dtensor:{key}"] = _measure_dtensor(config, mesh, ids, native=False)
            out[f"dtensor_native_dropout:{key}"] = _measure_dtensor(config, mesh, ids, native=True)
    for name, (policy, attention) in OURS_ONLY.items():
        config = gpt_config(*sizes, policy, sequence_parallel=True, attention=attention)
        if attention == "sdpa":  # the fused kernel: on CPU, dropout would leave it
            config.attention_dropout = 0.0
        out[f"ours_only:{name}"] = _measure_ours(config, state, ids)
    return out


def run(shape: BytesShape) -> dict[str, Any]:
    """Measure every (t, implementation, SP, policy); bytes and multiples of ``sbh``."""
    sbh = shape.s * shape.b * shape.h
    rows: list[dict[str, Any]] = []
    ours_only: list[dict[str, Any]] = []
    for t in shape.sizes:
        ranks = run_distributed(_worker, t, shape, start_method="fork", held_groups=True)
        for sp in (False, True):
            for policy in POLICIES:
                key = f"{int(sp)}:{policy}"
                paper = activation_bytes_per_layer(
                    ActivationShape(shape.s, shape.b, shape.h, shape.a, t, sequence_parallel=sp),
                    policy,
                )
                row: dict[str, Any] = {
                    "t": t, "sequence_parallel": sp, "recompute": policy,
                    "paper_bytes": paper, "paper_sbh": paper / sbh,
                }  # fmt: skip
                for impl in IMPLEMENTATIONS:
                    per_rank = [r[f"{impl}:{key}"] for r in ranks]
                    value = max(max(layers) for layers in per_rank)
                    row[f"{impl}_bytes"] = value
                    row[f"{impl}_sbh"] = value / sbh
                    row[f"{impl}_layers_equal"] = all(len(set(layers)) == 1 for layers in per_rank)
                row["ours_vs_paper"] = row["ours_bytes"] / paper
                row["dtensor_vs_ours"] = row["dtensor_bytes"] / row["ours_bytes"]
                row["dtensor_native_dropout_vs_ours"] = (
                    row["dtensor_native_dropout_bytes"] / row["ours_bytes"]
                )
                rows.append(row)
        for name, (policy, attention) in OURS_ONLY.items():
            x = ActivationShape(
                shape.s, shape.b, shape.h, shape.a, t, sequence_parallel=True,
                attention=attention, attention_dropout=attention == "math",
            )  # fmt: skip
            formula = activation_bytes_per_layer(x, policy)
            value = max(max(r[f"ours_only:{name}"]) for r in ranks)
            ours_only.append(
                {"t": t, "case": name, "formula_sbh": formula / sbh, "ours_sbh": value / sbh,
                 "ours_vs_formula": value / formula}
            )  # fmt: skip
    return {
        "shape": dataclasses.asdict(shape), "dtype": "bfloat16", "rows": rows,
        "ours_only": ours_only,
    }  # fmt: skip


def markdown(section: dict[str, Any]) -> str:
    """One table: bytes per layer per rank in sbh, the paper's Table 2, ours, DTensor."""
    header = [
        "t", "SP", "recompute", "paper (Table 2)", "ours", "ours / paper", "DTensor",
        "DTensor + native_dropout", "DTensor / ours",
    ]  # fmt: skip
    rows = [
        [r["t"], "on" if r["sequence_parallel"] else "off", r["recompute"], fixed(r["paper_sbh"]),
         *(fixed(r[k], 4) for k in ("ours_sbh", "ours_vs_paper", "dtensor_sbh",
                                    "dtensor_native_dropout_sbh")),
         fixed(r["dtensor_vs_ours"], 3)]
        for r in section["rows"]
    ]  # fmt: skip
    return table(header, rows)
