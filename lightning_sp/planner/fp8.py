"""FP8 GEMMs priced on a :class:`~lightning_sp.planner.cluster.Cluster`: a run with ``fp8``
(:mod:`lightning_sp.model.fp8`) runs its layers' linears (every GEMM of a layer but the
attention core's and those a part keeps in high precision, :attr:`~lightning_sp.model.parts.
base.Gemm.high_precision`: a mixture of experts' router) in float8, forward and both backward
GEMMs; a mixture of experts' grouped expert GEMMs are a batch of ``E/e`` float8 GEMMs (each
expert its own float8 linear, its operands cast per expert: the same elements).

A float8 GEMM is the roofline of :func:`~lightning_sp.planner.kernels.gemm_seconds` at the
cluster's dense FP8 peak (``fp8_peak_flops``, a datasheet figure) times the same best-shape
fraction (``gemm_efficiency``) and wave quantization as BF16 (no FP8 figure of the fraction
was checked: an assumption, stated), its operands 1 byte an element and its output 2; plus the
casts of its two operands, each element read twice (the amax, then the scaled cast) in 2
bytes and written once in 1: 5 bytes an element, at the achievable memory rate (torchao's
eager casts; a compiler fusing the amax into the producer moves less). A calibration table's
measured GEMM times are BF16's and are not used for float8 GEMMs. Nothing here is fitted to a
published step time.
"""

from __future__ import annotations

from lightning_sp.errors import ConfigError
from lightning_sp.model.parts.base import Gemm
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.kernels import memory_seconds, wave_efficiency

CAST_BYTES = 5.0
"""Bytes moved per operand element by its float8 cast: read for the amax (2), read for the
cast (2), the float8 copy written (1)."""


def check_fp8_cluster(cluster: Cluster, recipe: str | None) -> None:
    """:class:`ConfigError` (one line) when an FP8 run is priced on a cluster without FP8
    GEMMs (``fp8_peak_flops`` unset: an A100)."""
    if recipe is not None and cluster.fp8_peak_flops is None:
        raise ConfigError(
            f"fp8.recipe={recipe!r} on cluster {cluster.name}: it has no FP8 GEMMs "
            "(fp8_peak_flops unset); price it on h100-80gb, h200 or a cluster file with "
            "fp8_peak_flops, or set fp8: null"
        )


def fp8_gemm_seconds(cluster: Cluster, gemm: Gemm) -> float:
    """Seconds of one float8 GEMM and its operands' casts (see the module docstring)."""
    peak = cluster.fp8_peak_flops
    assert peak is not None, "check_fp8_cluster first"
    rate = peak * cluster.gemm_efficiency * wave_efficiency(cluster, gemm.m, gemm.n, gemm.batch)
    m, n, k, batch = gemm.m, gemm.n, gemm.k, gemm.batch
    operands = batch * (m * k + k * n)
    moved = operands + 2.0 * batch * m * n  # float8 operands, a 2-byte output
    gemm_time = max(gemm.flops / rate, memory_seconds(cluster, moved))
    return gemm_time + memory_seconds(cluster, CAST_BYTES * operands)
