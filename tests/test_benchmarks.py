"""The benchmarks never rot: the one command runs in smoke mode and writes each section's JSON
and table (the byte and FLOP sections in the quick tier, the whole run in the slow tier), and
the DTensor model they compare against is the same GPT as ours.

The smoke run's timings mean nothing and are never asserted; its byte and FLOP counts are
deterministic and are.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sp.testing import dtensor_gpt
from lightning_sp.testing.spawn import run_distributed

MEASURED = ("activation_bytes", "layer_time", "flops", "throughput")
SECTIONS = ("meta", *MEASURED)


def _numbers(value: Any) -> list[float]:
    """Every int/float inside a JSON value (bools excluded)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return []


QUICK = ("activation_bytes", "flops")
"""The sections run in the quick tier (seconds; their byte and FLOP counts asserted there);
the layer-time section (timings only, asserted in the whole run's test) and the throughput
section (Lightning on spawned ranks, half a minute) run in the slow tier."""


def _smoke_worker(rank: int, world_size: int, out: str, only: tuple[str, ...]) -> None:
    from benchmarks import run

    run.main(["--smoke", "--only", ",".join(only), "--out", out])


def _smoke_run(out: Path, only: tuple[str, ...]) -> dict[str, Any]:
    """``python -m benchmarks.run --smoke --only ONLY --out OUT`` in a fresh process (one forked
    from the session's clean server, which has the imports already: the sections fork ranks of
    their own, safe only from a process that never ran a multi-threaded kernel)."""
    run_distributed(_smoke_worker, 1, str(out), only, init_group=False)
    sections = {name: json.loads((out / f"{name}.json").read_text()) for name in only}
    report = {"meta": sections[only[-1]].pop("meta"), **sections}
    for name in only[:-1]:
        assert sections[name].pop("meta") == report["meta"], name
    return report


@pytest.fixture(scope="module")
def quick_smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The smoke run's :data:`QUICK` sections."""
    out = tmp_path_factory.mktemp("bench")
    return out, _smoke_run(out, QUICK)


