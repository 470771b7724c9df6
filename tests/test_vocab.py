"""The padded vocabulary: padded logits get probability 0 and padded rows no gradient, at every t.

The embedding (and tied output layer) is padded to a multiple of ``128·t`` rows, so the padding
differs per t: vocab 300 pads to 384 at t=1 and 512 at t=2 and t=4, where rank 3's whole shard
(rows 384–511) is padding. A comparison with the t=1 reference cannot see padding that both
share, so these tests check it against ``torch.nn.functional.cross_entropy`` over the true
vocabulary and assert the padded rows' gradients are exactly zero. t=1, 2 and 4 run on four
gloo ranks (t=1 and t=2 as data-parallel replicas); t=1 also runs in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_sp import GPT, ParallelState
from lightning_sp.parallel.vocab import vocab_parallel_cross_entropy
from lightning_sp.testing.spawn import run_distributed

from models import (
    VOCAB_PARAMETER,
    assert_matches_reference,
    batch,
    loss_and_grads,
    reference_model,
    tiny_config,
)

# padded rows of each TP rank's shard of the embedding, by hand: vocab 300, padded to 384 at
# t=1 (rows 300–383) and to 512 at t=2 (rank 1: 300–511) and t=4 (rank 2: 300–383, rank 3:
# 384–511, all of it)
PADDED_ROWS = {1: [84], 2: [0, 212], 4: [0, 0, 84, 128]}


def _check_cross_entropy(state: ParallelState) -> None:
    """Vocabulary-parallel cross entropy equals torch's over the true vocabulary, and the
    padded columns of the local logits get zero gradient, i.e. probability 0."""
    config, t = tiny_config(), state.tensor_parallel_size
    padded, v = config.padded_vocab_size(t), config.vocab_size
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 2, padded, generator=generator, dtype=torch.float64)  # [s, b, v_p]
    target = torch.randint(0, v, (8, 2), generator=generator)
    local_size = padded // t
    start = state.tensor_parallel_rank * local_size
    local = logits[..., start : start + local_size].clone().requires_grad_()  # [s, b, v_p/t]
    loss = vocab_parallel_cross_entropy(local, target, start, v, state.tp_group).mean()
    loss.backward()
    expected = F.cross_entropy(logits[..., :v].reshape(-1, v), target.reshape(-1))
    case = f"t={t} rank {state.tensor_parallel_rank}"
    padded_grad = local.grad[..., max(0, v - start) :]
    assert torch.count_nonzero(padded_grad) == 0, (
        f"{case}: padded logit columns {max(v, start)}..{start + local_size - 1} got "
        f"probability (max gradient {padded_grad.abs().max().item():.3e})"
    )
    torch.testing.assert_close(
        loss,
        expected,
        rtol=1e-12,
        atol=0,
        msg=f"{case}: loss differs from torch's over the true vocabulary",
    )


def _check_model(state: ParallelState, reference: GPT) -> None:
    """The model's padded rows get exactly zero gradient; every other element is compared."""
    config, t, rank = tiny_config(), state.tensor_parallel_size, state.tensor_parallel_rank
    model = GPT(config, state, dtype=torch.float64)
    loss_and_grads(model, *batch(config))
    compared = assert_matches_reference(model, reference, 1e-10, f"t={t} rank {rank}")
    padded = PADDED_ROWS[t][rank]
    assert compared.padding_rows == padded, f"t={t} rank {rank}: {compared}"
    total = sum(p.numel() for p in model.parameters())
    assert compared.elements == total - padded * config.hidden_size, f"t={t}: {compared}"
    all_padding = padded == model.word_embeddings.weight.shape[0]
    assert compared.padding_only == ([VOCAB_PARAMETER] if all_padding else []), compared


def _worker(rank: int, world_size: int) -> None:
    reference = reference_model(tiny_config())
    loss_and_grads(reference, *batch(tiny_config()))
    for t in (1, 2, 4):
        state = ParallelState.from_process_group(tensor_parallel_size=t)
        _check_cross_entropy(state)
        _check_model(state, reference)


@pytest.mark.slow
def test_padding_gets_no_probability_at_t_1_2_4() -> None:
    run_distributed(_worker, 4)


def test_padding_gets_no_probability_in_one_process() -> None:
    state = ParallelState.single()
    _check_cross_entropy(state)
    config = tiny_config()
    reference = reference_model(config)
    ids, labels = batch(config)
    loss = loss_and_grads(reference, ids, labels)
    # the same loss from torch's cross entropy over the true vocabulary's logits
    with torch.no_grad():
        hidden = reference.final_norm(reference.forward_layers(reference.embed(ids)))  # [s, b, h]
        logits = hidden @ reference.word_embeddings.weight[: config.vocab_size].t()
        expected = F.cross_entropy(logits.reshape(-1, config.vocab_size), labels.t().reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    _check_model(state, reference)


def test_comparison_fails_on_a_padded_row_with_gradient() -> None:
    config = tiny_config()
    reference = reference_model(config)
    loss_and_grads(reference, *batch(config))
    model = reference_model(config)
    loss_and_grads(model, *batch(config))
    model.word_embeddings.weight.grad[config.vocab_size + 5, 0] = 1e-30
    with pytest.raises(AssertionError, match=r"padded vocabulary rows 300\.\.383"):
        assert_matches_reference(model, reference, 1e-10)
