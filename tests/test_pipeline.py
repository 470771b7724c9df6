"""Pipeline parallelism (1F1B and interleaved, torch.distributed.pipelining over gloo).

Real gloo ranks, one spawn per world size running every case; each rank writes what it
measured and the tests below judge it.

* Parity: after one ``train_step`` + ``finalize_grads`` of four micro-batches, the loss and
  every gradient shard on every rank equal a one-process float64 reference run on the whole
  batch (dropout 0, selective recompute, SP where t > 1), both copies of the tied embedding
  and the position embedding included; so do the validation loss (``eval_step``), a second
  step after validation, and the global gradient norm (which counts the tied embedding once).
  Layouts (t, p, m): (1,2,1), (1,2,2), (2,2,1), (1,4,1), (2,2,2), and (1,2,1) with two
  data-parallel replicas. The Llama block (RMSNorm, RoPE, SwiGLU, GQA, untied output layer: no
  tied-embedding group, no copy) runs interleaved with two replicas (1,2,2) x dp 2 and 1F1B
  with t=2 + SP (2,2,1).
* Memory: the peak of live saved activations on the first stage during one step (bf16,
  dropout on, selective recompute) is eq. 5's ``L`` layers' worth under 1F1B, and
  ``L·(1 + (p-1)/(p·m))`` under the interleaved schedule, within 1%. Measured: +0.18% on the
  layers (the LayerNorms' per-row mean and rstd, which the paper leaves out) and +0.3–0.4% on the
  whole peak (the token ids, too); one missing 1-byte mask per layer would be −2.9% (1 of the
  34 bytes per token and hidden unit), so 1% sees it where 5% could not.

Each case runs inside the one spawn of its world size and records its own failure, so the
tests below report each case by name.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

from lightning_sp import ConfigError, GPTConfig, ParallelState
from lightning_sp.memory.formulas import (
    activation_bytes_per_layer,
    embedding_activation_bytes,
    extra_activation_bytes,
    layers_in_flight,
)
from lightning_sp.memory.saved import UNTRACKED, LiveActivationTracker
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.grads import global_grad_norm
from lightning_sp.pipeline import Pipeline, check_batch, check_pipeline, chunk_layer_ranges
from lightning_sp.testing.spawn import run_distributed

from models import (
    assert_matches_reference,
    batch,
    loss_and_grads,
    max_gradient_error,
    reference_model,
    relative_error,
    tiny_config,
)

RTOL = 1e-10
GLOBAL_BATCH, MICROBATCHES, LAYERS = 8, 4, 4

# (t, p, m, dp, architecture) per world size; SP on where t > 1
PARITY_CASES = {
    2: [(1, 2, 1, 1, "gpt2"), (1, 2, 2, 1, "gpt2")],
    4: [
        (2, 2, 1, 1, "gpt2"), (1, 4, 1, 1, "gpt2"), (2, 2, 2, 1, "gpt2"), (1, 2, 1, 2, "gpt2"),
        (1, 2, 2, 2, "llama"), (2, 2, 1, 1, "llama"),
    ],
}  # fmt: skip

# memory: bf16, dropout on, selective; s·a/h small so that the attention core recomputed in
# backward (5as²b) never exceeds what the layer's MLP backward has already freed: the peak is
# then the end of a forward, where eq. 5 counts
S, MICRO, H, A = 32, 2, 128, 4
# (t, p, m, num_layers, num_microbatches) per world size. The interleaved schedule's first
# rank runs (m−1)·p + 2(p−1) warm-up forwards, then one more before its first backward, in
# torch as in Megatron: p·m + p − 1 chunk forwards in flight, i.e. the factor 1 + (p−1)/(p·m),
# provided n·m ≥ p·m + p − 1 (with p=4, m=2, n=4 all 8 forwards run first: L, not 1.375 L)
MEMORY_CASES = {2: [(1, 2, 1, 4, 4), (1, 2, 2, 4, 4)], 4: [(2, 2, 1, 4, 4), (1, 4, 2, 8, 8)]}
# the layers' worth each case's first stage holds at its peak, by hand: L under 1F1B;
# L·(1 + (p−1)/(p·m)) interleaved: 4·(1 + 1/4) = 5 and 8·(1 + 3/8) = 11
LAYERS_AT_PEAK = {(1, 2, 1, 4, 4): 4, (1, 2, 2, 4, 4): 5, (2, 2, 1, 4, 4): 4, (1, 4, 2, 8, 8): 11}
# micro-batches whose embedding output (its 1-byte dropout mask) the first stage holds at the
# peak: §4.5 counts p under 1F1B; interleaved, chunk 0 runs again before its first backward,
# and in these two cases all n micro-batches are through it (measured)
EMBEDDINGS_AT_PEAK = {
    (1, 2, 1, 4, 4): 2,
    (1, 2, 2, 4, 4): 4,
    (2, 2, 1, 4, 4): 2,
    (1, 4, 2, 8, 8): 8,
}
# measured against the formulas: +0.18% on the layers, +0.3–0.4% on the whole peak (see the
# module docstring)
MEMORY_RTOL = 0.01


def _case_name(*values: int | str, names: str = "tpmd") -> str:
    """``t1-p2-m1-d1`` (and ``-llama`` for an architecture other than GPT-2)."""
    name = "-".join(f"{k}{v}" for k, v in zip(names, values, strict=False))
    extra = [v for v in values[len(names) :] if v != "gpt2"]
    return "-".join([name, *map(str, extra)])


# -- workers ----------------------------------------------------------------------------------


def _parity(t: int, p: int, m: int, dp: int, architecture: str) -> dict[str, object]:
    state = ParallelState.from_process_group(tensor_parallel_size=t, pipeline_parallel_size=p)
    assert state.data_parallel_size == dp
    config = tiny_config(
        architecture, num_layers=LAYERS, sequence_parallel=t > 1, recompute="selective"
    )
    ids, labels = batch(config, batch_size=GLOBAL_BATCH)
    reference = reference_model(config)
    ref_loss = loss_and_grads(reference, ids, labels)
    ref_norm = torch.stack([q.grad.norm() for q in reference.parameters()]).norm()
    # this replica's share of the global batch; its micro-batches are split by the pipeline
    rows = slice(
        state.data_parallel_rank * GLOBAL_BATCH // dp,
        (state.data_parallel_rank + 1) * GLOBAL_BATCH // dp,
    )
    n = MICROBATCHES // dp
    pipe = Pipeline(config, state, num_microbatches=n, virtual_pipeline_size=m, dtype=torch.float64)
    case = f"(t, p, m, dp)={(t, p, m, dp)} {architecture} {state}"

    def replica_mean(loss: torch.Tensor) -> torch.Tensor:
        if state.dp_group is not None:
            loss = loss.clone()
            dist.all_reduce(loss, group=state.dp_group)
            loss /= dp
        return loss

    loss = replica_mean(pipe.train_step(ids[rows], labels[rows]))
    pipe.finalize_grads()
    try:  # record a mismatch rather than leave the other ranks waiting in a collective
        compared = assert_matches_reference(pipe, reference, RTOL, case)
        mismatch = None
    except AssertionError as exc:
        compared, mismatch = None, str(exc)
    grad_error, worst = max_gradient_error(pipe, reference)
    norm = global_grad_norm(list(pipe.parameters()), state)

    # both copies of the tied embedding hold the same gradient after finalize_grads
    copies_equal = None
    if p > 1 and config.tie_embeddings:
        head = pipe.chunks[-1]
        local = (config.padded_vocab_size(t) // t, config.hidden_size)
        received = (
            head.word_embeddings.weight.grad.clone()
            if pipe.has_head
            else torch.empty(local, dtype=torch.float64)
        )
        dist.broadcast(received, group=state.pp_group, group_src=p - 1)
        if pipe.has_embedding:
            copies_equal = torch.equal(received, pipe.chunks[0].word_embeddings.weight.grad)
        if pipe.has_head:  # the global norm counts the copy on the first stage only
            assert head.word_embeddings.weight.pipeline_copy, case

    pipe.eval()
    eval_loss = replica_mean(pipe.eval_step(ids[rows], labels[rows]))
    pipe.train()
    # a second step after validation re-uses the schedule (train <-> eval re-initialises it)
    pipe.zero_grad(set_to_none=True)
    loss_again = replica_mean(pipe.train_step(ids[rows], labels[rows]))
    pipe.finalize_grads()
    grad_error_again, _ = max_gradient_error(pipe, reference)
    return {
        "loss_error": relative_error(loss, ref_loss),
        "eval_loss_error": relative_error(eval_loss, ref_loss),
        "second_step_loss_error": relative_error(loss_again, ref_loss),
        "grad_error": grad_error,
        "second_step_grad_error": grad_error_again,
        "worst_parameter": worst,
        "norm_error": relative_error(norm, ref_norm),
        "mismatch": mismatch,
        "compared": compared.parameters if compared else 0,
        "elements": compared.elements if compared else 0,
        "padding_only": compared.padding_only if compared else [],
        "parameters": len(list(pipe.parameters())),
        "tied_copies_equal": copies_equal,
        "has_embedding": pipe.has_embedding,
        "has_head": pipe.has_head,
        "tied": config.tie_embeddings,
        "tied_weights": len(pipe.tied_embedding_weights()),
        "pipeline_copies": sum(hasattr(q, "pipeline_copy") for q in pipe.parameters()),
        "loss_dtype": str(loss.dtype),
    }


def _memory(t: int, p: int, m: int, layers: int, n: int) -> dict[str, object]:
    state = ParallelState.from_process_group(tensor_parallel_size=t, pipeline_parallel_size=p)
    config = GPTConfig(
        vocab_size=256, seq_length=S, hidden_size=H, num_layers=layers, num_heads=A,
        hidden_dropout=0.1, attention_dropout=0.1, sequence_parallel=t > 1,
        recompute="selective", seed=3,
    )  # fmt: skip
    ids = torch.randint(0, 256, (MICRO * n, S), generator=torch.Generator().manual_seed(0))
    pipe = Pipeline(
        config, state, num_microbatches=n, virtual_pipeline_size=m, dtype=torch.bfloat16
    )
    pipe.train()
    layer_modules = {
        f"chunks.{c}.layers.{i}": layer
        for c, chunk in enumerate(pipe.chunks)
        for i, layer in enumerate(chunk.layers)
    }
    with LiveActivationTracker(layer_modules, exclude=list(pipe.parameters())) as tracker:
        loss = pipe.train_step(ids, ids)
    del loss
    return {
        "peak_bytes": tracker.peak_bytes,
        "live_after_step": tracker.live_bytes,
        "peak_per_module": tracker.peak_per_module,
        "is_first_stage": state.is_first_stage,
    }


def _cases(world_size: int) -> dict[str, tuple]:
    """Every case of one world size: name -> (worker function, arguments)."""
    cases: dict[str, tuple] = {}
    for case in PARITY_CASES[world_size]:
        cases[f"parity {_case_name(*case)}"] = (_parity, case)
    for case in MEMORY_CASES[world_size]:
        cases[f"memory {_case_name(*case, names='tpmLn')}"] = (_memory, case)
    return cases


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    """Run every case; a case that raises records its traceback and the next case runs."""
    results: dict[str, object] = {}
    for key, (fn, args) in _cases(world_size).items():
        try:
            results[key] = fn(*args)
        except Exception:
            results[key] = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


@functools.cache
def _spawn(world_size: int) -> list[dict[str, dict]] | str:
    """Per-rank results of every case of one world size (one spawn, cached), or why the
    spawn itself failed (cached too, so each case reports it without spawning again)."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            run_distributed(_worker, world_size, out_dir)
        except Exception as exc:  # a rank crashed outside the cases
            return f"{type(exc).__name__}: {exc}"
        ranks = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.json")) as fh:
                ranks.append(json.load(fh))
        return ranks


