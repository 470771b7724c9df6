"""Does the planner order layouts as measurements order them? Spearman's rank correlation of
the predicted times of a published set of layouts (one model, one cluster) against the
published times, and where the published fastest lands in the predicted order.

Users act on the order ``estimate --search`` prints, not on its absolute times (Mist and
Proteus judge a search by the speed of the layout it picks, or by how well it preserves the
measured order), so the order is checked on its own. The published sets with fully stated
layouts of one model on one cluster (:data:`PUBLISHED_SETS`):

* the paper's Table 4: one 22B layer on Selene under five settings (no recompute, SP, full
  recompute, selective, SP + selective), forward + backward milliseconds;
* the paper's Table 5: each model's two settings (full recompute, SP + selective), whole
  iterations (:mod:`lightning_sp.planner.published`).

Across models (Megatron-LM's H100 weak-scaling table, one cluster, nine sizes) the order of
seconds per model FLOP (the inverse of MFU) is compared the same way (:func:`runs_comparison`
with ``per_flop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.published import PublishedRun, predict
from lightning_sp.planner.table4 import TABLE4, predicted_ms


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``, smallest first; ties share their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho of two equally long sequences: Pearson's correlation of their ranks
    (ties at mean rank); 1 = the same order, -1 = reversed."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(
            f"spearman needs two sequences of equal length >= 2, got {len(a)}, {len(b)}"
        )
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if not va or not vb:
        raise ValueError("spearman of a constant sequence is undefined")
    return cov / (va * vb) ** 0.5


@dataclass(frozen=True)
class RankComparison:
    """A published set of layouts against the planner's prediction of each."""

    names: tuple[str, ...]
    published: tuple[float, ...]
    """Published times (seconds or milliseconds, as the set gives them)."""
    predicted: tuple[float, ...]
    """Predicted times, in the same unit."""

    @property
    def rho(self) -> float:
        """Spearman's rho of predicted against published."""
        return spearman(self.predicted, self.published)

    @property
    def published_best(self) -> str:
        """The published fastest."""
        return self.names[min(range(len(self.names)), key=lambda i: self.published[i])]

    @property
    def best_lands(self) -> float:
        """The rank of the published fastest in the predicted order (1 = predicted fastest
        too; ties at mean rank)."""
        return ranks(self.predicted)[self.names.index(self.published_best)]

    @property
    def top_margin(self) -> float:
        """How much faster the predicted first is than the predicted second (a fraction)."""
        first, second = sorted(self.predicted)[:2]
        return second / first - 1

    def describe(self) -> str:
        return (
            f"rho {self.rho:+.2f}; the published fastest ({self.published_best}) lands "
            f"{self.best_lands:g} of {len(self.names)} in the prediction; predicted top two "
            f"{self.top_margin:.1%} apart"
        )


def table4_comparison(cluster: Cluster) -> RankComparison:
    """The paper's Table 4 (one 22B layer, five settings) on ``cluster``: forward + backward
    milliseconds, published and predicted."""
    names = tuple(f"{'SP' if r.sequence_parallel else 'TP'} + {r.recompute}" for r in TABLE4)
    published = tuple(r.forward_ms + r.backward_ms for r in TABLE4)
    predicted = tuple(sum(predicted_ms(cluster, r)) for r in TABLE4)
    return RankComparison(names, published, predicted)


def runs_comparison(
    runs: Sequence[PublishedRun], preset: str | None = None, per_flop: bool = False
) -> RankComparison:
    """Published rows against their predictions on ``preset`` (default each row's): whole
    iterations in seconds, or with ``per_flop`` GPU-seconds per model FLOP (the inverse of the
    achieved FLOP rate per GPU, to order runs of different models and sizes)."""
    names, published, predicted = [], [], []
    for run in runs:
        scale = run.layout.world_size / run.model_flops() if per_flop else 1.0
        names.append(run.name)
        published.append(run.published_seconds() * scale)
        predicted.append(predict(run, preset).iteration_seconds * scale)
    return RankComparison(tuple(names), tuple(published), tuple(predicted))
