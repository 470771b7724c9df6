"""Packed documents: block-causal attention and positions restarting per document.

Float64: two sequences, each packing several documents whose boundaries cross the context
parallel chunk boundaries (chunks of 4 tokens at c = 2, s = 16), run with their document ids
and per-document positions, give for every token the logits and loss of running its document
alone (positions from 0), and the gradients of the summed per-document losses; GPT-2 (learned
positions) and Llama (RoPE, GQA), ``math`` and ``sdpa``, every preset: one process (quick), t = 2
+ SP, c = 2 and p = 2 (2 ranks, quick: a subset), t = 2 + SP x c = 2 and p = 2 x c = 2 (4 ranks,
slow: everything). Through the pipeline the loss is the global token mean
(:class:`~lightning_sp.pipeline.token_mean.TokenMean`), each stage given its micro-batch's rows
of the ids and positions.
The last token of each document has no label (its next token is another document's), as with
``eod_mask_loss``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_sp import GPT, ParallelState
from lightning_sp.model.attention import token_positions
from lightning_sp.model.documents import (
    Packing,
    document_id_bytes,
    document_ids,
    positions_in_documents,
)
from lightning_sp.parallel.grads import (
    allreduce_replicated_grads,
    allreduce_sequence_parallel_grads,
    sum_context_parallel_grads,
)
from lightning_sp.parallel.vocab import IGNORE_INDEX, vocab_parallel_cross_entropy
from lightning_sp.pipeline import Pipeline
from lightning_sp.pipeline.token_mean import TokenMean
from lightning_sp.testing.spawn import run_distributed

from models import (
    assert_matches_reference,
    context_shards,
    reference_model,
    relative_error,
    tiny_config,
)

RTOL = 1e-10
LENGTHS = ([5, 3, 7, 1], [2, 9, 5])  # documents per sequence (s = 16), crossing chunks of 4
GRID = list(itertools.product(("gpt2", "llama"), ("math", "sdpa"), ("none", "selective", "full")))
QUICK = [("gpt2", "math", "selective"), ("llama", "sdpa", "full")]


def packed(config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, labels (``IGNORE_INDEX`` at each document's last token) and document ids ``[2, s]``."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=generator)
    documents = torch.stack(
        [
            torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
            for lengths in LENGTHS
        ]
    )
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    last = torch.ones_like(documents, dtype=torch.bool)
    last[:, :-1] = documents[:, 1:] != documents[:, :-1]
    return ids, labels.masked_fill(last, IGNORE_INDEX), documents


def alone(reference: GPT, ids, labels, documents) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each document run alone: logits ``[s, b, v]`` and per-token losses ``[s, b]`` in packed
    order; the reference's gradients are those of the summed losses over the counted tokens
    divided by their number (returned)."""
    counted = int((labels != IGNORE_INDEX).sum())
    logits = torch.zeros(
        ids.shape[1], ids.shape[0], reference.padded_vocab_size, dtype=torch.float64
    )
    losses = torch.zeros(ids.shape[1], ids.shape[0], dtype=torch.float64)
    reference.zero_grad(set_to_none=True)
    for row in range(ids.shape[0]):
        for doc in documents[row].unique():
            where = (documents[row] == doc).nonzero().squeeze(1)
            doc_ids, doc_labels = ids[row, where][None], labels[row, where][None]
            x = reference.forward_layers(reference.embed(doc_ids))
            out = reference.logits(x)  # [n, 1, v]
            mask = doc_labels.t() != IGNORE_INDEX
            token_losses = vocab_parallel_cross_entropy(
                out, doc_labels.t(), 0, reference.config.vocab_size, None, mask
            )
            (token_losses.sum() / counted).backward()
            logits[where, row] = out[:, 0].detach()
            losses[where, row] = token_losses[:, 0].detach()
    return logits, losses, counted