def case_results(world_size: int, key: str) -> list[dict]:
    """One case's results on every rank; fails with the case's own error if it raised."""
    ranks = _spawn(world_size)
    if isinstance(ranks, str):
        pytest.fail(f"the spawn of world size {world_size} failed outside any case:\n{ranks}")
    results = [r[key] for r in ranks]
    errors = [f"--- rank {i} ---\n{r['error']}" for i, r in enumerate(results) if "error" in r]
    if errors:
        pytest.fail(f"{key} raised:\n" + "\n".join(errors))
    return results


# -- parity -------------------------------------------------------------------------------------

PARITY = [  # the world of 4 is the full suite's; the quick tier runs 2 ranks
    pytest.param(w, case, id=_case_name(*case), marks=[pytest.mark.slow] if w == 4 else [])
    for w, cases in PARITY_CASES.items()
    for case in cases
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world_size", "case"), PARITY)
def test_pipeline_matches_single_process_float64(world_size: int, case: tuple) -> None:
    """Loss, validation loss and every gradient shard (tied embedding on both stages and the
    position embedding included) equal one float64 process on the whole batch."""
    p = case[1]
    ranks = case_results(world_size, f"parity {_case_name(*case)}")
    for rank, r in enumerate(ranks):
        where = f"(t, p, m, dp)={case} rank {rank}"
        assert r["mismatch"] is None, r["mismatch"]
        assert r["compared"] == r["parameters"] > 0, where
        assert r["elements"] > 0, f"{where}: compared over zero elements"
        for field in (
            "loss_error", "eval_loss_error", "second_step_loss_error", "grad_error",
            "second_step_grad_error",
        ):  # fmt: skip
            assert r[field] <= RTOL, f"{where}: {field} {r[field]:.2e} ({r['worst_parameter']})"
        # global_grad_norm sums the squares in fp32 by design
        assert r["norm_error"] <= 1e-6, f"{where}: global gradient norm error {r['norm_error']}"
        assert r["loss_dtype"] == "torch.float64", where
        if r["has_embedding"] and p > 1 and r["tied"]:
            assert r["tied_copies_equal"], f"{where}: tied embedding copies differ"
        if not r["tied"]:  # untied (Llama): no group sums a copy, none is left out of the norm
            assert r["tied_weights"] == r["pipeline_copies"] == 0, where
    stages = {(r["has_embedding"], r["has_head"]) for r in ranks}
    assert {(True, False), (False, True)} <= stages, "no first and last stage"


# -- activation memory on the first stage (eq. 5 and the interleaving factor) ----------------

MEMORY = [
    pytest.param(
        w, case, id=_case_name(*case, names="tpmLn"), marks=[pytest.mark.slow] if w == 4 else []
    )
    for w, cases in MEMORY_CASES.items()
    for case in cases
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world_size", "case"),
    MEMORY,
)
def test_first_stage_peak_activations(world_size: int, case: tuple) -> None:
    """First stage, rank 0: the transformer layers' saved bytes at the peak are eq. 5's ``L``
    layers' worth (1F1B) or ``L·(1 + (p-1)/(p·m))`` (interleaved), within 1%; with the
    embedding's dropout masks of the micro-batches in flight, the whole peak is within 1% too."""
    t, p, m, layers, n = case
    r = case_results(world_size, f"memory {_case_name(*case, names='tpmLn')}")[0]
    assert r["is_first_stage"]
    assert r["live_after_step"] == 0, "saved activations outlived the step"
    shape = ActivationShape(S, MICRO, H, A, t, sequence_parallel=t > 1)
    per_layer = activation_bytes_per_layer(shape, "selective")
    # the schedule module's count of layers in flight is the hand-computed one
    assert layers_in_flight(layers, p, m, n) == LAYERS_AT_PEAK[case]
    layer_bytes = sum(v for k, v in r["peak_per_module"].items() if k != UNTRACKED)
    expected_layers = per_layer * LAYERS_AT_PEAK[case]
    assert layer_bytes == pytest.approx(expected_layers, rel=MEMORY_RTOL), (
        f"{case}: layers hold {layer_bytes / per_layer:.4f} layers' worth at the peak, "
        f"eq. 5{' x (1 + (p-1)/(p·m))' if m > 1 else ''} says {LAYERS_AT_PEAK[case]} (tolerance "
        f"{MEMORY_RTOL:.0%}): a saved tensor is missing or extra"
    )
    # the rest is the embedding: its 1-byte dropout mask (sbh/t) for each micro-batch in
    # flight (and the token ids, 0.1% of the peak, which the paper leaves out)
    masks = embedding_activation_bytes(shape)
    if m == 1:  # §4.5's p masks
        assert extra_activation_bytes(shape, 256, p) == (EMBEDDINGS_AT_PEAK[case] * masks)
    expected = expected_layers + EMBEDDINGS_AT_PEAK[case] * masks
    assert r["peak_bytes"] == pytest.approx(expected, rel=MEMORY_RTOL), (
        f"{case}: peak {r['peak_bytes']} bytes, eq. 5 and the embedding masks say "
        f"{expected:.0f} (tolerance {MEMORY_RTOL:.0%})"
    )


# -- configuration errors ---------------------------------------------------------------------


def _state(p: int) -> ParallelState:
    """A layout description without process groups (errors are raised before any is used)."""
    return ParallelState(1, p, 1, 0, 0, 0, None, None, None, torch.device("cpu"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_layers=6, p=2, m=2, n=4), "num_layers=6 is not divisible by"),
        (dict(num_layers=3, p=2, m=1, n=4), "num_layers=3 is not divisible by"),
        (dict(num_layers=4, p=4, m=1, n=2), "num_microbatches=2 is fewer than"),
        (dict(num_layers=8, p=2, m=2, n=1), "num_microbatches=1 is fewer than"),
        (dict(num_layers=8, p=2, m=2, n=3), "num_microbatches=3 is not a multiple"),
        (dict(num_layers=4, p=1, m=2, n=4), "virtual_pipeline_size=2 interleaves"),
        (dict(num_layers=4, p=2, m=2, n=4, schedule="1f1b"), "schedule='1f1b' runs one"),
        (dict(num_layers=4, p=2, m=1, n=4, schedule="gpipe"), "schedule='gpipe' is not"),
        (dict(num_layers=4, p=2, m=0, n=4), "virtual_pipeline_size=0 must be"),
        (dict(num_layers=4, p=2, m=1, n=0), "num_microbatches=0 must be"),
    ],
)
def test_bad_pipeline_layouts_raise_config_error(kwargs: dict, message: str) -> None:
    kwargs = dict(kwargs)
    layers, p, m, n = (kwargs.pop(k) for k in ("num_layers", "p", "m", "n"))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_pipeline(layers, p, m, n, **kwargs)
    # the Pipeline raises the same before it builds anything
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Pipeline(tiny_config(num_layers=layers), _state(p), num_microbatches=n,
                 virtual_pipeline_size=m, **kwargs)  # fmt: skip


