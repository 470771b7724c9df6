"""FP8's saved activation bytes per layer per rank equal the parts' stated terms to the byte
(:meth:`~lightning_sp.model.parts.base.Part.float8_terms`, ``ActivationShape.fp8``): bf16, s=32
b=2 h=64 a=4 g=2 f=96, measured with saved-tensor hooks while the real model runs forward and
backward, at t = 1 and t = 2 + SP.

With ``tensorwise`` (whose forward cast of a linear's input is also its weight-gradient
cast) each linear that keeps its own input keeps the float8 cast instead, 1 byte an element,
plus a 4-byte scale on every rank: ``qkv_input`` and ``fc1_input`` ``sbh`` (``sbh/t`` under
SP) instead of ``2sbh``, ``fc2_input`` ``sbf/t`` instead of ``2sbf/t``; the projection keeps
the core's output (SDPA's own) as in high precision. ``rowwise`` keeps every input as high
precision does. Recomputed inputs (``layernorm``, ``mlp_act``) keep nothing new.
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
from lightning_sp.parallel.fp8 import FP8Config
from lightning_sp.testing.spawn import run_distributed

from models import layout_at

pytest.importorskip("torchao")

S, B, H, A, F, LAYERS = 32, 2, 64, 4, 96, 2
SB = S * B
ROWS = [f"llama-{p}-tensorwise" for p in ("none", "selective", "lean", "full")] + [
    "llama-none-rowwise",
    "gpt2-none-tensorwise",
    "olmo2-none-tensorwise",
]


def _config(row: str, sp: bool) -> GPTConfig:
    family, recompute, recipe = row.split("-")
    fields: dict = {"num_query_groups": 2, "ffn_hidden_size": F}
    if family == "gpt2":
        fields = {"ffn_hidden_size": F, "hidden_dropout": 0.1, "attention_dropout": 0.1}
    return GPTConfig.of(
        family, vocab_size=128, seq_length=S, hidden_size=H, num_layers=LAYERS, num_heads=A,
        sequence_parallel=sp, recompute=recompute, attention="math",
        fp8=FP8Config(recipe, emulate=True), **fields,
    )  # fmt: skip


def _measure(state: ParallelState) -> dict[str, list[int]]:
    t = state.tensor_parallel_size
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(0))
    results = {}
    for row in ROWS:
        model = GPT(_config(row, t > 1), state, dtype=torch.bfloat16).train()
        with SavedTensorTracker.for_model(model) as tracker:
            loss = model(ids, ids)
        loss.backward()  # the saved tensors were real: backward runs on them
        results[row] = [tracker.report.bytes_of(f"layers.{i}") for i in range(LAYERS)]
    return results


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(_measure(state), fh)


@functools.cache
def measured(ranks: int) -> list[dict[str, list[int]]]:
    if ranks == 1:
        return [_measure(ParallelState.single())]
    with tempfile.TemporaryDirectory() as out_dir:
        run_distributed(_worker, ranks, out_dir)
        out = []
        for r in range(ranks):
            with open(os.path.join(out_dir, f"rank{r}.json")) as fh:
                out.append(json.load(fh))
        return out


def _check(row: str, t: int) -> None:
    config = _config(row, t > 1)
    shape = config.activation_shape(layout_at(t), B)
    expected = activation_bytes_per_layer(shape, config.recompute)
    expected += layernorm_stats_bytes_per_layer(shape, config.recompute)
    for rank, results in enumerate(measured(t)):
        for layer, got in enumerate(results[row]):
            assert got == expected, (
                f"t={t} rank {rank} layer {layer} {row}: measured {got} bytes "
                f"({got / SB:.3f} sb), formula {expected} ({expected / SB:.3f} sb)"
            )


@pytest.mark.parametrize("row", ROWS)
def test_fp8_bytes_one_process(row: str) -> None:
    _check(row, 1)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
def test_fp8_bytes_tensor_sequence_parallel(row: str) -> None:
    _check(row, 2)


def test_fp8_bytes_are_what_the_docs_say() -> None:
    """docs/fp8.md: at t = 2 + SP with no recompute, tensorwise keeps ``sbh/t`` less for each
    of the QKV and MLP inputs and ``sbf/t`` less for fc2's, plus three 4-byte scales; the
    paper's GPT layer (f = 4h, dropout, math) goes from ``34sbh/t + 5as²b/t`` to ``28sbh/t +
    5as²b/t + 12`` bytes; rowwise keeps what bf16 keeps."""

    def saved(row: str, fp8: FP8Config | None, t: int = 2) -> float:
        config = _config(row, True)
        config.fp8 = fp8
        return activation_bytes_per_layer(config.activation_shape(layout_at(t), B), "none")

    bf16 = saved("llama-none-tensorwise", None)
    tensorwise = saved("llama-none-tensorwise", FP8Config("tensorwise", emulate=True))
    assert bf16 - tensorwise == 2 * SB * H / 2 + SB * F / 2 - 12, bf16 - tensorwise
    rowwise = saved("llama-none-tensorwise", FP8Config("rowwise", emulate=True))
    assert rowwise == bf16, (rowwise, bf16)
    paper = GPTConfig(seq_length=S, hidden_size=H, num_heads=A, sequence_parallel=True,
                      fp8=FP8Config("tensorwise", emulate=True))  # fmt: skip
    shape = paper.activation_shape(layout_at(2), B)
    core = 5 * A * S * S * B / 2
    assert activation_bytes_per_layer(shape, "none") == 28 * SB * H / 2 + core + 12
