"""The speed benchmarks' plumbing at tiny shapes (their numbers mean nothing here; no timing is
asserted): ``benchmarks.fit_overhead`` (its ``fit`` and ``compile`` sections),
``benchmarks.fp8_gpu``, ``benchmarks.step_profile``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import fit_overhead, fp8_gpu, step_profile


@pytest.mark.slow
def test_fit_overhead_smoke_counts_one_host_read_per_fit_step(tmp_path: Path) -> None:
    result = fit_overhead.main(["--smoke", "--out", str(tmp_path)])
    measured = result["measured"]
    reads = measured["host_reads_per_step"]
    assert reads["fit"] == 1 and reads["bare"] == 0, f"host reads per step: {reads}"
    for name in ("fit_over_bare", "bare_over_fwd_bwd", "fit_over_fwd_bwd"):
        median, low, high = measured[name]
        assert 0 < low <= median <= high and math.isfinite(high), (name, measured[name])
    assert json.loads((tmp_path / "fit_overhead.json").read_text())["meta"]["smoke"]


@pytest.mark.slow
def test_compile_cpu_smoke(tmp_path: Path) -> None:
    result = fit_overhead.main(["--only", "compile", "--smoke", "--out", str(tmp_path)])
    (case,) = result["cases"]
    median, low, high = case["compiled_over_eager"]
    assert 0 < low <= median <= high, case


@pytest.mark.slow
def test_fp8_gpu_plumbing_on_cpu_agrees_with_torchao(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    assert fp8_gpu.main(["--smoke", "--device", "cpu", "--no-compile", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fp8_gpu.json").read_text())["rows"]
    assert {r["variant"] for r in rows} >= {"bf16", "ours tensorwise", "torchao rowwise"}
    for row in rows:
        if row["variant"].startswith("ours"):
            assert row["max_rel_diff_vs_torchao"] <= 1e-3, row


def test_fp8_gpu_refuses_without_cuda_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert fp8_gpu.main([]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_step_profile_names_each_kernel_kind() -> None:
    """Kernel names of the forms cuBLAS, CUTLASS, PyTorch's flash kernels and ATen's
    elementwise kernels have (the last two as the H200 profile of ``session3`` printed them),
    and a CPU profile's op names, sorted by kind."""
    names = {
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>": "gemm",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>": "attention",
        "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl(a": (
            "memory"
        ),
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, ": (
            "memory"
        ),
        "aten::mm": "gemm",
        "aten::native_layer_norm": "memory",
    }
    got = {name: step_profile.kind(name) for name in names}
    assert got == names, f"kinds: {got}"


@pytest.mark.slow
def test_step_profile_plumbing_on_cpu(tmp_path: Path) -> None:
    assert step_profile.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "step_profile.json").read_text())["rows"]
    compiled = {row["case"]: row["compiled"] for row in rows}
    assert compiled == {"smoke": "", "smoke-compiled": "aot_eager"}, f"cases run: {compiled}"
    breaks = {row["case"]: row["graph_breaks"] for row in rows}
    assert breaks == {"smoke": 0, "smoke-compiled": 0}, (
        f"graph breaks {breaks}: a compiled layer without dropout or recomputation is no longer "
        "one graph, so the compiled case measures no fused stack"
    )
    for row in rows:
        assert row["predicted"]["total"] > 0 and row["measured_seconds"] > 0, row
        assert set(row["kernel_seconds"]) == {"gemm", "attention", "memory"}, row
        assert row["kernel_seconds"]["gemm"] > 0 and row["kernels_per_step"] > 0, row
