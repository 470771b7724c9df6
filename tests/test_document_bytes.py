"""What a document mask adds to activation memory, measured with saved-tensor hooks (bf16,
s=256 b=2 h=256 a=8, the shapes and configs of ``test_activation_bytes.py``) against the
formulas, to the byte:

* per layer: ``math`` nothing (its mask replaces the causal score bias, transient); ``sdpa``
  (one call per document) the concatenated context its projection keeps, ``e·sb·a·d/t``
  (``+2 sbh/t``), under every preset but ``full`` (the layer input only); under context
  parallelism nothing (the CP core masks its chunk pairs and keeps q, k, v);
* per micro-batch: document ids ``4·b·s``, positions ``8·b·s/c`` (from the data path's own
  samples) and, under RoPE, one pair of per-token cos/sin tables ``2·e·b·(s/c)·d`` shared by
  every layer (read from the rotations' autograd nodes);
* the planner (``estimate``, measured under fake tensors) and ``ActivationMemoryMonitor`` read
  them for a config with document masking.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_activation_bytes import LAYERS, SBH, A, B, S, _config

from lightning_sp import GPT, ParallelState, SavedTensorTracker
from lightning_sp.data.documents import DocumentOptions, annotate
from lightning_sp.memory.formulas import (
    CONTEXT_GENERATOR_STATE_BYTES,
    activation_bytes_per_layer,
    layernorm_stats_bytes_per_layer,
)
from lightning_sp.model.attention import _Rope
from lightning_sp.model.documents import Packing, packed_bytes, positions_in_documents
from lightning_sp.parallel.context import shard_for_context_parallel
from lightning_sp.planner.estimate import estimate
from lightning_sp.planner.layout import Layout
from lightning_sp.testing.spawn import run_distributed

from models import layout_at

LENGTHS = ([100, 60, 96], [256])  # documents per sequence: one row packed, one whole
GRID = list(
    itertools.product(("gpt2", "llama"), ("math", "sdpa"), ("none", "selective", "lean", "full"))
)
QUICK = [("llama", "sdpa", "lean")]


def _packed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, document ids and positions ``[B, S]``."""
    ids = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    documents = torch.stack(
        [
            torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
            for lengths in LENGTHS
        ]
    )
    return ids, documents, positions_in_documents(documents)


def _measure(state: ParallelState, grid: list, sequence_parallel: bool) -> list[str]:
    """Each layer's saved bytes with the document mask against the formula's (and, so the
    comparison can fail, the causal formula differs where the mask adds a term)."""
    checked = []
    ids, documents, positions = _packed()
    t, c = state.tensor_parallel_size, state.context_parallel_size
    local = shard_for_context_parallel(positions, 1, c, state.context_parallel_rank)
    local_ids = shard_for_context_parallel(ids, 1, c, state.context_parallel_rank)
    for architecture, attention, recompute in grid:
        config = _config(sequence_parallel, recompute, attention, architecture)
        model = GPT(config, state, dtype=torch.bfloat16).train()
        with SavedTensorTracker.for_model(model) as tracker:
            loss = model(local_ids, local_ids, Packing(documents, local))
        loss.backward()
        shape = config.activation_shape(layout_at(t, c=c), B, documents=True)
        expected = activation_bytes_per_layer(shape, recompute)
        expected += layernorm_stats_bytes_per_layer(shape, recompute)
        if c > 1 and config.attention_dropout > 0 and recompute != "full":  # stated apart
            expected += CONTEXT_GENERATOR_STATE_BYTES["cpu"]
        causal = activation_bytes_per_layer(
            config.activation_shape(layout_at(t, c=c), B), recompute
        )
        what = f"{architecture} {attention} {recompute} t={t} c={c} sp={sequence_parallel}"
        for layer in range(config.num_layers):
            got = tracker.report.bytes_of(f"layers.{layer}")
            assert got == expected, (
                f"{what} layer {layer}: measured {got / SBH:.5f} sbh, formula "
                f"{expected / SBH:.5f} sbh"
            )
        copies = attention == "sdpa" and recompute != "full" and c == 1
        added = activation_bytes_per_layer(shape, recompute) - causal
        assert added == (2 * SBH / t if copies else 0), f"{what}: document term {added / SBH}"
        checked.append(what)
    return checked


def test_document_mask_bytes_per_layer_quick() -> None:
    assert len(_measure(ParallelState.single(), QUICK, False)) == len(QUICK)


@pytest.mark.slow
def test_document_mask_bytes_per_layer_every_preset() -> None:
    assert len(_measure(ParallelState.single(), GRID, False)) == len(GRID)


SPAWN_GRID = [row for row in GRID if row[2] != "selective"]  # selective in one process only (time)


def _worker(rank: int, world_size: int) -> list[str]:
    grid = SPAWN_GRID
    state = ParallelState.from_process_group(tensor_parallel_size=2)
    checked = _measure(state, grid, True)
    state = ParallelState.from_process_group(context_parallel_size=2)
    return checked + _measure(state, grid, False)


@pytest.mark.slow
def test_document_mask_bytes_per_layer_t2_sp_and_c2() -> None:
    results = run_distributed(_worker, 2)
    assert all(len(r) == 2 * len(SPAWN_GRID) for r in results)