def test_global_batch_must_divide_over_microbatches_and_replicas() -> None:
    assert check_batch(16, 4, 2) == 2
    with pytest.raises(ConfigError, match=r"global batch size 12 is not divisible by .* = 8"):
        check_batch(12, 4, 2)
    with pytest.raises(ConfigError, match="global batch size 6 is not divisible"):
        check_batch(6, 4)
    pipe = Pipeline(tiny_config(), ParallelState.single(), num_microbatches=4)
    ids, labels = batch(tiny_config(), batch_size=6)
    with pytest.raises(ConfigError, match="global batch size 6 is not divisible"):
        pipe.train_step(ids, labels)


def test_chunk_layout_is_megatron_interleaving() -> None:
    """Chunk c of pipeline rank r is virtual stage c·p + r."""
    assert chunk_layer_ranges(8, 2, 2, 0) == [range(0, 2), range(4, 6)]
    assert chunk_layer_ranges(8, 2, 2, 1) == [range(2, 4), range(6, 8)]
    assert chunk_layer_ranges(8, 4, 1, 3) == [range(6, 8)]


def test_single_stage_accumulates_microbatches() -> None:
    """p = 1: micro-batches run one after another; the result is the whole batch's."""
    config = tiny_config(recompute="selective")
    ids, labels = batch(config, batch_size=GLOBAL_BATCH)
    reference = reference_model(config)
    ref_loss = loss_and_grads(reference, ids, labels)
    pipe = Pipeline(config, ParallelState.single(), num_microbatches=4, dtype=torch.float64)
    loss = pipe.train_step(ids, labels)
    pipe.finalize_grads()
    assert relative_error(loss, ref_loss) <= RTOL
    compared = assert_matches_reference(pipe, reference, RTOL)
    assert compared.parameters == len(list(pipe.parameters()))
    assert relative_error(pipe.eval_step(ids, labels), ref_loss) <= RTOL
