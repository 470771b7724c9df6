"""``estimate`` and what it is given (issue 32): Lightning's gradient accumulation in the layout,
the step time and the search; the configured layout under CP when sequence parallelism cannot
split ``s/c``; a cluster YAML's values and ``--plot``'s path checked before the estimate runs,
each refusal one line naming the field and the value."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import yaml

from lightning_sp import ConfigError, GPTConfig
from lightning_sp.cli.estimate import main as report_main
from lightning_sp.cli.estimate import read_estimate_args
from lightning_sp.memory.flops import model_flops_per_iteration
from lightning_sp.memory.model_state import parameters_per_rank
from lightning_sp.planner.estimate import estimate
from lightning_sp.planner.kernels import all_reduce_seconds
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.presets import H100_80GB, load_cluster
from lightning_sp.planner.report import format_table
from lightning_sp.planner.search import search
from lightning_sp.planner.steptime import step_time

from cli_runs import CLI, ROOT, error_lines, run
from models import layout_at

LLAMA8B = os.path.join(ROOT, "configs", "llama3_8b.yaml")
STRATEGY = "--trainer.strategy.init_args"
# a small GPT: s=1024, h=1024, a=16, L=4, v=1000
SMALL = GPTConfig(
    vocab_size=1000, seq_length=1024, hidden_size=1024, num_layers=4, num_heads=16,
    recompute="none",
)  # fmt: skip


def main(argv: list[str]) -> int:
    """``python cli.py estimate ARGV`` in this process; the exit status."""
    return report_main(read_estimate_args, argv)


# -- gradient accumulation ---------------------------------------------------------------------


def test_accumulation_runs_k_micro_batches_and_reduces_once() -> None:
    """p = 1, t = 8, d = 16 (16 nodes: each data-parallel group has one rank per node, so its
    reduction crosses the network through one adapter), b = 1 with k = 4 accumulated
    micro-batches: the global batch is b·k·d, the pipeline part k times one micro-batch's
    forward + backward (no bubble), the gradient reduction once per step (what outlasts the
    last micro-batch's backward), the optimizer once; tokens/s and MFU from that global
    batch. Beside it, b = 4 without accumulation (the same global batch): one larger
    micro-batch, whose longer backward hides more of the reduction."""
    one = Layout(config=SMALL, tensor_parallel_size=8, data_parallel_size=16, micro_batch_size=1)
    acc = dataclasses.replace(one, accumulate_grad_batches=4)
    wide = dataclasses.replace(one, micro_batch_size=4)
    assert (one.global_batch_size, acc.global_batch_size, wide.global_batch_size) == (16, 64, 64)
    t1, tk, tw = (step_time(x, H100_80GB) for x in (one, acc, wide))
    assert tk.parts["pipeline"] == pytest.approx(4 * t1.parts["pipeline"], rel=1e-12)
    assert tk.parts["bubble"] == 0.0
    reduce = all_reduce_seconds(H100_80GB, 4 * parameters_per_rank(SMALL, layout_at(8)), 16, False)
    backward = SMALL.num_layers * sum(tk.layer.backward.values())  # one micro-batch, no recompute
    assert tk.parts["dp_exposed"] == pytest.approx(max(0.0, reduce - backward), rel=1e-12)
    assert tk.parts["dp_exposed"] == t1.parts["dp_exposed"] > 0  # once per step, not k times
    assert tk.parts["optimizer"] == t1.parts["optimizer"]
    assert tk.iteration_seconds == pytest.approx(
        4 * t1.parts["pipeline"] + t1.parts["dp_exposed"] + t1.parts["optimizer"], rel=1e-12
    )
    assert tk.tokens_per_second == pytest.approx(64 * 1024 / tk.iteration_seconds, rel=1e-12)
    flops = model_flops_per_iteration(SMALL, 64)
    assert tk.mfu == pytest.approx(
        flops / (tk.iteration_seconds * 128 * H100_80GB.peak_flops),
        rel=1e-12,  # t·d GPUs
    )
    # the wider micro-batch's backward is 4x as long: more of the one reduction is hidden
    assert tw.parts["dp_exposed"] < tk.parts["dp_exposed"]
    # overlap_grad_reduce off: the whole reduction is exposed, with or without accumulation
    off = step_time(dataclasses.replace(acc, overlap_grad_reduce=False), H100_80GB)
    assert off.parts["dp_exposed"] == pytest.approx(reduce, rel=1e-12)


def test_fit_command_line_accumulation_reaches_the_estimate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--trainer.accumulate_grad_batches 4`` at t = 1, p = 1 on 48 GPUs: global batch 192 (4
    x 48 x b = 1), named in the layout line; with p > 1 it is refused in one line, as ``fit``
    refuses it; ``overlap_grad_reduce`` comes from the strategy."""
    args = ["--config", LLAMA8B, f"{STRATEGY}.tensor_parallel_size", "1", "--trainer.num_nodes",
            "6", "--data.batch_size", "1", "--cluster", "h100-80gb"]  # fmt: skip
    parsed = read_estimate_args([*args, "--trainer.accumulate_grad_batches", "4"])
    layout = parsed.layout
    assert (layout.accumulate_grad_batches, layout.global_batch_size) == (4, 192)
    assert layout.overlap_grad_reduce
    off = read_estimate_args([*args, f"{STRATEGY}.overlap_grad_reduce", "false"]).layout
    assert not off.overlap_grad_reduce and off.global_batch_size == 48
    assert main([*args, "--trainer.accumulate_grad_batches", "4", "--formula_only", "true"]) == 0
    table = capsys.readouterr().out
    assert "x 4 accumulated" in table and "(global batch 192)" in table
    pipelined = [f"{STRATEGY}.pipeline_parallel_size", "2", f"{STRATEGY}.num_microbatches", "2",
                 "--data.batch_size", "2", "--trainer.accumulate_grad_batches", "2"]  # fmt: skip
    with pytest.raises(ConfigError) as info:
        read_estimate_args([*args, *pipelined])
    message = str(info.value)
    assert "\n" not in message
    assert "trainer.accumulate_grad_batches=2 with pipeline_parallel_size=2" in message


def test_search_splits_a_p1_step_by_accumulation() -> None:
    """The search keeps the global batch b·n·k·d of an accumulating layout; at p = 1 it splits
    a step by accumulation (``num_microbatches`` 1, as ``fit`` requires), at p > 1 by the
    schedule; the configured accumulating layout is among the candidates."""
    base = Layout(config=SMALL, data_parallel_size=4, micro_batch_size=1, accumulate_grad_batches=4)
    found = search(base, H100_80GB, 80e9, max_micro_batch=4)
    assert found.ranked
    for x in found.ranked:
        lay = x.layout
        assert lay.global_batch_size == 16
        if lay.pipeline_parallel_size == 1:
            assert lay.num_microbatches == 1
        else:
            assert lay.accumulate_grad_batches == 1
    assert any(
        x.layout.accumulate_grad_batches == 4 and x.layout.data_parallel_size == 4
        and x.layout.micro_batch_size == 1 and x.layout.tensor_parallel_size == 1
        for x in found.ranked
    )  # fmt: skip


# -- context parallelism: the configured layout when SP cannot split s/c -----------------------


def test_cp_shows_the_configured_layout_when_sp_cannot_split() -> None:
    """s = 8196 at c = 2, t = 4, SP on: 2c divides s, c·t does not. The configured layout is
    shown (its recompute none, SP off, selected) and marked as not splitting the sequence, with what
    ``fit`` wants; the valid c offered for a bad c are only those ``fit`` accepts."""
    config = dataclasses.replace(SMALL, seq_length=8196, sequence_parallel=True)
    lay = Layout(config=config, tensor_parallel_size=4, context_parallel_size=2)
    assert not lay.splits_sequence()
    result = estimate(lay, measure=False)
    selected = [r for r in result.rows if r.selected]
    assert [(r.sequence_parallel, r.recompute) for r in selected] == [(False, "none")]
    table = format_table(result)
    assert "configured: TP only + none (SP does not split the sequence)" in table, table
    assert "fit refuses SP on: model.config.seq_length must be a multiple of 8" in table
    bad = dataclasses.replace(lay, context_parallel_size=5)
    with pytest.raises(ConfigError) as info:
        bad.validate()
    valid = [int(x) for x in str(info.value).split("one of [")[1].rstrip("]").split(", ")]
    assert 2 not in valid and 3 in valid  # 4 | 8196 but 8 does not; 6 | 8196 and 12 | 8196
    for c in valid:
        assert c == 1 or config.seq_length % math.lcm(2 * c, 4 * c) == 0


# -- the cluster YAML --------------------------------------------------------------------------


BAD_CLUSTERS: list[tuple[str, str, str]] = [  # (id, YAML text, the one line's fragment)
    ("nan-peak", "base: h100-80gb\npeak_flops: .nan\n", "peak_flops=nan must be a positive"),
    ("inf-bandwidth", "base: h100-80gb\nhbm_bandwidth: .inf\n", "hbm_bandwidth=inf"),
    ("negative-nodes", "base: h100-80gb\ngpus_per_node: -8\n", "gpus_per_node=-8"),
    ("tile-zero", "base: h100-80gb\ngemm_tile: [0, 128]\n", "gemm_tile=[0, 128] must be two"),
    ("tile-one", "base: h100-80gb\ngemm_tile: [128]\n", "gemm_tile=[128]"),
    (
        "negative-seconds",
        "base: h100-80gb\ncalibration:\n  kernels:\n  - {kind: gemm, m: 8, n: 8, k: 8, "
        "batch: 1, seconds: -1.0}\n",
        "calibration.kernels[0].seconds=-1.0 must be a finite positive",
    ),
    (
        "unknown-kind",
        "base: h100-80gb\ncalibration:\n  kernels:\n  - {kind: gemmm, m: 8, n: 8, k: 8, "
        "batch: 1, seconds: 1.0}\n",
        "calibration.kernels[0].kind='gemmm' is not a kernel kind; valid: gemm, attention",
    ),
    (
        "kernel-missing-key",
        "base: h100-80gb\ncalibration:\n  kernels:\n  - {kind: gemm, m: 8}\n",
        "calibration.kernels[0]=",
    ),
    ("malformed", "base: h100-80gb\npeak_flops: [1, 2\n", "is not valid YAML at line"),
    ("not-a-mapping", "- 1\n- 2\n", "expected a mapping"),
]


@pytest.mark.parametrize(("text", "fragment"), [c[1:] for c in BAD_CLUSTERS],
                         ids=[c[0] for c in BAD_CLUSTERS])  # fmt: skip
def test_a_bad_cluster_yaml_is_one_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_cluster(str(path))
    assert "\n" not in str(info.value) and fragment in str(info.value), str(info.value)


def test_calibrated_cluster_loads_and_is_used(tmp_path: Path) -> None:
    """A valid calibration kernel is read and replaces the model for its exact shape."""
    path = tmp_path / "cluster.yaml"
    kernel = {"kind": "attention", "m": 128, "n": 64, "k": 0, "batch": 4, "seconds": 2.5e-3}
    path.write_text(yaml.safe_dump({"base": "h100-80gb", "calibration": {"kernels": [kernel]}}))
    cluster = load_cluster(str(path))
    assert cluster.calibration.lookup("attention", 128, 64, 0, 4) == 2.5e-3


# -- the command: one line, before the estimate runs -------------------------------------------


def _plot_cases(tmp_path: Path) -> list[tuple[str, str]]:
    return [
        (str(tmp_path / "missing" / "m.png"), "does not exist"),
        (str(tmp_path / "m.bmpx"), "unknown image format 'bmpx'"),
        (str(tmp_path / "m"), "unknown image format '(no extension)'"),
        (str(tmp_path), "is a directory; give a file name in it"),
    ]


def test_bad_plot_path_is_one_line_before_the_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each bad ``--plot`` exits 2 with one ``error:`` line naming ``--plot`` and the value,
    before any estimate runs (the estimate is replaced by one that fails the test)."""
    pytest.importorskip("matplotlib")
    import lightning_sp.cli.estimate as command

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the estimate ran before --plot was checked")

    monkeypatch.setattr(command, "estimate", never)
    for path, fragment in _plot_cases(tmp_path):
        assert main(["--config", LLAMA8B, "--formula_only", "true", "--plot", path]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"error: --plot={path!r}"), err
        assert fragment in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_bad_cluster_from_the_command_line_is_one_line(tmp_path: Path) -> None:
    """``python cli.py estimate --cluster bad.yaml``: exit 2, exactly one ``error:`` line on
    stderr naming the field, no traceback, no ``[rank0]:`` prefix."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: h100-80gb\ncalibration:\n  kernels:\n  - {kind: gemm, m: 8, n: 8, "
                   "k: 8, batch: 1, seconds: -1.0}\n")  # fmt: skip
    proc = run([CLI, "estimate", "--config", LLAMA8B, "--cluster", str(bad)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "calibration.kernels[0].seconds=-1.0" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "[rank0]" not in proc.stderr


def test_search_ranks_each_layout_once() -> None:
    """At t = 1 sequence parallelism splits nothing (the row is SP off's again): the search
    ranks SP only where t > 1, so no two candidates share a key (t, p, m, c, b, SP,
    recompute, distributed optimizer, e, etp)."""
    base = Layout(config=SMALL, tensor_parallel_size=2, data_parallel_size=2)
    found = search(base, H100_80GB, 80e9, max_micro_batch=2)
    assert any(x.layout.tensor_parallel_size == 1 for x in found.ranked)
    twins = [x.key() for x in found.ranked if x.row.sequence_parallel]
    assert all(key[0] > 1 for key in twins), (
        f"search ranks sequence parallelism at t = 1: {[k for k in twins if k[0] == 1][:3]}"
    )
    keys = [x.key() for x in found.ranked]
    assert len(keys) == len(set(keys)), "search ranks a layout twice"
