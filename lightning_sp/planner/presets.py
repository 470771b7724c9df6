"""The named clusters (presets) a step-time estimate is made for, every constant with its
source, and how a ``--cluster`` (a preset's name or a YAML file) becomes a
:class:`~lightning_sp.planner.cluster.Cluster`.

Every constant of the presets is a vendor datasheet figure, a published measurement or a
kernel measurement of this project's own on a lent GPU ([H200-SDPA]), with its source beside
it. None is fitted to the paper's Table 5 (or to any step time): the step-time model
(:mod:`lightning_sp.planner.steptime`) takes them as they are.

Sources (quoted by the comments below):

* [A100-DS] NVIDIA A100 Tensor Core GPU datasheet (2021): SXM4 80GB, 312 TFLOP/s dense BF16
  Tensor Core, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (both directions together).
* [A100-WP] NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs; NVLink 3,
  12 links x 50 GB/s = 600 GB/s total, 300 GB/s each way.
* [DGXA100] NVIDIA DGX A100 System Architecture whitepaper / datasheet: 8 A100 per node on 6
  NVSwitches; 8 single-port Mellanox ConnectX-6 HDR 200 Gb/s InfiniBand adapters for the
  compute fabric, one per GPU (25 GB/s each way per GPU). Selene, the paper's machine, is a
  DGX SuperPOD of DGX A100 nodes.
* [H100-DS] NVIDIA H100 Tensor Core GPU datasheet (2022): SXM5 80GB, 989 TFLOP/s dense BF16
  (1,979 with sparsity), 1,979 TFLOP/s dense FP8 (3,958 with sparsity), 80 GB HBM3 at
  3.35 TB/s, NVLink 900 GB/s (both directions).
* [H200-DS] NVIDIA H200 Tensor Core GPU datasheet (2024): SXM 141 GB HBM3e at 4.8 TB/s, the
  H100 SXM's compute (989 TFLOP/s dense BF16) and NVLink (900 GB/s both directions); DGX H200
  nodes have the DGX H100's eight ConnectX-7 400 Gb/s adapters, one per GPU.
* [H100-WP] NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 132 SMs (SXM5).
* [DGXH100] NVIDIA DGX H100 datasheet: 8 H100 per node on 4 NVSwitches; 8 ConnectX-7 NDR
  400 Gb/s InfiniBand adapters for the compute fabric, one per GPU (50 GB/s each way).
* [MAMF] S. Bekman, *Machine Learning Engineering*, "Maximum Achievable Matmul FLOPS
  comparison table" (github.com/stas00/ml-engineering, compute/accelerator/README.md),
  BF16 ``matmul`` over a brute-force shape search: A100 SXM 267.9 of 312 TFLOP/s (85.9%),
  H100 SXM 792.1 of 989 (80.1%). (This project measured 786 TFLOP/s on an H100, DESIGN.md.)
* [MMBG] NVIDIA, *Matrix Multiplication Background User's Guide* (DU-09799-001, 2023):
  cuBLAS computes a GEMM's output in tiles, one thread block per tile; 256x128 is its most
  efficient tile; tile and wave quantization (a last, partly idle wave of thread blocks over
  the SMs) set how much of the peak a GEMM shape can reach.
* [NCCL-A100] Bekman, ibid., network/README.md: ``nccl-tests`` all-reduce on an 8 x A100
  node reaches 235 GB/s bus bandwidth, about 80% of NVLink 3's 300 GB/s each way.
* [NCCL-H] Bekman, ibid., network/benchmarks (8 x H200, NVLink 4 / NVSwitch gen 3, the
  fabric of DGX H100): ring all-reduce bus bandwidth 365.6 GB/s of 450 (81%).
* [NET80] Bekman, ibid., network/README.md: a link measured at "about 80%" of its
  one-direction rate "is expected"; used for the InfiniBand fabrics (no per-fabric figure).
* [HBM-A100] NVIDIA developer forum, "Trouble to Reach Peak Bandwidth of A100" (2024): a
  read kernel measured at 1.80 of 2.04 TB/s (88%) on an A100 80GB SXM, with the best kernel
  in NVIDIA's GTC talk at about 90%. The H100 preset uses the same fraction (no H100 figure
  was checked).
* [T4] Korthikanti et al., the paper, Table 4: forward and backward milliseconds of one 22B
  layer on Selene under five settings. ``selene``'s GEMM efficiency is the one under which the
  step-time model reproduces those ten times best (least squares of the relative errors):
  ``python -m lightning_sp.planner.table4`` finds it, and ``tests/test_table4.py`` checks the
  figure below is what it finds. It is fitted to Table 4 only, never to Table 5.
* [FA2] T. Dao, *FlashAttention-2* (2023): forward + backward reaches 50-73% of the A100's
  peak (the low end is used). [FA3] J. Shah et al., *FlashAttention-3* (2024):
  FlashAttention-2 reaches 35% of the H100's peak (what the Hopper presets used before
  [H200-SDPA]).
* [H200-SDPA] This project's measurement on one H200 (the H100 SXM's SMs and BF16 peak, so it
  carries to the H100), torch 2.11's SDPA flash kernel, causal, d = 128:
  ``benchmarks/results/gpu/session3/step_profile.json``, torch.profiler kernel time of one
  forward + backward of our GPT at Megatron-LM's 1.7B shape (s = 4096, 24 layers, 16 heads,
  b = 1): 13.52 ms without attention dropout, 19.51 ms with 0.1 (1.443x); 13.52 ms for the 24
  layers' 5.77 TFLOP is 426.9 TFLOP/s, 43.2% of 989 (41.8% at s = 2048, b = 4). See
  docs/planner.md, "The rows still outside".

A cluster is a preset name (:data:`PRESETS`) or a YAML file of
:class:`~lightning_sp.planner.cluster.Cluster` fields (``base: a100-80gb`` starts from a
preset); a calibration file written by ``lightning-sp calibrate`` is such a YAML file with
measured efficiencies and a table of measured GEMM and attention times
(:class:`~lightning_sp.planner.cluster.Calibration`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from lightning_sp.errors import ConfigError
from lightning_sp.planner.cluster import Calibration, Cluster, MeasuredKernel
from lightning_sp.planner.execution import execution_from_dict

GB = 1e9


A100_80GB = Cluster(
    name="a100-80gb",
    peak_flops=312e12,  # [A100-DS] dense BF16 Tensor Core
    hbm_bytes=80 * GB,  # [A100-DS]
    hbm_bandwidth=2039 * GB,  # [A100-DS] HBM2e
    num_sms=108,  # [A100-WP]
    gpus_per_node=8,  # [DGXA100]
    nvlink_bandwidth=300 * GB,  # [A100-WP] 600 GB/s both ways
    network_bandwidth=25 * GB,  # [DGXA100] one HDR 200 Gb/s adapter per GPU
    gemm_efficiency=267.9 / 312,  # [MAMF]
    hbm_efficiency=1.80 / 2.04,  # [HBM-A100]
    nvlink_efficiency=235 / 300,  # [NCCL-A100]
    network_efficiency=0.80,  # [NET80]
    flash_attention_efficiency=0.50,  # [FA2]
    flash_attention_dropout_cost=1.0,  # unmeasured on A100: no published figure found
)
"""The paper's Selene: DGX A100 80GB nodes of 8, 8 x HDR InfiniBand per node."""

