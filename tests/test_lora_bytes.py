"""LoRA's saved activation bytes per layer per rank equal the parts' stated terms with the
adapters' (:meth:`~lightning_sp.model.parts.base.Part.adapter_terms`, ``ActivationShape.lora``),
to the byte: bf16, s=64 b=2 h=64 a=4 g=2 f=176, every recompute preset, at t = 1, t = 2 + SP and
c = 2, measured with saved-tensor hooks while the real model runs forward (and backward).

With the base frozen each adapted linear adds its low-rank activation ``e·sb·r`` (whole
sequence, on every TP rank) and, with ``lora_dropout``, a 1-byte mask of its input (``sbh`` for a
column-parallel linear's gathered input, ``sb·w/t`` for a row-parallel one of input width
``w``); a frozen linear without an adapter keeps no input of its own (``qkv_input``,
``fc1_input``, ``fc2_input``; an MoE layer's router, experts and shared down projection).
``full`` keeps the layer input only, adapters or not.
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
from lightning_sp.model.lora import LoRAConfig, apply_lora, with_adapters
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.testing.spawn import run_distributed

from models import context_shards, layout_at

S, B, H, A, LAYERS, R = 64, 2, 64, 4, 2, 4
SB = S * B
PRESETS = ("none", "selective", "lean", "full")
TARGETS = {  # name -> (target_modules, lora_dropout)
    "all": (["all-linear"], 0.0),
    "qv": (["query", "value"], 0.0),
    "all_dropout": (["all-linear"], 0.1),
    "key_up_dropout": (["key", "up"], 0.1),
    "proj_fc2_dropout": (["proj", "fc2"], 0.1),
}
MOE = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=32, num_shared_experts=1,
                force_balanced=True)  # fmt: skip
ROWS = (
    [f"llama-{p}-{t}" for p in PRESETS for t in TARGETS]
    + [f"gpt2-{p}-key_fc1_dropout" for p in ("none", "lean")]
    + [f"qwen3-{p}-all_dropout" for p in ("none", "lean")]
    + [f"mixtral-{p}-all" for p in ("none", "selective", "full")]
)
CP_ROWS = [f"llama-{p}-all_dropout" for p in PRESETS]


def _config(row: str, sp: bool) -> tuple[GPTConfig, LoRAConfig]:
    family, recompute, targets = row.split("-")
    fields: dict = {"num_query_groups": 2, "ffn_hidden_size": 176}
    if family == "gpt2":
        fields = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
        modules, dropout = ["key", "fc1"], 0.1
    else:
        modules, dropout = TARGETS[targets]
    if family == "mixtral":
        family, fields = "llama", {"num_query_groups": 2, "feed_forward": "moe", "moe": MOE}
    if family == "qwen3":
        fields["kv_channels"] = 24  # d != h/a
    config = GPTConfig.of(
        family, vocab_size=128, seq_length=S, hidden_size=H, num_layers=LAYERS, num_heads=A,
        sequence_parallel=sp, recompute=recompute, attention="math", **fields,
    )  # fmt: skip
    return config, LoRAConfig(r=R, lora_dropout=dropout, target_modules=modules)


def _measure(state: ParallelState, rows: list[str]) -> dict[str, list[int]]:
    """Saved bytes of each layer of each row's adapted model on this rank."""
    t = state.tensor_parallel_size
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(0))
    (local,) = context_shards(state, ids)
    results = {}
    for row in rows:
        config, lora = _config(row, t > 1)
        model = GPT(config, state, dtype=torch.bfloat16).train()
        apply_lora(model, lora)
        with SavedTensorTracker.for_model(model) as tracker:
            loss = model(local, local)
        loss.backward()  # the saved tensors were real: backward runs on them
        results[row] = [tracker.report.bytes_of(f"layers.{i}") for i in range(LAYERS)]
    return results


def _measure_worker(rank: int, world_size: int, out_dir: str, cp: bool) -> None:
    t, c = (1, world_size) if cp else (world_size, 1)
    state = ParallelState.from_process_group(tensor_parallel_size=t, context_parallel_size=c)
    results = _measure(state, CP_ROWS if cp else ROWS)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


@functools.cache
def measured(ranks: int, cp: bool) -> list[dict[str, list[int]]]:
    """Per-rank measurements: one process (``ranks = 1``), or ``ranks`` gloo ranks of TP with
    SP (``cp``: of CP), one spawn each."""
    if ranks == 1:
        return [_measure(ParallelState.single(), ROWS)]
    with tempfile.TemporaryDirectory() as out_dir:
        run_distributed(_measure_worker, ranks, out_dir, cp)
        out = []
        for r in range(ranks):
            with open(os.path.join(out_dir, f"rank{r}.json")) as fh:
                out.append(json.load(fh))
        return out


def _check(row: str, t: int, c: int) -> None:
    config, lora = _config(row, t > 1)
    shape = with_adapters(config.activation_shape(layout_at(t, c=c), B), lora, config)
    recompute = config.recompute
    expected = activation_bytes_per_layer(shape, recompute)
    expected += layernorm_stats_bytes_per_layer(shape, recompute)
    for rank, results in enumerate(measured(t * c, c > 1)):
        for layer, got in enumerate(results[row]):
            assert got == expected, (
                f"t={t} c={c} rank {rank} layer {layer} {row}: measured {got / SB:.3f} sb, "
                f"formula {expected / SB:.3f} sb (adapters + frozen base)"
            )


@pytest.mark.parametrize("row", ROWS)
def test_adapter_bytes_one_process(row: str) -> None:
    _check(row, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
def test_adapter_bytes_tensor_sequence_parallel(row: str) -> None:
    _check(row, 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("row", CP_ROWS)
def test_adapter_bytes_context_parallel(row: str) -> None:
    _check(row, 1, 2)


def test_adapters_cost_what_the_docs_say() -> None:
    """The stated sbh terms of docs/lora.md for Llama at t = 2 + SP, none, all-linear with
    dropout: ``7·e·sb·r`` low-rank activations on every rank, ``5·sbh`` column masks (q, k,
    v, gate, up), ``sb(a·d + f)/t`` row masks (proj, fc2); and a frozen MLP without adapters
    keeps neither its input nor fc2's."""
    config, lora = _config("llama-none-all_dropout", True)
    base = config.activation_shape(layout_at(2), B)
    adapted = with_adapters(base, lora, config)
    extra = activation_bytes_per_layer(adapted) - activation_bytes_per_layer(base)
    assert extra == 7 * 2 * SB * R + 5 * SB * H + SB * (H + 176) / 2, extra
    config, lora = _config("llama-none-qv", True)
    qv = with_adapters(base, lora, config)
    freed = activation_bytes_per_layer(base) - activation_bytes_per_layer(qv)
    assert freed == (2 * SB * H / 2 + 2 * SB * 176 / 2) - 2 * 2 * SB * R, freed  # fc1, fc2 in