def _check(state: ParallelState, sequence_parallel: bool, grid: list) -> list[str]:
    checked = []
    t, c = state.tensor_parallel_size, state.context_parallel_size
    for architecture, attention, preset in grid:
        what = f"{architecture} {attention} {preset} t={t} c={c} sp={sequence_parallel}"
        config = tiny_config(
            architecture, attention=attention, recompute=preset, sequence_parallel=sequence_parallel
        )
        ids, labels, documents = packed(config)
        reference = reference_model(config)
        ref_logits, ref_losses, counted = alone(reference, ids, labels, documents)
        model = GPT(config, state, dtype=torch.float64)
        positions = positions_in_documents(documents)
        local_ids, local_labels = context_shards(state, ids, labels)
        # the product's path: this CP rank's positions as the training step cuts them
        packing = Packing.of_batch({"documents": documents, "positions": positions}, state)
        local_positions = packing.positions
        # per token: logits and losses, this rank's tokens and vocabulary shard
        with torch.no_grad():
            x = model.embed(local_ids, positions=local_positions)
            logits = model.logits(model.forward_layers(x, documents, local_positions))
        where = token_positions(0, local_ids.shape[1], state)
        vocab = model.padded_vocab_size // t
        start = model.vocab_start
        true = max(0, min(vocab, config.vocab_size - start))
        expected = ref_logits[where][:, :, start : start + true]
        err = relative_error(logits[:, :, :true], expected)
        assert err <= RTOL, f"{what}: logits relative error {err:.2e}"
        mask = local_labels.t() != IGNORE_INDEX
        token_losses = vocab_parallel_cross_entropy(
            logits, local_labels.t(), start, config.vocab_size, state.tp_group, mask
        )
        err = relative_error(token_losses, ref_losses[where])
        assert err <= RTOL, f"{what}: per-token loss relative error {err:.2e}"
        # the loss and every gradient shard of the packed batch
        model.zero_grad(set_to_none=True)
        loss = model(local_ids, local_labels, packing)
        loss.backward()
        allreduce_sequence_parallel_grads(model, state)
        allreduce_replicated_grads(model, state)
        sum_context_parallel_grads(model, state)
        ref_loss = ref_losses.sum() / counted
        err = relative_error(loss.detach(), ref_loss)
        assert err <= RTOL, f"{what}: loss {loss.item()} vs {ref_loss.item()} ({err:.2e})"
        compared = assert_matches_reference(model, reference, RTOL, what)
        assert compared.elements > 0, what
        checked.append(what)
    return checked


def _check_pipeline(state: ParallelState, grid: list) -> list[str]:
    """The packed batch through the pipeline schedule (2 micro-batches of one sequence, each
    stage given its rows of the document ids and positions), with the global token mean."""
    checked = []
    for architecture, attention, preset in grid:
        p, c = state.pipeline_parallel_size, state.context_parallel_size
        what = f"{architecture} {attention} {preset} p={p} c={c}"
        config = tiny_config(architecture, attention=attention, recompute=preset)
        ids, labels, documents = packed(config)
        reference = reference_model(config)
        _, ref_losses, counted = alone(reference, ids, labels, documents)
        pipe = Pipeline(config, state, num_microbatches=2, dtype=torch.float64)
        positions = positions_in_documents(documents)
        local_ids, local_labels = context_shards(state, ids, labels)
        batch = {"documents": documents, "positions": positions, "loss_mask": labels >= 0}
        packing = Packing.of_batch(batch, state)  # the training step's: positions cut, "sum"
        mean = TokenMean(state)
        total = pipe.train_step(local_ids, local_labels, packing)
        mean.add(labels, total)
        pipe.finalize_grads()
        loss = mean.finish(pipe)
        ref_loss = ref_losses.sum() / counted
        err = relative_error(loss, ref_loss)
        assert err <= RTOL, f"{what}: loss {loss.item()} vs {ref_loss.item()} ({err:.2e})"
        compared = assert_matches_reference(pipe, reference, RTOL, what)
        assert compared.elements > 0, what
        checked.append(what)
    return checked