H100_80GB = Cluster(
    name="h100-80gb",
    peak_flops=989e12,  # [H100-DS] dense BF16
    fp8_peak_flops=1979e12,  # [H100-DS] dense FP8
    hbm_bytes=80 * GB,  # [H100-DS]
    hbm_bandwidth=3350 * GB,  # [H100-DS] HBM3
    num_sms=132,  # [H100-WP]
    gpus_per_node=8,  # [DGXH100]
    nvlink_bandwidth=450 * GB,  # [H100-DS] 900 GB/s both ways
    network_bandwidth=50 * GB,  # [DGXH100] one NDR 400 Gb/s adapter per GPU
    gemm_efficiency=792.1 / 989,  # [MAMF]
    hbm_efficiency=1.80 / 2.04,  # [HBM-A100], the same fraction
    nvlink_efficiency=365.6 / 450,  # [NCCL-H]
    network_efficiency=0.80,  # [NET80]
    flash_attention_efficiency=426.9 / 989,  # [H200-SDPA] no dropout, s = 4096
    flash_attention_dropout_cost=19.51 / 13.52,  # [H200-SDPA] dropout 0.1 over none
)
"""DGX H100 nodes of 8, 8 x NDR InfiniBand per node."""

SELENE = dataclasses.replace(A100_80GB, name="selene", gemm_efficiency=0.703)  # [T4]
"""The paper's Selene as its own Table 4 measured it: ``a100-80gb`` with the GEMM efficiency
of the paper's 2022 software (70.3% of peak) in place of the best-shape 85.9%."""

H200 = dataclasses.replace(H100_80GB, name="h200", hbm_bytes=141 * GB, hbm_bandwidth=4800 * GB)
"""DGX H200 nodes of 8: ``h100-80gb`` with the H200's memory, 141 GB at 4.8 TB/s [H200-DS]; the
efficiencies are the H100's (the same chip); the fused attention kernel's rate and dropout cost,
which both carry, were measured on an H200 ([H200-SDPA])."""

