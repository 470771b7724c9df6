"""The whole model under context parallelism equals one process, and stores what the formula
says.

* Parity (float64, gloo): a GPT-2 block (learned positions, tied) and a Llama block (RoPE,
  GQA, SwiGLU, untied) at c = 2, c = 4, and t = 2 x c = 2 with and without sequence
  parallelism, for both attention backends and the presets ``none``, ``selective``, ``full``.
  Each CP rank feeds its load-balanced shards of the batch (``shard_for_context_parallel``);
  the loss must be the one-process loss on every rank and every gradient shard (summed over the
  CP group, :func:`~lightning_sp.parallel.grads.sum_context_parallel_grads`) its slice of the
  one-process gradient, within 1e-10 relative.
* Memory (bf16): the bytes each layer saves for backward at c = 2, measured with the
  saved-tensor tracker, equal :func:`activation_bytes_per_layer` of the shape with ``c = 2``
  plus the norms' statistics, plus the CP core's generator state with attention dropout.

Every rank builds its models from the same seed (nothing is pickled between processes).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_sp import GPT, GPTConfig, ParallelState, SavedTensorTracker
from lightning_sp.memory.formulas import (
    CONTEXT_GENERATOR_STATE_BYTES,
    activation_bytes_per_layer,
    layer_saved_terms,
    layernorm_stats_bytes_per_layer,
)
from lightning_sp.model.recompute import active_modules, parse_recompute
from lightning_sp.testing.spawn import run_distributed

from models import (
    assert_matches_reference,
    batch,
    context_shards,
    layout_at,
    loss_and_grads,
    reference_model,
    relative_error,
    tiny_config,
)

RTOL = 1e-10
ARCHITECTURES = ("gpt2", "llama")
BACKENDS = ("math", "sdpa")
PRESETS = ("none", "selective", "full")
FULL_GRID = list(itertools.product(ARCHITECTURES, BACKENDS, PRESETS))
QUICK_GRID = [("gpt2", "math", "none"), ("llama", "sdpa", "selective")]


def _check_parity(state: ParallelState, sequence_parallel: bool, grid: list) -> list[str]:
    """Every (architecture, backend, preset) of ``grid`` on ``state``'s layout: loss and every
    gradient shard against the one-process float64 model. Returns the cases checked."""
    checked = []
    for architecture, attention, preset in grid:
        config = tiny_config(
            architecture, attention=attention, recompute=preset,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
        what = (
            f"{architecture} {attention} {preset} t={state.tensor_parallel_size} "
            f"c={state.context_parallel_size} sp={sequence_parallel}"
        )
        ids, labels = batch(config)
        reference = reference_model(config)
        ref_loss = loss_and_grads(reference, ids, labels)
        model = GPT(config, state, dtype=torch.float64)
        local_ids, local_labels = context_shards(state, ids, labels)
        assert local_ids.shape[1] == config.seq_length // state.context_parallel_size
        loss = loss_and_grads(model, local_ids, local_labels)
        err = relative_error(loss, ref_loss)
        assert err <= RTOL, f"{what}: loss {loss.item()} vs {ref_loss.item()} ({err:.2e})"
        compared = assert_matches_reference(model, reference, RTOL, what)
        assert compared.elements > 0, f"{what}: nothing compared"
        checked.append(what)
    return checked


def _parity_worker(rank: int, world_size: int, grid: list) -> list[str]:
    checked = []
    state = ParallelState.from_process_group(context_parallel_size=world_size)
    assert state.cp_group is not None and state.data_parallel_size == 1
    checked += _check_parity(state, False, grid)
    if world_size == 4:  # t = 2 x c = 2, with and without SP (TP innermost)
        state = ParallelState.from_process_group(tensor_parallel_size=2, context_parallel_size=2)
        assert (state.tensor_parallel_rank, state.context_parallel_rank) == (rank % 2, rank // 2)
        checked += _check_parity(state, True, grid)
        checked += _check_parity(state, False, grid)
    return checked


def test_context_parallel_model_two_ranks_quick() -> None:
    """c = 2: GPT-2 math and Llama sdpa+selective equal one process."""
    checked = run_distributed(_parity_worker, 2, QUICK_GRID)
    assert all(len(c) == len(QUICK_GRID) for c in checked)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_model_equals_one_process(world_size: int) -> None:
    """c = 2 (world 2); c = 4 and t = 2 x c = 2 with and without SP (world 4): GPT-2 and Llama,
    math and sdpa, presets none / selective / full."""
    checked = run_distributed(_parity_worker, world_size, FULL_GRID)
    layouts = 1 if world_size == 2 else 3
    assert all(len(c) == layouts * len(FULL_GRID) for c in checked), checked[0]


S, B, H, A, LAYERS = 64, 2, 64, 4, 2
MEMORY_ROWS = {  # row -> (architecture, attention, recompute, attention dropout)
    "gpt2_math_none": ("gpt2", "math", "none", 0.0),
    "gpt2_math_none_dropout": ("gpt2", "math", "none", 0.1),
    "gpt2_math_selective_dropout": ("gpt2", "math", "selective", 0.1),
    "gpt2_sdpa_none": ("gpt2", "sdpa", "none", 0.0),
    "gpt2_math_full": ("gpt2", "math", "full", 0.1),
    "llama_sdpa_none": ("llama", "sdpa", "none", 0.0),
    "llama_math_selective": ("llama", "math", "selective", 0.0),
}


def _memory_config(row: str, sequence_parallel: bool) -> GPTConfig:
    architecture, attention, recompute, attention_dropout = MEMORY_ROWS[row]
    return tiny_config(
        architecture, seq_length=S, hidden_size=H, num_heads=A, num_layers=LAYERS,
        hidden_dropout=0.1 if architecture == "gpt2" else 0.0,
        attention_dropout=attention_dropout, attention=attention, recompute=recompute,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip


def _memory_worker(rank: int, world_size: int) -> dict[str, tuple[list[int], float]]:
    """``row -> (measured bytes per layer, expected)`` on this rank, for c = 2 (t = 1, and
    t = 2 with SP on four ranks)."""
    t = world_size // 2
    state = ParallelState.from_process_group(tensor_parallel_size=t, context_parallel_size=2)
    results = {}
    for row in MEMORY_ROWS:
        config = _memory_config(row, sequence_parallel=t > 1)
        ids = torch.randint(
            0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)
        )
        (local,) = context_shards(state, ids)
        model = GPT(config, state, dtype=torch.bfloat16)
        model.train()
        with SavedTensorTracker.for_model(model) as tracker:
            loss = model(local, local)
        loss.backward()  # the saved tensors were real: backward runs on them
        shape = config.activation_shape(layout_at(t, c=2), B)
        expected = activation_bytes_per_layer(shape, config.recompute)
        expected += layernorm_stats_bytes_per_layer(shape, config.recompute)
        if config.attention_dropout > 0 and config.recompute != "full":
            expected += CONTEXT_GENERATOR_STATE_BYTES["cpu"]
        results[row] = ([tracker.report.bytes_of(f"layers.{i}") for i in range(LAYERS)], expected)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4], ids=["c2", "t2-c2-sp"])
def test_bytes_per_layer_at_c2_equal_the_formula(world_size: int) -> None:
    for rank, rows in enumerate(run_distributed(_memory_worker, world_size)):
        for row, (measured, expected) in rows.items():
            assert measured == [expected] * LAYERS, f"rank {rank} {row}: {measured} != {expected}"


def test_formula_divides_by_c_and_drops_the_core_scores() -> None:
    """At c = 2 each rank stores half of every c = 1 term except the core's scores and
    logsumexp, which the CP core does not keep (both backends, TP + SP, every preset but
    ``full``, which keeps half the layer input)."""
    core_terms = {"attention_scores", "attention_lse"}
    for attention, preset in itertools.product(BACKENDS, ("none", "selective")):
        config = tiny_config(
            "gpt2", seq_length=S, hidden_size=H, num_heads=A, hidden_dropout=0.1,
            attention_dropout=0.1, attention=attention, sequence_parallel=True,
        )  # fmt: skip
        one = config.activation_shape(layout_at(2), B)
        two = config.activation_shape(layout_at(2, c=2), B)
        assert (two.c, two.s) == (2, S)
        dropped = {
            term for m in active_modules(parse_recompute(preset), attention) for term in m.drops
        }
        kept = sum(
            nbytes / one.t  # TP + SP: every term is split by t
            for name, (nbytes, _) in layer_saved_terms(one).items()
            if name not in core_terms | dropped
        )
        assert activation_bytes_per_layer(two, preset) == kept / 2, (attention, preset)
        scores = sum(layer_saved_terms(one)[name][0] for name in core_terms)
        assert scores > 0 and all(layer_saved_terms(two)[name][0] == 0 for name in core_terms)
        assert (
            activation_bytes_per_layer(two, "full") == activation_bytes_per_layer(one, "full") / 2
        )


def _dropout_worker(rank: int, world_size: int) -> dict[str, float]:
    """c = 2 with hidden and attention dropout: every preset draws (and replays) the same
    masks, so loss and gradients agree across presets; returns the worst disagreements."""
    state = ParallelState.from_process_group(context_parallel_size=world_size)
    worst: dict[str, float] = {}
    for architecture, attention in itertools.product(ARCHITECTURES, BACKENDS):
        runs = {}
        for preset in PRESETS:
            config = tiny_config(
                architecture, attention=attention, recompute=preset,
                hidden_dropout=0.1, attention_dropout=0.2,
            )  # fmt: skip
            ids, labels = context_shards(state, *batch(config))
            model = GPT(config, state, dtype=torch.float64)
            loss = loss_and_grads(model, ids, labels)
            runs[preset] = (loss, {n: p.grad for n, p in model.named_parameters()})
        base_loss, base_grads = runs["none"]
        for preset in PRESETS[1:]:
            loss, grads = runs[preset]
            err = max(
                [relative_error(loss, base_loss)]
                + [relative_error(grads[n], g) for n, g in base_grads.items()]
            )
            worst[f"{architecture} {attention} {preset}"] = err
    return worst


@pytest.mark.slow
def test_dropout_replays_identically_under_every_preset() -> None:
    """c = 2, dropout on: ``selective`` and ``full`` equal ``none`` (masks drawn from the
    per-CP-rank streams and replayed by recompute and by the CP core's own backward)."""
    for rank, worst in enumerate(run_distributed(_dropout_worker, 2)):
        assert len(worst) == len(ARCHITECTURES) * len(BACKENDS) * (len(PRESETS) - 1)
        for case, err in worst.items():
            assert err <= RTOL, f"rank {rank} {case}: {err:.2e} from recompute none"


def test_streams_differ_per_context_rank_and_keep_c1_seeds() -> None:
    """Both dropout streams are seeded with the CP rank when c > 1 (different tokens, so
    different masks, even where TP replicas must agree); with c = 1 the seeds are unchanged."""
    from dataclasses import replace

    from lightning_sp.parallel.random import RNGStreams, derive_seed

    single = ParallelState.single()
    streams = RNGStreams(7, single)
    assert streams.replicated.initial_seed() == derive_seed(7, "replicated", 0, 0, 0)
    assert streams.sharded.initial_seed() == derive_seed(7, "sharded", 0, 0, 0, 0)
    seeds = set()
    for rank in range(2):
        state = replace(single, context_parallel_size=2, context_parallel_rank=rank)
        cp = RNGStreams(7, state)
        seeds |= {cp.replicated.initial_seed(), cp.sharded.initial_seed()}
    assert len(seeds | {streams.replicated.initial_seed(), streams.sharded.initial_seed()}) == 6


def test_layout_and_sequence_errors_name_the_values() -> None:
    """``check_layout`` counts c in the world; ``check_sequence`` checks the local sequence."""
    from dataclasses import replace

    from lightning_sp.errors import ConfigError

    from models import check_layout

    assert check_layout(8, 2, 1, 2) == 2
    with pytest.raises(ConfigError, match=r"context_parallel_size = 2 \* 1 \* 4 = 8; t \* p \* c"):
        check_layout(12, 2, 1, 4)
    with pytest.raises(ConfigError, match="context_parallel_size"):
        check_layout(4, 1, 1, 0)
    state = replace(ParallelState.single(), context_parallel_size=2, context_parallel_rank=1)
    model = GPT(tiny_config(), state, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"length 10 x context_parallel_size 2 = 20 exceeds"):
        model.check_sequence(10)
    with pytest.raises(ValueError, match="local sequence length 7 under context_parallel_size=2"):
        model.check_sequence(7)
    model.check_sequence(8)