def test_document_helpers() -> None:
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 3]])
    documents = document_ids(tokens, eod_id=0)
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 3]] and documents.dtype == torch.int32
    assert positions_in_documents(documents).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    assert document_id_bytes(1, 8192) == 32768  # vs 64 MiB for one s x s boolean


def test_packing_of_batch_cuts_the_load_balanced_chunks() -> None:
    """Issue 40: ``Packing.of_batch`` (the training step's path) cutting the positions into
    contiguous pieces under context parallelism went unnoticed (the tests cut them with their
    own helper). CP rank r holds chunks r and 2c - 1 - r of 2c; the expected positions are
    written by hand."""
    from types import SimpleNamespace

    expected = {
        2: [[100, 101, 106, 107], [102, 103, 104, 105]],  # s = 8: chunks of 2
        4: [[100, 101, 114, 115], [102, 103, 112, 113], [104, 105, 110, 111],
            [106, 107, 108, 109]],  # s = 16
    }  # fmt: skip
    for c, ranks in expected.items():
        positions = torch.arange(100, 100 + 4 * c).repeat(2, 1)  # [B = 2, s]
        for r, want in enumerate(ranks):
            state = SimpleNamespace(context_parallel_size=c, context_parallel_rank=r)
            got = Packing.of_batch({"positions": positions}, state)  # type: ignore[arg-type]
            assert got.positions is not None and got.positions.tolist() == [want, want], (
                f"c={c} CP rank {r}: Packing.of_batch gives positions "
                f"{None if got.positions is None else got.positions[0].tolist()}, the "
                f"load-balanced chunks {r} and {2 * c - 1 - r} hold {want} (cut contiguously?)"
            )
            assert got.reduction == "mean", f"no loss mask: reduction {got.reduction!r}"
    masked = Packing.of_batch({"loss_mask": torch.ones(1, 4)}, state)  # type: ignore[arg-type]
    assert masked.reduction == "sum", f"a loss mask: reduction {masked.reduction!r}, not 'sum'"


def test_packed_documents_one_process_quick() -> None:
    assert len(_check(ParallelState.single(), False, QUICK)) == len(QUICK)


@pytest.mark.slow
def test_packed_documents_one_process() -> None:
    """Every architecture, backend and preset in one process."""
    assert len(_check(ParallelState.single(), False, GRID)) == len(GRID)


def _worker(rank: int, world_size: int, grid: list) -> list[str]:
    checked = []
    if world_size == 2:
        state = ParallelState.from_process_group(tensor_parallel_size=2)
        checked += _check(state, True, grid)
        state = ParallelState.from_process_group(context_parallel_size=2)
        checked += _check(state, False, grid)
        state = ParallelState.from_process_group(pipeline_parallel_size=2)
        checked += _check_pipeline(state, grid)
    else:
        state = ParallelState.from_process_group(tensor_parallel_size=2, context_parallel_size=2)
        checked += _check(state, True, grid)
        state = ParallelState.from_process_group(pipeline_parallel_size=2, context_parallel_size=2)
        checked += _check_pipeline(state, grid)
    return checked


def test_packed_documents_t2_sp_c2_p2_quick() -> None:
    """Llama (RoPE positions restarting), sdpa, full recompute at t = 2 + SP, c = 2, p = 2."""
    results = run_distributed(_worker, 2, QUICK[1:])
    assert all(len(r) == 3 for r in results)


@pytest.mark.slow
def test_packed_documents_t2_sp_c2_p2() -> None:
    """Every architecture, backend and preset at t = 2 + SP, c = 2, p = 2."""
    results = run_distributed(_worker, 2, GRID)
    assert all(len(r) == 3 * len(GRID) for r in results)


@pytest.mark.slow
def test_packed_documents_t2_sp_times_c2_and_p2_times_c2() -> None:
    results = run_distributed(_worker, 4, GRID)
    assert all(len(r) == 2 * len(GRID) for r in results)
