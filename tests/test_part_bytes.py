"""Measured activation bytes per layer per rank of the new parts equal the parts' stated terms
(:meth:`~lightning_sp.model.parts.base.Part.saved_terms`), to the byte: bf16, s=256 b=2 h=256
a=8 g=2 f=704 on real gloo ranks, t = 1, 2, 4 (with SP for t > 1), every preset, and ``sdpa``.

* ``qwen2``: biases on Q, K, V only: no tensor of their own (the Llama formula);
* ``qwen3``: query/key norms per head with d = 48 (not h/a = 32): ``+ e·sb·d(a + 2g')/t`` (the
  norm's input, the QKV linear's output) ``+ 4·sb(a + g')/t`` (fp32 rstd per head), and Q, K, V
  and the projection input at ``a·d`` instead of ``h``;
* ``olmo2``: query/key norms over the projections, ``+ e·sb·d(a + 2g')/t + 8·sb`` (two fp32
  rstd per token on every rank), and norms after the sublayers: each mixer's input is the
  residual stream itself (kept whatever the preset: no norm recompute stands for it) and
  each post-norm keeps its input (the sublayer's output, ``/t`` under SP) and its statistics
  under ``lean`` too.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile

import pytest
import torch

from lightning_sp import GPT, GPTConfig, ParallelState, SavedTensorTracker
from lightning_sp.memory.formulas import activation_bytes_per_layer, layernorm_stats_bytes_per_layer
from lightning_sp.testing.spawn import run_distributed

from models import layout_at

S, B, H, A, LAYERS = 256, 2, 256, 8, 2
SBH = S * B * H
FAMILIES = {"qwen2": {}, "qwen3": {"kv_channels": 48}, "olmo2": {}}
SETTINGS = [("none", "math"), ("selective", "math"), ("lean", "math"), ("full", "math"),
            ("none", "sdpa"), ("lean", "sdpa")]  # fmt: skip
ROWS = [
    f"{family}-{recompute}-{attention}" for family in FAMILIES for recompute, attention in SETTINGS
]


def _config(row: str, t: int) -> GPTConfig:
    family, recompute, attention = row.split("-")
    return GPTConfig.of(
        family, vocab_size=512, seq_length=S, hidden_size=H, num_layers=LAYERS, num_heads=A,
        num_query_groups=2, ffn_hidden_size=704, sequence_parallel=t > 1, recompute=recompute,
        attention=attention, **FAMILIES[family],
    )  # fmt: skip


def _measure_worker(rank: int, world_size: int, out_dir: str) -> None:
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    ids = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    results = {}
    for row in ROWS:
        model = GPT(_config(row, world_size), state, dtype=torch.bfloat16).train()
        with SavedTensorTracker.for_model(model) as tracker:
            loss = model(ids, ids)
        loss.backward()
        results[row] = [tracker.report.bytes_of(f"layers.{i}") for i in range(LAYERS)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


@functools.cache
def measured(t: int) -> list[dict[str, list[int]]]:
    """Per-rank measurements at tensor-parallel size ``t`` (one spawn per t)."""
    with tempfile.TemporaryDirectory() as out_dir:
        run_distributed(_measure_worker, t, out_dir)
        ranks = []
        for r in range(t):
            with open(os.path.join(out_dir, f"rank{r}.json")) as fh:
                ranks.append(json.load(fh))
        return ranks


CASES = [(t, row) for t in (1, 2, 4) for row in ROWS]


@pytest.mark.slow
@pytest.mark.parametrize(("t", "row"), CASES, ids=[f"t{t}-{row}" for t, row in CASES])
def test_part_bytes_per_layer_equal_the_formula(t: int, row: str) -> None:
    config = _config(row, t)
    shape = config.activation_shape(layout_at(t), B)
    expected = activation_bytes_per_layer(shape, config.recompute)
    stats = layernorm_stats_bytes_per_layer(shape, config.recompute)
    for rank, results in enumerate(measured(t)):
        for layer, got in enumerate(results[row]):
            assert got == expected + stats, (
                f"t={t} rank {rank} layer {layer} {row}: measured {got / SBH:.5f} sbh, "
                f"formula {expected / SBH:.5f} + norm statistics {stats / SBH:.5f} sbh"
            )
