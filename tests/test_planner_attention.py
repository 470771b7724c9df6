"""The fused attention core's price (``lightning_sp.planner.kernels.flash_attention_seconds``):
its rate and its attention-dropout cost on the Hopper presets against the H200 measurement they
come from, the dropout cost entering the core's time by exactly its ratio, and ``calibrate``
measuring that ratio into a cluster YAML that ``--cluster`` reads back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from lightning_sp import GPTConfig
from lightning_sp.model.recompute import NO_RECOMPUTE
from lightning_sp.planner.calibrate import calibrate
from lightning_sp.planner.kernels import flash_attention_seconds
from lightning_sp.planner.layertime import layer_time
from lightning_sp.planner.presets import A100_80GB, PRESETS, cluster_from_dict, load_cluster

H200 = PRESETS["h200"]
# Megatron-LM's published 1.7B row's model (benchmarks/step_profile.py's published-1.7B)
PUBLISHED_17B = GPTConfig(
    vocab_size=131072, seq_length=4096, hidden_size=2048, num_layers=24, num_heads=16,
    tie_embeddings=False, hidden_dropout=0.1, attention_dropout=0.1, attention="sdpa",
    recompute=NO_RECOMPUTE,
)  # fmt: skip


def test_dropout_cost_enters_the_fused_core_by_its_ratio() -> None:
    """By hand on ``h200``, s = 4096, d = 128, 16 heads: forward ``0.5·4·s²·d·16`` = 68.72
    GFLOP at 426.9 TFLOP/s (``flash_attention_efficiency``), backward 2.5x; with dropout both
    x 19.51/13.52 (``flash_attention_dropout_cost``); without, unchanged."""
    forward = 0.5 * 4 * 4096**2 * 128 * 16 / 426.9e12
    ratio = 19.51 / 13.52
    plain = flash_attention_seconds(H200, 4096, 128, 16)
    assert plain == pytest.approx((forward, 2.5 * forward), rel=1e-12), plain
    assert flash_attention_seconds(H200, 4096, 128, 16, dropout=False) == plain
    dropped = flash_attention_seconds(H200, 4096, 128, 16, dropout=True)
    assert dropped == pytest.approx((ratio * forward, ratio * 2.5 * forward), rel=1e-12), dropped
    a100 = flash_attention_seconds(A100_80GB, 4096, 128, 16, dropout=True)
    assert a100 == flash_attention_seconds(A100_80GB, 4096, 128, 16), "A100: unmeasured, 1.0"


def test_a_layer_prices_the_core_by_the_layouts_dropout() -> None:
    """A layer's ``attention`` part (the fused core) is the no-dropout one times the ratio when
    the model has attention dropout, the same when it has none; the calibration table's
    measured (no-dropout) time is scaled alike; nothing else in the layer moves."""
    nodrop = dataclasses.replace(PUBLISHED_17B, attention_dropout=0.0)
    with_ = layer_time(PUBLISHED_17B.activation_shape(None, 1), H200)
    without = layer_time(nodrop.activation_shape(None, 1), H200)
    ratio = H200.flash_attention_dropout_cost
    for part in ("forward", "backward"):
        a, b = getattr(with_, part), getattr(without, part)
        assert a["attention"] == pytest.approx(ratio * b["attention"], rel=1e-12), part
        assert {k: v for k, v in a.items() if k != "attention"} == {
            k: v for k, v in b.items() if k != "attention"
        }, f"{part}: only the core moves with attention dropout"
    table = cluster_from_dict(
        {"base": "h200", "flash_attention_dropout_cost": 1.25, "calibration": {"kernels": [
            {"kind": "attention", "m": 4096, "n": 128, "k": 0, "batch": 16, "seconds": 0.7}]}},
        "cal",
    )  # fmt: skip
    assert flash_attention_seconds(table, 4096, 128, 16, dropout=True) == pytest.approx(
        (1.25 * 0.7 / 3.5, 1.25 * 0.7 * 2.5 / 3.5), rel=1e-12
    )
    assert flash_attention_seconds(table, 4096, 128, 16) == pytest.approx((0.2, 0.5), rel=1e-12)


def test_hopper_presets_reproduce_the_h200_measurement() -> None:
    """``benchmarks/results/gpu/session3/step_profile.json``: the fused attention kernels of the
    published 1.7B model's forward + backward took 13.52 ms without attention dropout and
    19.51 ms with 0.1 on an H200; the Hopper presets price the 24 layers' cores at those times
    (the H100's SMs and peak are the H200's)."""
    for name in ("h100-80gb", "h100-realised", "h200"):
        cluster = PRESETS[name]
        for dropout, measured in ((0.0, 13.52e-3), (0.1, 19.51e-3)):
            config = dataclasses.replace(PUBLISHED_17B, attention_dropout=dropout)
            layer = layer_time(config.activation_shape(None, 1), cluster)
            core = 24 * (layer.forward["attention"] + layer.backward["attention"])
            assert core == pytest.approx(measured, rel=2e-3), f"{name} dropout {dropout}: {core}"
    assert PRESETS["a100-80gb"].flash_attention_dropout_cost == 1.0
    assert PRESETS["selene"].flash_attention_dropout_cost == 1.0


def test_calibrate_measures_the_dropout_cost_into_the_yaml(tmp_path: Path) -> None:
    """``calibrate`` on this CPU (a plumbing check: the figure means nothing here) writes the
    measured ratio for a config with attention dropout, and ``--cluster`` reads it back and
    prices the core with it; for a config without, no ratio is written and the base preset's
    is carried."""
    tiny = GPTConfig(vocab_size=64, seq_length=64, hidden_size=64, num_layers=1, num_heads=4,
                     attention_dropout=0.1)  # fmt: skip
    cpu, plain = torch.device("cpu"), dataclasses.replace(tiny, attention_dropout=0.0)
    for config, written in ((tiny, True), (plain, False)):
        result = calibrate(config, H200, cpu, [1], [1], 0.001, 64, 1 << 16)
        path = tmp_path / f"cal{int(written)}.yaml"
        path.write_text(yaml.safe_dump(result, sort_keys=False))
        cluster = load_cluster(str(path))
        assert ("flash_attention_dropout_cost" in result) == written, result.keys()
        if not written:
            assert cluster.flash_attention_dropout_cost == H200.flash_attention_dropout_cost
            continue
        ratio = yaml.safe_load(path.read_text())["flash_attention_dropout_cost"]
        assert ratio > 0 and cluster.flash_attention_dropout_cost == ratio
        measured = cluster.calibration.lookup("attention", 64, 16, 0, 4)
        assert measured is not None
        got = flash_attention_seconds(cluster, 64, 16, 4, dropout=True)
        assert sum(got) == pytest.approx(ratio * measured, rel=1e-12)