H100_REALISED = dataclasses.replace(
    H100_80GB,
    name="h100-realised",
    gemm_efficiency=H100_80GB.gemm_efficiency * SELENE.gemm_efficiency / A100_80GB.gemm_efficiency,
)
"""``h100-80gb`` with its best-shape GEMM rate scaled by what training GEMMs realised of the
best shape on A100 in the paper's Table 4: ``selene``'s 70.3% against ``a100-80gb``'s 85.9%
(a ratio of 0.818), so 65.6% of the H100's peak. No H100 run is fitted: the ratio is carried
from A100 to H100, an assumption a calibration (``lightning-sp calibrate``) on an H100
replaces."""

PRESETS: dict[str, Cluster] = {
    c.name: c for c in (A100_80GB, SELENE, H100_80GB, H100_REALISED, H200)
}
"""The named clusters of ``estimate --cluster``."""

DEFAULT_CLUSTER = A100_80GB
"""The paper's hardware."""


def cluster_from_dict(data: dict[str, Any], name: str) -> Cluster:
    """A :class:`Cluster` from YAML/JSON fields: ``base`` (a preset to start from), any
    :class:`Cluster` field, and ``calibration`` (``{device, kernels: [{kind, m, n, k, batch,
    seconds}]}``). :class:`ConfigError` (one line) on an unknown key or a bad value."""
    data = dict(data)
    base_name = data.pop("base", None)
    if base_name is not None and base_name not in PRESETS:
        raise ConfigError(
            f"cluster {name}: base={base_name!r} is not a preset; valid: {', '.join(PRESETS)}"
        )
    known = {f.name for f in dataclasses.fields(Cluster)} - {"name"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"cluster {name}: unknown key {unknown[0]!r}; valid: base, {', '.join(sorted(known))}"
        )
    if "calibration" in data:
        raw = data["calibration"] or {}
        if not isinstance(raw, dict) or not isinstance(raw.get("kernels", []), list):
            raise ConfigError(
                f"cluster {name}: calibration must be a mapping {{device, kernels: [...]}}"
            )
        kernels = []
        for i, k in enumerate(raw.get("kernels", [])):
            fields = [f.name for f in dataclasses.fields(MeasuredKernel)]
            if not isinstance(k, dict) or set(k) != set(fields):
                raise ConfigError(
                    f"cluster {name}: calibration.kernels[{i}]={k!r} must have exactly the keys "
                    f"{', '.join(fields)}"
                )
            kernels.append(MeasuredKernel(**k))
        data["calibration"] = Calibration(device=str(raw.get("device", "")), kernels=tuple(kernels))
    if "execution" in data:
        data["execution"] = execution_from_dict(data["execution"], f"cluster {name}")
    if "gemm_tile" in data:
        tile = data["gemm_tile"]
        data["gemm_tile"] = tuple(tile) if isinstance(tile, list | tuple) else tile
    for f in dataclasses.fields(Cluster):
        if f.name in data and f.type in ("float", "int"):  # YAML reads 50.0e9 as a string
            try:
                data[f.name] = (float if f.type == "float" else int)(data[f.name])
            except (TypeError, ValueError):
                raise ConfigError(
                    f"cluster {name}: {f.name}={data[f.name]!r} is not a number"
                ) from None
    if base_name is not None:
        cluster = dataclasses.replace(PRESETS[base_name], name=name, **data)
    else:
        missing = sorted(
            f.name
            for f in dataclasses.fields(Cluster)
            if f.name not in data and f.name != "name"
            and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )  # fmt: skip
        if missing:
            raise ConfigError(
                f"cluster {name}: missing {', '.join(missing)} (or give base: a100-80gb)"
            )
        cluster = Cluster(name=name, **data)
    cluster.validate()
    return cluster


def load_cluster(spec: str | Cluster | None) -> Cluster:
    """A preset by name, a :class:`Cluster` as is, ``None`` (the default, the paper's A100
    cluster), or a YAML file of :func:`cluster_from_dict` fields."""
    if spec is None:
        return DEFAULT_CLUSTER
    if isinstance(spec, Cluster):
        return spec
    if spec in PRESETS:
        return PRESETS[spec]
    if not os.path.isfile(spec):
        raise ConfigError(
            f"--cluster={spec!r} is neither a preset ({', '.join(PRESETS)}) nor a YAML file"
        )
    import yaml

    try:
        with open(spec) as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"--cluster={spec!r} cannot be read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "malformed"
        raise ConfigError(f"--cluster={spec!r} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--cluster={spec!r}: expected a mapping of cluster fields")
    return cluster_from_dict(data, os.path.basename(spec))
