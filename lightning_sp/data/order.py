"""The order in which an epoch visits samples: seeded pseudo-random permutations computed per
index (nothing of size N is built), and a weighted blend of several sample sets.

A :class:`Permutation` of ``[0, n)`` is a Feistel network over the smallest even-bit domain
holding ``n``, walked until it lands below ``n`` (cycle walking): a bijection for every seed,
evaluated in O(1) memory per index, so start-up time and memory do not grow with the corpus.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_BLEND_STREAM = 0xB1E4D
"""Seed word of the permutation that interleaves blended sets (the sets' own use their index)."""


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A 64-bit mixing function (splitmix64 finalizer) of ``x ^ key``; wraps on overflow."""
    x = x ^ key
    x = x * _M1
    x ^= x >> np.uint64(31)
    x = x * _M2
    x ^= x >> np.uint64(29)
    return x


class Permutation:
    """A seeded bijection of ``[0, n)``, evaluated on arrays of indices.

    Args:
        n: Size of the permuted range (>= 1).
        seed: Words seeding the round keys (e.g. ``(seed, set, epoch)``).
        rounds: Feistel rounds.
    """

    def __init__(self, n: int, seed: tuple[int, ...], rounds: int = 6) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = np.random.SeedSequence([*seed]).generate_state(rounds, dtype=np.uint64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.mask)
        return (left << self.half) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        """The images of ``index`` (int array of values in ``[0, n)``), int64."""
        out = self._rounds(np.asarray(index, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():  # cycle walking: at most a few rounds, the domain is < 4n
            out[outside] = self._rounds(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)


def quotas(counts: list[int], weights: list[float] | None) -> list[int]:
    """Samples each set contributes to one epoch.

    One set: all its samples. A blend: the epoch has as many samples as all sets together,
    shared by weight (largest remainder, so the quotas sum to it exactly and each differs from
    ``weight * total`` by less than 1).
    """
    if weights is None or len(counts) == 1:
        return list(counts)
    total = sum(counts)
    norm = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    exact = norm * total
    base = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - base), kind="stable")
    base[order[: total - int(base.sum())]] += 1
    return base.tolist()


class SampleOrder:
    """Position ``j`` of epoch ``e`` -> global sample index, deterministic in ``seed``.

    Set ``k`` owns ``quota[k]`` positions of every epoch (interleaved by a seeded permutation
    when blending); its ``u``-th use, counted over all epochs, is its sample
    ``perm_{k, u // n_k}(u mod n_k)``: every sample of a set is used once before any repeats,
    and each of its passes is freshly shuffled. Global index = set offset + sample.

    Args:
        counts: Samples of each set (each >= 1).
        weights: Blend weights (> 0), one per set; ``None`` for a single set.
        seed: The run's seed.
    """

    def __init__(self, counts: list[int], weights: list[float] | None, seed: int) -> None:
        self.counts = list(counts)
        self.quotas = quotas(counts, weights)
        self.starts = np.cumsum([0, *self.quotas], dtype=np.int64)
        self.offsets = np.cumsum([0, *self.counts], dtype=np.int64)
        self.seed = seed

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __call__(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Global sample indices at ``positions`` (int array in ``[0, len)``) of ``epoch``."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(self.counts) > 1:
            positions = Permutation(len(self), (self.seed, _BLEND_STREAM, epoch))(positions)
        sets = np.searchsorted(self.starts, positions, side="right") - 1
        uses = epoch * np.asarray(self.quotas, dtype=np.int64)[sets] + (
            positions - self.starts[sets]
        )
        out = np.empty_like(positions)
        for k in np.unique(sets):
            mine = sets == k
            n = self.counts[k]
            passes = uses[mine] // n
            picked = np.empty_like(passes)
            for p in np.unique(passes):
                now = passes == p
                perm = Permutation(n, (self.seed, int(k), int(p)))
                picked[now] = perm(uses[mine][now] % n)
            out[mine] = picked + self.offsets[k]
        return out
