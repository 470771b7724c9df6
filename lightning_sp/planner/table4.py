"""The paper's Table 4 as a calibration: the GEMM efficiency its software reached on Selene.

Table 4 of the paper is a measurement: forward and backward milliseconds of one transformer
layer of the 22B model (``t = 8``, micro-batch 4, ``s = 2048``, ``h = 6144``, 64 heads, math
attention) on the A100s of Selene, under five settings (no recompute, SP, full recompute,
selective, SP + selective). The ``a100-80gb`` preset's GEMM efficiency is the best GEMM any
shape reaches with 2023's cuBLAS (85.9%, [MAMF] in :mod:`lightning_sp.planner.presets`); the
paper's layers ran slower than that. This module finds the one ``gemm_efficiency`` under which
the step-time model (:func:`lightning_sp.planner.layertime.layer_time`) reproduces those ten
times best (least squares of the relative errors), every other figure of the preset kept.

The result is the ``selene`` preset (:data:`lightning_sp.planner.presets.SELENE`; ``python -m
lightning_sp.planner.table4`` prints the fit beside the preset's figure, and
``tests/test_table4.py`` holds them equal). It is fitted to Table 4 only; Table 5 (whole
iterations of the 22B, 175B, 530B and 1T models) is the check. The 22B row of Table 5 shares
Table 4's layer, so only the other three models test it out of sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from lightning_sp.model.config import GPTConfig
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.layertime import layer_time
from lightning_sp.planner.presets import A100_80GB, SELENE

TABLE4_CONFIG = GPTConfig(
    vocab_size=51200, seq_length=2048, hidden_size=6144, num_layers=48, num_heads=64,
    attention="math",
)  # fmt: skip
"""The 22B model of Table 3, with the paper's attention (``s x s`` scores kept)."""

TABLE4_TENSOR_PARALLEL, TABLE4_MICRO_BATCH = 8, 4
"""Table 3's 22B layout: one node, ``t = 8``, micro-batch 4."""


@dataclass(frozen=True)
class LayerMeasurement:
    """One row of Table 4: one layer's forward and backward (recompute included) time."""

    sequence_parallel: bool
    recompute: str
    forward_ms: float
    backward_ms: float


TABLE4 = (
    LayerMeasurement(False, "none", 7.7, 11.9),
    LayerMeasurement(True, "none", 7.2, 11.8),
    LayerMeasurement(False, "full", 7.7, 19.5),
    LayerMeasurement(False, "selective", 7.7, 13.2),
    LayerMeasurement(True, "selective", 7.2, 13.1),
)
"""The paper's Table 4 (22B, one layer, A100), in its row order."""


def predicted_ms(cluster: Cluster, row: LayerMeasurement) -> tuple[float, float]:
    """``(forward, backward)`` milliseconds the step-time model gives ``row`` on ``cluster``
    (backward includes the recompute the row's policy replays)."""
    config = dataclasses.replace(TABLE4_CONFIG, sequence_parallel=row.sequence_parallel)
    layout = ParallelConfig(tensor_parallel_size=TABLE4_TENSOR_PARALLEL)
    layer = layer_time(config.activation_shape(layout, TABLE4_MICRO_BATCH), cluster)
    forward = sum(layer.forward.values())
    backward = sum(layer.backward.values()) + layer.recompute_seconds(row.recompute, "math")
    return forward * 1e3, backward * 1e3


def table4_error(cluster: Cluster) -> float:
    """Sum over Table 4's ten times of the squared relative error of the model's."""
    total = 0.0
    for row in TABLE4:
        forward, backward = predicted_ms(cluster, row)
        total += (forward / row.forward_ms - 1) ** 2 + (backward / row.backward_ms - 1) ** 2
    return total


def fit_gemm_efficiency(base: Cluster = A100_80GB, tolerance: float = 1e-5) -> float:
    """The ``gemm_efficiency`` in (0.2, 1] that minimises :func:`table4_error` with every
    other figure of ``base`` kept (golden-section search; the error is unimodal in it)."""

    def error(efficiency: float) -> float:
        return table4_error(dataclasses.replace(base, gemm_efficiency=efficiency))

    ratio = (math.sqrt(5) - 1) / 2
    lo, hi = 0.2, 1.0
    x1, x2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    e1, e2 = error(x1), error(x2)
    while hi - lo > tolerance:
        if e1 <= e2:
            hi, x2, e2 = x2, x1, e1
            x1 = hi - ratio * (hi - lo)
            e1 = error(x1)
        else:
            lo, x1, e1 = x1, x2, e2
            x2 = lo + ratio * (hi - lo)
            e2 = error(x2)
    return round((lo + hi) / 2, 4)


def main(argv: list[str] | None = None) -> None:
    """Print the fitted efficiency, the ``selene`` preset's, and Table 4 beside the model."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    fitted = fit_gemm_efficiency()
    cluster = dataclasses.replace(SELENE, gemm_efficiency=fitted)
    for row in TABLE4:
        forward, backward = predicted_ms(cluster, row)
        print(
            f"SP={row.sequence_parallel!s:5} {row.recompute:9}  forward {forward:5.2f} ms "
            f"(paper {row.forward_ms})  backward {backward:5.2f} ms (paper {row.backward_ms})"
        )
    print(f"fitted gemm_efficiency {fitted} (the selene preset has {SELENE.gemm_efficiency})")


if __name__ == "__main__":
    main()