@pytest.fixture(scope="module")
def smoke(quick_smoke: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """The whole smoke run: the throughput section written next to :func:`quick_smoke`'s."""
    out, quick = quick_smoke
    rest = _smoke_run(out, tuple(name for name in MEASURED if name not in QUICK))
    return out, {**quick, **rest}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_run_writes_json_and_a_table_per_section(
    smoke: tuple[Path, dict[str, Any]],
) -> None:
    out, report = smoke
    for name in MEASURED:
        for suffix in (".json", ".md"):
            path = out / f"{name}{suffix}"
            assert path.is_file() and path.stat().st_size > 0, path
        lines = (out / f"{name}.md").read_text().splitlines()
        assert len(lines) >= 3 and all(line.startswith("| ") for line in lines), name  # one table
    assert set(SECTIONS) <= set(report), sorted(report)
    numbers = _numbers({k: report[k] for k in SECTIONS})
    assert numbers and all(math.isfinite(x) for x in numbers)
    meta = report["meta"]
    assert meta["smoke"] and meta["torch"] == torch.__version__ and meta["machine"]["cores"]
    assert meta["command"].startswith("python -m benchmarks.run --smoke")
    for run in report["throughput"]["runs"].values():
        assert run["tokens_per_second"] > 0 and 0 < run["mfu"] < 1
        assert run["peak_rss"] > 0 and run["live_memory"]["peak_rss"] > 0
    assert all(r["total_seconds"] > 0 for r in report["layer_time"]["rows"])


@pytest.mark.timeout(300)
def test_smoke_bytes_are_table2_and_dtensor_keeps_more(
    quick_smoke: tuple[Path, dict[str, Any]],
) -> None:
    section = quick_smoke[1]["activation_bytes"]
    rows = section["rows"]
    assert {(r["sequence_parallel"], r["recompute"]) for r in rows} == {
        (sp, policy) for sp in (False, True) for policy in ("none", "selective", "full")
    }
    for r in rows:
        assert r["ours_bytes"] == pytest.approx(r["paper_bytes"], rel=0.01), r
        assert r["ours_layers_equal"] and r["dtensor_layers_equal"]
    for r in rows:
        if not (r["sequence_parallel"] and r["recompute"] == "selective"):
            continue
        t = r["t"]
        assert r["dtensor_sbh"] > r["ours_sbh"]
        # DTensor's SequenceParallel keeps the all-gathered QKV and fc1 inputs: +4(1 - 1/t) sbh
        assert r["dtensor_native_dropout_sbh"] - r["ours_sbh"] == pytest.approx(4 * (1 - 1 / t))
        # F.dropout keeps 2-byte noise instead of 1-byte masks on both residual branches
        assert r["dtensor_sbh"] - r["dtensor_native_dropout_sbh"] == pytest.approx(2 / t)


@pytest.mark.timeout(300)
def test_smoke_flops_are_the_papers(quick_smoke: tuple[Path, dict[str, Any]]) -> None:
    section = quick_smoke[1]["flops"]
    for r in section["layer"]:
        assert r["forward_flops"] == r["paper_forward_flops"]
        assert r["recompute_flops"] == r["paper_recompute_flops"]
        assert r["backward_flops"] == 2 * r["forward_flops"] + r["recompute_flops"]
    selective = [r for r in section["layer"] if r["recompute"] == "selective"]
    for r in selective:
        assert r["recompute_over_forward"] == pytest.approx(section["paper_selective_fraction"])
    for r in section["iteration"]:
        assert r["counted_flops"] == r["hardware_flops_formula"]


def _equivalence_worker(rank: int, world_size: int, sp: bool, policy: str) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_sp import GPT, GPTConfig, ParallelState

    config = GPTConfig(
        vocab_size=512, seq_length=32, hidden_size=64, num_layers=2, num_heads=4,
        hidden_dropout=0.0, attention_dropout=0.0, recompute=policy,  # type: ignore[arg-type]
    )  # fmt: skip
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    ours = GPT(config, ParallelState.single(), dtype=torch.float64)
    reference_loss = ours(ids[:, :-1], ids[:, 1:])
    reference_loss.backward()
    model = dtensor_gpt.DTensorGPT(config).double()
    dtensor_gpt.load_from_lightning_sp(model, ours.state_dict())
    dtensor_gpt.parallelize(model, init_device_mesh("cpu", (world_size,)), sp)
    loss = model(ids[:, :-1], ids[:, 1:])
    with loss_parallel():
        loss.backward()
    grads = dtensor_gpt.dtensor_names(
        {n: p.grad for n, p in ours.named_parameters()}, config.head_dim
    )
    errors = {"loss": abs(float(loss.full_tensor()) - float(reference_loss))}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        errors[name] = float((grad - grads[name]).norm() / grads[name].norm())
    return errors


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_dtensor_reference_is_our_gpt(sp: bool) -> None:
    """With dropout off, the DTensor GPT on 2 ranks gives our one-process model's loss and
    gradients (float64): the benchmarks compare implementations of one model."""
    for policy in ("none", "selective", "full"):
        for rank, errors in enumerate(
            run_distributed(
                _equivalence_worker, 2, sp, policy, start_method="fork", held_groups=True
            )
        ):
            worst = max(errors, key=errors.__getitem__)
            assert errors[worst] < 1e-12, f"{policy} rank {rank}: {worst} differs ({errors[worst]})"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_context_benchmark_smoke() -> None:
    """``python -m benchmarks.context --smoke``: both layouts ran s tokens per rank and the
    ratio lies in its interval (the timings themselves are not asserted)."""
    from benchmarks import context

    out = context.main(["--smoke"])
    assert out["low"] <= out["ratio"] <= out["high"]
    assert all(math.isfinite(v) and v > 0 for v in out.values())


def test_step_check_smoke_on_cpu(tmp_path: Path) -> None:
    """``lightning-sp step-check --smoke`` on this CPU, on the cluster the smoke
    calibration wrote: one row per recompute policy with the model's forward + backward, the
    measured one and their ratio (a benchmark's figure: its value is not asserted); the model
    predicts full recompute slower than selective, and selective no faster than none."""
    from lightning_sp.cli import calibrate, step_check
    from lightning_sp.model.config import RECOMPUTE_POLICIES

    cluster = tmp_path / "cpu.yaml"
    assert calibrate.main(["--smoke", "--device", "cpu", "--out", str(cluster)]) == 0
    out = tmp_path / "rows.json"
    args = ["--smoke", "--device", "cpu", "--cluster", str(cluster), "--out", str(out)]
    assert step_check.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["recompute"] for row in rows] == list(RECOMPUTE_POLICIES)
    for row in rows:
        assert row["predicted_seconds"] > 0 and row["measured_seconds"] > 0
        assert row["ratio"] == pytest.approx(row["measured_seconds"] / row["predicted_seconds"])
    predicted = {row["recompute"]: row["predicted_seconds"] for row in rows}
    assert predicted["full"] > predicted["selective"] >= predicted["none"]


