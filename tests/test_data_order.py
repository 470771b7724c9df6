"""The training order: per-index permutations, blends (proportions within a stated bound),
data-parallel shards and the resumable sampler's state."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from lightning_sp.data import Permutation, ResumableSampler, SampleOrder, parse_blend
from lightning_sp.data.order import quotas
from lightning_sp.errors import ConfigError


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_permutation_is_a_seeded_bijection(n: int) -> None:
    image = Permutation(n, (7, 0))(np.arange(n))
    assert sorted(image.tolist()) == list(range(n)), (
        f"Permutation({n}) maps [0, {n}) onto {sorted(image.tolist())[:8]}...: not a "
        "bijection of [0, n)"
    )
    assert np.array_equal(image, Permutation(n, (7, 0))(np.arange(n)))
    if n >= 16:
        assert not np.array_equal(image, Permutation(n, (8, 0))(np.arange(n)))
        assert not np.array_equal(image, np.arange(n))


def test_single_set_epochs_are_fresh_permutations() -> None:
    order = SampleOrder([500], None, seed=1)
    first, second = order(0, np.arange(500)), order(1, np.arange(500))
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(500))
    assert not np.array_equal(first, second), (
        "epochs 0 and 1 visit the samples in the same order: a pass not freshly shuffled"
    )
    # any slice of positions gives the same answer as the whole (computed per index)
    assert np.array_equal(order(0, np.arange(100, 200)), first[100:200])


def test_blend_proportions_within_the_stated_bound() -> None:
    """Set k owns quota_k = weight_k * N positions of an N-position epoch (|error| < 1), and
    positions are interleaved by a seeded permutation: over the first m positions the count of
    set k is hypergeometric, with standard deviation <= sqrt(m w (1 - w)). We assert it within
    5 standard deviations (+1 for the quota's rounding) for several prefixes and seeds."""
    counts, weights = [300, 5000, 1200], [0.5, 0.3, 0.2]
    for seed in range(3):
        order = SampleOrder(counts, weights, seed)
        n = len(order)
        assert n == sum(counts) and sum(order.quotas) == n
        norm = np.asarray(weights) / sum(weights)
        assert all(abs(q - w * n) < 1 for q, w in zip(order.quotas, norm, strict=True))
        picked = order(0, np.arange(n))
        sets = np.searchsorted(order.offsets, picked, side="right") - 1
        assert np.bincount(sets).tolist() == order.quotas  # exact over the epoch
        for m in (200, 1000, 4000):
            got = np.bincount(sets[:m], minlength=3)
            bound = 5 * np.sqrt(m * norm * (1 - norm)) + 1
            assert np.all(np.abs(got - m * norm) <= bound), (seed, m, got)
        # the small set is up-sampled: every sample used floor or ceil(quota / count) times
        uses = np.bincount(picked[sets == 0], minlength=300)
        q = order.quotas[0]
        assert set(uses.tolist()) <= {q // 300, math.ceil(q / 300)}
    a, b = SampleOrder(counts, weights, 1), SampleOrder(counts, weights, 2)
    assert np.array_equal(a(3, np.arange(50)), SampleOrder(counts, weights, 1)(3, np.arange(50)))
    assert not np.array_equal(a(3, np.arange(50)), b(3, np.arange(50)))


def test_blend_set_passes_never_repeat_before_exhausting() -> None:
    """A set's uses continue across epochs: over two epochs every sample of the up-sampled
    set is used floor or ceil(2 quota / count) times (whole passes, no sample favoured)."""
    order = SampleOrder([40, 1000], [0.9, 0.1], seed=5)
    uses = np.concatenate([order(e, np.arange(len(order))) for e in range(2)])
    mine = uses[uses < 40]
    total = 2 * order.quotas[0]
    assert len(mine) == total
    assert set(np.bincount(mine, minlength=40).tolist()) <= {total // 40, math.ceil(total / 40)}


def test_quotas() -> None:
    assert quotas([10, 20], None) == [10, 20]
    assert quotas([7], [3.0]) == [7]
    assert quotas([10, 10, 10], [1, 1, 1]) == [10, 10, 10]
    assert sum(quotas([3, 5, 11], [0.33, 0.33, 0.34])) == 19
    # largest remainder, by hand: 19 x (0.33, 0.33, 0.34) = (6.27, 6.27, 6.46); 20 x (0.26,
    # 0.74) = (5.2, 14.8); 10 x (0.45, 0.37, 0.18) = (4.5, 3.7, 1.8)
    for counts, weights, want in (
        ([3, 5, 11], [0.33, 0.33, 0.34], [6, 6, 7]),
        ([10, 10], [0.26, 0.74], [5, 15]),
        ([4, 4, 2], [0.45, 0.37, 0.18], [4, 4, 2]),
    ):
        got = quotas(counts, weights)
        assert got == want, (
            f"quotas({counts}, {weights}) = {got}, by hand {want}: the samples left after "
            "rounding down go to the largest remainders"
        )


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ([0, "/a"], r"blend\[0\]=0 is not a weight > 0"),
        ([0.5, "/a", -0.5, "/b"], r"blend\[2\]=-0\.5 is not a weight > 0"),
        (["x", "/a"], r"blend\[0\]='x' is not a weight > 0"),
        ([0.5, "/a", 0.5], r"is not a list of weight, directory pairs"),
        ([0.5, ""], r"blend\[1\]='' is not a prepared directory"),
    ],
)
def test_bad_blend_is_one_line(spec: list, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        parse_blend(spec)
    assert "\n" not in str(info.value)


def test_blend_parses_megatron_style() -> None:
    blend = parse_blend([0.3, "/data/a", "0.7", "/data/b"])
    assert blend.directories == ("/data/a", "/data/b") and blend.weights == (0.3, 0.7)


def _sampler(order: SampleOrder, replicas: int, rank: int) -> ResumableSampler:
    return ResumableSampler(range(sum(order.counts)), order, replicas, rank)  # type: ignore[arg-type]


def test_data_parallel_shards_are_disjoint_and_cover_the_epoch() -> None:
    order = SampleOrder([101], None, seed=3)
    shards = [list(_sampler(order, 2, r)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 50
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(order(0, np.arange(100)).tolist())


def test_sampler_state_resumes_mid_epoch_exactly() -> None:
    order = SampleOrder([60, 90], [0.4, 0.6], seed=9)
    for replicas in (1, 2):
        for rank in range(replicas):
            straight = _sampler(order, replicas, rank)
            straight.set_epoch(2)
            whole = list(straight)
            straight.advance(10)  # 10 samples trained on per replica
            state = straight.state_dict()
            assert state == {"epoch": 2, "consumed_samples": 10 * replicas,
                             "epoch_samples": 150, "seed": 9}, (
                f"10 samples trained on by each of {replicas} replicas: the state is {state}; "
                "its consumed_samples counts every replica's"
            )  # fmt: skip
            state = pickle.loads(pickle.dumps(state))  # a plain dict of ints
            resumed = _sampler(order, replicas, rank)
            resumed.load_state_dict(state)
            resumed.set_epoch(2)
            assert list(resumed) == whole[10:]
            assert list(resumed) == whole, (  # the next pass over epoch 2 is whole again
                "the pass after the resumed one skips samples again: the resume applied twice"
            )
            resumed.set_epoch(3)
            assert list(resumed) != whole
    other = _sampler(SampleOrder([60, 91], [0.4, 0.6], seed=9), 1, 0)
    with pytest.raises(ConfigError, match="the checkpoint's data order"):
        other.load_state_dict(state)


def test_a_resumed_sampler_counts_every_replicas_samples() -> None:
    """Resumed mid-epoch, a sampler goes on counting the samples of all replicas: its next
    state (the next checkpoint) is the resumed count plus what it trained on since, and a
    second resume continues where the first left off. The state holds on another
    data-parallel size: the positions of the epoch's order each replica reads are written out
    by hand (20 samples consumed over 2 replicas; 150 per epoch)."""
    order = SampleOrder([60, 90], [0.4, 0.6], seed=9)
    for rank in range(2):
        whole = list(_sampler(order, 2, rank))  # epoch 0
        first = _sampler(order, 2, rank)
        first.load_state_dict({"epoch": 0, "consumed_samples": 20, "epoch_samples": 150,
                               "seed": 9})  # fmt: skip
        assert list(first) == whole[10:], f"rank {rank}: the resume does not skip 10 samples"
        first.load_state_dict({"epoch": 0, "consumed_samples": 20, "epoch_samples": 150,
                               "seed": 9})  # fmt: skip
        next(iter(first))  # the loader starts the resumed epoch
        first.advance(5)
        state = first.state_dict()
        assert state["consumed_samples"] == 30, (
            f"rank {rank}: resumed at 20 samples of 2 replicas, 5 more each: the next state "
            f"says {state['consumed_samples']} consumed samples, not 30 (the resumed count "
            "not counted over every replica: a second resume repeats samples)"
        )
        second = _sampler(order, 2, rank)
        second.load_state_dict(state)
        assert list(second) == whole[15:], f"rank {rank}: the second resume does not continue"
    state = {"epoch": 0, "consumed_samples": 20, "epoch_samples": 150, "seed": 9}
    for replicas, positions in (
        (1, [list(range(20, 150))]),
        (4, [[r + 4 * k for k in range(5, 37)] for r in range(4)]),
    ):
        for rank, want in enumerate(positions):
            resumed = _sampler(order, replicas, rank)
            resumed.load_state_dict(state)
            got = list(resumed)
            assert got == order(0, np.array(want)).tolist(), (
                f"saved after 20 samples on 2 replicas, resumed on {replicas} replicas: rank "
                f"{rank} does not read positions {want[0]}, {want[1]}, ... of the epoch's order"
            )


def test_a_resume_state_applies_to_its_own_epoch_only() -> None:
    """A state saved mid-epoch 2 skips the consumed samples of epoch 2 only: a loader that
    starts epoch 3 (a checkpoint taken as epoch 2 ended) reads epoch 3 whole."""
    order = SampleOrder([60, 90], [0.4, 0.6], seed=9)
    fresh = _sampler(order, 1, 0)
    fresh.set_epoch(3)
    whole = list(fresh)
    resumed = _sampler(order, 1, 0)
    resumed.load_state_dict({"epoch": 2, "consumed_samples": 10, "epoch_samples": 150,
                             "seed": 9})  # fmt: skip
    resumed.set_epoch(3)
    got = list(resumed)
    assert got == whole, (
        f"resumed from a state of epoch 2 (10 samples consumed), epoch 3 reads {len(got)} "
        f"samples, not its {len(whole)}: the skip applied to another epoch"
    )