def _rope_tables(loss: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cos/sin tables each rotation of the graph keeps for its backward."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == f"{_Rope.__name__}Backward":
            found.append(node.tables)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def test_micro_batch_ids_positions_and_rope_tables() -> None:
    """The data path's samples carry 4 bytes of document id and 8 of position per token, and
    every layer rotates by one pair of per-token tables of the micro-batch."""
    row = torch.tensor([5, 9, 0, 7, 7, 0, 3, 4, 8])  # s + 1 = 9 tokens, end-of-document 0
    options = DocumentOptions(document_mask=True, reset_position_ids=True)
    samples = [annotate(row, 0, options) for _ in range(B)]
    batch = {k: torch.stack([x[k] for x in samples]) for k in samples[0]}
    config = _config(False, "none", "sdpa", "llama")  # run on 8 of its 256 positions
    shape = config.activation_shape(layout_at(1), B, seq_length=8, documents=True)
    bytes_ = packed_bytes(shape, document_mask=True, reset_position_ids=True, rotary=True)
    carried = batch["documents"].nbytes + batch["positions"].nbytes
    assert bytes_.ids == carried == 12 * B * 8
    model = GPT(config, ParallelState.single(), dtype=torch.bfloat16).train()
    loss = model(batch["input_ids"], batch["labels"], Packing.of_batch(batch, model.state))
    tables = _rope_tables(loss)
    assert len(tables) == config.num_layers
    storages = {y.untyped_storage()._cdata: y.untyped_storage().nbytes() for p in tables for y in p}
    assert sum(storages.values()) == bytes_.tables == 2 * 2 * B * 8 * config.head_dim
    learned = packed_bytes(shape, document_mask=True, reset_position_ids=True, rotary=False)
    assert learned.tables == 0


def test_estimate_and_monitor_count_the_document_mask() -> None:
    """``estimate`` of a Llama ``sdpa`` layout with ``document_mask``: its measured bytes per
    layer equal the real model's with packed documents (hooks), 2 sbh above the causal
    layout's; the first stage adds the ids and the per-token tables."""
    from lightning_sp.callbacks.memory import ActivationMemoryMonitor

    config = _config(False, "none", "sdpa", "llama")
    ids, documents, positions = _packed()
    model = GPT(config, ParallelState.single(), dtype=torch.bfloat16).train()
    with SavedTensorTracker.for_model(model) as tracker:
        model(ids, ids, Packing(documents, positions))
    real = tracker.report.bytes_of("layers.0")
    rows = {}
    for mask in (False, True):
        layout = Layout(
            config=config, micro_batch_size=B, document_mask=mask, reset_position_ids=mask
        )
        rows[mask] = estimate(layout).row(False, "none")
    assert rows[True].activation_bytes_per_layer == real
    assert rows[True].activation_bytes_per_layer - rows[False].activation_bytes_per_layer == 2 * SBH
    shape = config.activation_shape(layout_at(1), B, documents=True)
    extra = packed_bytes(shape, document_mask=True, reset_position_ids=True, rotary=True)
    first = rows[True].first_stage_activation_bytes - rows[False].first_stage_activation_bytes
    assert first == 2 * SBH * config.num_layers + extra.ids + extra.tables
    monitor = ActivationMemoryMonitor()
    monitor._documents = True
    expected = activation_bytes_per_layer(shape, "none")
    assert (
        monitor._formula_per_layer(model, B, S)
        == expected
        == real - (layernorm_stats_bytes_per_layer(shape, "none"))
    )
    assert A == 8  # the shape the docs quote (s=256, b=2, h=256, a=8)


def test_estimate_reads_the_data_options() -> None:
    """``estimate`` takes ``data.document_mask`` / ``data.reset_position_ids`` from the fit
    config (Llama 3's turns the mask on) into its layout, and the search keeps them."""
    import os

    from lightning_sp.cli.estimate import read_estimate_args
    from lightning_sp.planner.presets import load_cluster
    from lightning_sp.planner.search import search

    from cli_runs import ROOT

    args = ["--config", os.path.join(ROOT, "configs", "llama3_8b.yaml")]
    layout = read_estimate_args(args).layout
    assert layout.document_mask and not layout.reset_position_ids
    off = read_estimate_args([*args, "--data.document_mask", "false"]).layout
    assert not off.document_mask
    tiny = Layout(config=_config(False, "none", "sdpa", "llama"), document_mask=True,
                  data_parallel_size=2)  # fmt: skip
    ranked = search(tiny, load_cluster("h100-80gb"), 80e9).ranked
    assert ranked and all(candidate.layout.document_mask for candidate in ranked)


def test_first_stage_holds_every_micro_batchs_ids_through_a_pipeline() -> None:
    """p = 2, n = 4 micro-batches of b = 2 (formula): the step's packed ids and positions are
    held for the whole step, ``4·b·s`` document ids + ``8·b·s`` positions for each of the n
    micro-batches, while the layers (2 sbh more each under the mask, L/p = 1 of them) and the
    per-token RoPE tables are held for the p micro-batches in flight (eq. 5)."""
    config = _config(False, "none", "sdpa", "llama")
    rows = {}
    for mask in (False, True):
        layout = Layout(
            config=config, micro_batch_size=B, pipeline_parallel_size=2, num_microbatches=4,
            document_mask=mask, reset_position_ids=mask,
        )  # fmt: skip
        rows[mask] = estimate(layout, measure=False).row(False, "none")
    shape = config.activation_shape(layout_at(1), B, documents=True)
    tables = packed_bytes(shape, document_mask=True, reset_position_ids=True, rotary=True).tables
    ids = (4 + 8) * B * S
    first = (
        rows[True].formula_first_stage_activation_bytes
        - rows[False].formula_first_stage_activation_bytes
    )
    expected = 2 * SBH * (LAYERS // 2) * 2 + 4 * ids + 2 * tables
    assert first == expected, (
        f"first stage at p = 2, n = 4 with packed documents: {first} B more than causal, "
        f"expected {expected} B (the ids of all 4 micro-batches, the rest for 2 in flight)"
    )