def test_step_check_runs_the_configs_micro_batch_unless_told(tmp_path: Path) -> None:
    """``step-check --config`` times the config's ``data.batch_size`` sequences per forward
    (what its fit runs), and ``--micro_batch_size`` overrides it."""
    import dataclasses

    import yaml

    from lightning_sp.cli import step_check
    from lightning_sp.planner.calibrate import SMOKE_CONFIG

    model = {k: v for k, v in dataclasses.asdict(SMOKE_CONFIG).items() if k in (
        "vocab_size", "seq_length", "hidden_size", "num_layers", "num_heads")}  # fmt: skip
    config = tmp_path / "fit.yaml"
    config.write_text(yaml.safe_dump({"model": {"config": model}, "data": {"batch_size": 3}}))
    for extra, want in (([], 3), (["--micro_batch_size", "2"], 2)):
        out = tmp_path / f"rows{want}.json"
        args = ["--config", str(config), "--device", "cpu", "--seconds", "0.01", "--out", str(out)]
        assert step_check.main(args + extra) == 0
        got = json.loads(out.read_text())["micro_batch_size"]
        assert got == want, f"step-check ran b={got} with {extra or 'the config'}; want {want}"


def test_step_check_copies_the_first_models_weights_into_the_next() -> None:
    """``step-check`` draws the model once: a later policy's model, built on ``meta`` and
    materialised, holds the first one's parameters and buffers exactly, so it computes the
    same loss as a model drawn from the seed."""
    import dataclasses

    from lightning_sp.model.recompute import RecomputePolicy
    from lightning_sp.planner.calibrate import SMOKE_CONFIG
    from lightning_sp.planner.step_check import build_model

    cpu = torch.device("cpu")
    first = build_model(SMOKE_CONFIG, cpu)
    full = dataclasses.replace(SMOKE_CONFIG, recompute=RecomputePolicy.parse("full"))
    copied, drawn = build_model(full, cpu, like=first), build_model(full, cpu)
    for (name, got), (_, want) in zip(
        (*copied.named_parameters(), *copied.named_buffers()),
        (*drawn.named_parameters(), *drawn.named_buffers()),
        strict=True,
    ):
        assert torch.equal(got, want), f"{name} differs from the seeded draw"
    tokens = torch.randint(0, SMOKE_CONFIG.vocab_size, (2, SMOKE_CONFIG.seq_length + 1))
    torch.manual_seed(0)
    loss_copied = copied(tokens[:, :-1], tokens[:, 1:])
    torch.manual_seed(0)
    loss_drawn = drawn(tokens[:, :-1], tokens[:, 1:])
    assert torch.equal(loss_copied, loss_drawn), "the copied model computes another loss"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_benchmark_smoke(tmp_path: Path) -> None:
    """``python -m benchmarks.moe --smoke``: our MoE layer, the dense SwiGLU of equal active
    FLOPs and transformers' Mixtral block (both expert implementations) ran; each ratio lies in
    its interval (the timings themselves are not asserted); the agreement check before the
    timings fails on a block whose weights differ from ours."""
    from benchmarks import moe

    out = moe.main(["--smoke", "--out", str(tmp_path)])
    assert (tmp_path / "moe.json").is_file() and (tmp_path / "moe.md").is_file()
    for clock in ("wall", "cpu"):
        ratios = out[f"ratios_{clock}"]
        assert set(ratios) == {f"moe_over_{n}" for n in moe.IMPLEMENTATIONS[1:]}
        for ratio, low, high in ratios.values():
            assert 0 < low <= ratio <= high
    layers = moe.build(moe.SMOKE)
    x = torch.randn(moe.SMOKE.tokens, 1, moe.SMOKE.hidden_size)
    moe.check_agreement(layers, x, torch.randn_like(x))
    with torch.no_grad():
        layers["hf"].experts.down_proj[0, 0, 0] += 1.0  # type: ignore[index, operator]
    with pytest.raises(AssertionError, match="moe and hf disagree on the output"):
        moe.check_agreement(layers, x, torch.randn_like(x))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_gpu_benchmark_plumbing_on_cpu(tmp_path: Path) -> None:
    """``python -m benchmarks.gpu --only moe --device cpu --smoke``: the GPU run's four MoE
    layers ran in bf16 and in fp32, each ratio lies in its interval; its agreement check
    (relative error) fails on a transformers block whose weights differ from ours."""
    from benchmarks import gpu, moe

    for dtype in ("bf16", "fp32"):
        args = ["--only", "moe", "--device", "cpu", "--smoke", "--dtype", dtype]
        gpu.main([*args, "--out", str(tmp_path)])
        assert (tmp_path / f"moe_gpu_{dtype}.json").is_file()
        out = json.loads((tmp_path / f"moe_gpu_{dtype}.json").read_text())
        assert set(out["ratios"]) == {f"moe_over_{n}" for n in moe.IMPLEMENTATIONS[1:]}
        for ratio, low, high in out["ratios"].values():
            assert 0 < low <= ratio <= high
    layers = moe.build(moe.GPU_SMOKE)
    x = torch.randn(moe.GPU_SMOKE.tokens, 1, moe.GPU_SMOKE.hidden_size)
    with torch.no_grad():
        layers["hf"].experts.down_proj.mul_(2.0)  # type: ignore[operator]
    with pytest.raises(AssertionError, match="moe and hf disagree on the output"):
        moe.check_agreement(layers, x, torch.randn_like(x), moe.REL_TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_benchmark_smoke(tmp_path: Path) -> None:
    """``python -m benchmarks.lora --smoke``: our LoRA step, our full fine-tuning step and
    peft + transformers' LoRA step ran (their losses agreed first), each ratio lies in its
    interval, and each variant's peak memory was measured in its own process (the timings
    themselves are not asserted)."""
    from benchmarks import lora

    out = lora.main(["--smoke", "--out", str(tmp_path)])
    assert (tmp_path / "lora.json").is_file() and (tmp_path / "lora.md").is_file()
    assert set(out["ratios"]) == {"lora_over_full", "lora_over_peft"}
    for ratio, low, high in out["ratios"].values():
        assert 0 < low <= ratio <= high
    assert out["loss_relative_error_vs_peft"] <= lora.LOSS_RTOL
    for variant in lora.VARIANTS:
        assert out["memory"][variant]["peak_rss_mib"] > 0, f"{variant}: no peak measured"
