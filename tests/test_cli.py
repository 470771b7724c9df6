"""cli.py as a user runs it: Lightning's popen launcher starts the 2 ranks, logs and a
checkpoint are written, bad configs fail with one line; and the README's by-hand example."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli_runs import CLI, ROOT, TINY, error_lines, run, run_many

QUICK = ["--trainer.max_steps", "4", "--data.max_documents", "30",
         "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2",
         "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false"]  # fmt: skip
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_fit_tiny_config_trains_logs_and_checkpoints(tmp_path: Path, launcher: str) -> None:
    """Lightning's own launcher re-runs the script per rank; torchrun starts the ranks itself."""
    prefix = TORCHRUN if launcher == "torchrun" else []
    result = run([*prefix, CLI, "fit", "--config", TINY, *QUICK], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = list((tmp_path / "logs" / "csv").glob("version_*/metrics.csv"))
    assert metrics, "no CSV logs"
    header = metrics[0].read_text().splitlines()[0]
    for key in ("train/loss", "val/loss", "val/ppl", "memory/activation_bytes_per_layer"):
        assert key in header
    checkpoint = tmp_path / "checkpoints" / "tiny" / "last.ckpt"
    assert (checkpoint / "meta.json").is_file() and (checkpoint / ".metadata").is_file()


@pytest.mark.slow
def test_fit_tiny_pipeline_config(tmp_path: Path) -> None:
    """configs/tiny_pp.yaml: 4 processes, t=2 x p=2, interleaved m=2 (a few steps here)."""
    config = str(ROOT / "configs" / "tiny_pp.yaml")
    result = run([CLI, "fit", "--config", config, *QUICK], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = tmp_path / "checkpoints" / "tiny_pp" / "last.ckpt"
    assert json.loads((checkpoint / "meta.json").read_text())["layout"] == {
        "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 1,
        "context_parallel_size": 1, "virtual_pipeline_size": 2,
        "num_microbatches": 4, "distributed_optimizer": False, "expert_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
    }  # fmt: skip


@pytest.mark.slow
def test_help_documents_every_option(tmp_path: Path) -> None:
    result = run([CLI, "fit", "--help"], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    shown = " ".join(result.stdout.split())  # help text is wrapped
    for text in ("Shard LayerNorm, dropout", "recomputes only", "Peak learning rate",
                 "Samples per data-parallel rank", "--model.config.recompute"):  # fmt: skip
        assert text in shown, text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data.paths", "/nonexistent/*.txt"], "paths='/nonexistent/*.txt' matches no file"),
        (["--trainer.devices", "3"], "world size 3 is not divisible by tensor_parallel_size"),
        (["--model.config.num_heads", "3"], "hidden_size=256 is not divisible by num_heads=3"),
        (
            ["--trainer.strategy.init_args.tensor_parallel_size", "0"],
            "tensor_parallel_size=0 must be a positive integer",
        ),
        (["--trainer.precision", "bf16-mixed"], "trainer.precision='bf16-mixed' is not supported"),
        (["--model.optimizer.lr", "-1"], "model.optimizer.lr=-1.0 must be a finite number >= 0"),
        (["--ckpt_path", "nowhere.ckpt"], "ckpt_path='nowhere.ckpt' does not exist"),
        (
            ["--data.batch_size", "100000", "--data.max_documents", "30"],
            "batch_size=100000 is larger than",
        ),
        (["--model.config.attention", "flash"], "attention='flash' is not an attention backend"),
        (
            ["--trainer.strategy.init_args.sequence_parallel", "true"],
            "trainer.strategy.init_args.sequence_parallel is no longer a strategy argument: it "
            "moved to model.config.sequence_parallel",
        ),
        (["--model.config.recompute", "[core_attn, gelu]"], "'gelu' is not a recompute module"),
        (
            ["--model.config.recompute_rest", "full"],
            "recompute_rest='full' cannot be what the layers beyond recompute_num_layers run",
        ),
    ],
    ids=[
        "missing-data",
        "world-size",
        "heads",
        "strategy-arg",
        "precision",
        "lr",
        "ckpt",
        "batch-after-launch",
        "attention",
        "moved-strategy-arg",
        "recompute-module",
        "recompute-rest",
    ],
)
def test_bad_config_fails_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    """One ``error:`` line naming the field, printed once (by rank 0 only, also for the data
    check that runs on every rank after launch), exit code 2, no traceback."""
    # the last case launches both ranks and prepares the corpus first: minutes under load
    result = run([CLI, "fit", "--config", TINY, *args], tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists(), "work started before the config was checked"


@pytest.mark.slow
def test_readme_example_runs_under_torchrun(tmp_path: Path) -> None:
    result = run(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "by_hand.py")],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # the two ranks print concurrently: their lines may interleave
    found = re.findall(r"rank (\d): loss ([\d.]+), layer 0 saved ([\d.]+) sbh", result.stdout)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], result.stdout
    assert found[0][1] == found[1][1], "TP ranks disagree on the loss"
    for _, _, saved in found:
        assert float(saved) == pytest.approx(17.0, rel=0.01)  # 34 sbh / t at t=2


@pytest.mark.parametrize("enabled", [True, False])
def test_cli_shows_the_short_progress_bar_unless_disabled(enabled: bool, tmp_path: Path) -> None:
    """The CLI adds lightning_sp.ProgressBar to the configured callbacks (configs/tiny.yaml
    names none), and leaves it out when the bar is disabled."""
    from lightning_sp import GPTModule, ProgressBar, TextDataModule
    from lightning_sp.cli.fit import GPTCLI

    args = ["--config", TINY, "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--trainer.default_root_dir", str(tmp_path),
            "--trainer.enable_progress_bar", str(enabled).lower()]  # fmt: skip
    cli = GPTCLI(GPTModule, TextDataModule, args=args, run=False)
    bars = [c for c in cli.trainer.callbacks if isinstance(c, ProgressBar)]  # type: ignore[attr-defined]
    assert len(bars) == (1 if enabled else 0)
    assert (cli.trainer.progress_bar_callback is not None) == enabled


def test_logs_go_under_the_default_root_dir(tmp_path: Path) -> None:
    """Like any Lightning run, the CLI's loggers write under ``trainer.default_root_dir``
    (configs/tiny.yaml sets ``logs``); a config's own loggers are left alone."""
    from lightning_sp import GPTModule, TextDataModule
    from lightning_sp.cli.fit import GPTCLI

    base = ["--config", TINY, "--trainer.devices", "1", "--trainer.strategy", "auto"]
    cli = GPTCLI(GPTModule, TextDataModule, run=False,
                 args=[*base, "--trainer.default_root_dir", str(tmp_path / "root")])  # fmt: skip
    dirs = {type(lg).__name__: Path(lg.log_dir) for lg in cli.trainer.loggers}  # type: ignore[attr-defined]
    assert dirs["CSVLogger"].parent == tmp_path / "root" / "csv", dirs
    assert all(d.is_relative_to(tmp_path / "root") for d in dirs.values()), dirs
    cli = GPTCLI(GPTModule, TextDataModule, run=False, args=[*base, "--trainer.logger", "false"])
    assert not cli.trainer.loggers  # type: ignore[attr-defined]


TEN = ["fit", "validate", "test", "predict", "estimate", "prepare", "generate", "export",
       "calibrate", "step-check"]  # fmt: skip


def test_every_command_is_listed_and_a_wrong_one_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: ``lightning-sp``, ``lightning-sp --help`` and ``lightning-sp fitt`` listed
    only Lightning's four commands; ``lightning-sp generate`` printed a usage named ``cli.py``.
    Now the help lists all ten, a missing or unknown command is one line listing them, and
    generate's parse errors are one line under the name the user ran."""
    from lightning_sp import ConfigError
    from lightning_sp.cli.main import main

    monkeypatch.setattr("sys.argv", ["/venv/bin/lightning-sp"])
    main(["--help"])
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()
              if line.startswith("  ")]  # fmt: skip
    assert listed == TEN, f"--help lists {listed}"
    valid = ", ".join(TEN)
    with pytest.raises(ConfigError) as error:
        main([])
    assert str(error.value) == f"give a command: {valid} (lightning-sp --help describes each)"
    with pytest.raises(ConfigError) as error:
        main(["fitt"])
    assert str(error.value) == (
        f"unknown command 'fitt' (did you mean 'fit'?); valid: {valid} (lightning-sp --help "
        "describes each)"
    )
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--ckpt_path", "x"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: the following arguments are required: --prompt (lightning-sp generate --help "
        "lists every option)"
    ]


@pytest.mark.slow
def test_pre_launch_errors_of_estimate_prepare_generate_are_one_line(tmp_path: Path) -> None:
    """Issue 40: their pre-launch errors came after Lightning's "Seed set to" line (and for
    generate its device banner from a Trainer the command never used): 2 and 5 lines where
    fit's are 1. Now the whole output is the one error line."""
    cases = [
        (["estimate", "--model.config.num_heads", "7"],
         "error: hidden_size=256 is not divisible by num_heads=7"),
        (["prepare", "--data.paths", "/nope/x.txt"], "error: paths='/nope/x.txt' matches no file"),
        (["generate", "--ckpt_path", str(tmp_path), "--prompt", "x"],
         f"error: ckpt_path={str(tmp_path)!r} is not a complete checkpoint"),
    ]  # fmt: skip
    commands = [[CLI, args[0], "--config", TINY, *args[1:]] for args, _ in cases]
    for (args, start), result in zip(cases, run_many(commands, tmp_path), strict=True):
        lines = (result.stdout + result.stderr).splitlines()
        assert result.returncode == 2 and len(lines) == 1, (args[0], lines)
        assert lines[0].startswith(start), lines


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["step-check", "--micro_batch_size", "0"],
         "argument --micro_batch_size: '0' is not a positive integer"),
        (["step-check", "--seconds", "nan"],
         "argument --seconds: 'nan' is not a positive finite number"),
        (["calibrate", "--seconds", "-1"],
         "argument --seconds: '-1' is not a positive finite number"),
    ],
)  # fmt: skip
def test_bad_timing_arguments_are_one_line_before_any_work(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A micro-batch of 0 ran step-check at the config's batch size instead (the default
    taken for any falsy value); a non-finite or negative time per measurement was taken as
    it is. Each is now one line naming the option and the value, exit 2, before a model."""
    from lightning_sp.cli.main import main

    monkeypatch.setattr("sys.argv", ["/venv/bin/lightning-sp"])
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--config", TINY, "--device", "cpu"])
    command = argv[0]
    assert exited.value.code == 2, f"{argv}: exit {exited.value.code}"
    assert capsys.readouterr().err.splitlines() == [
        f"error: {line} (lightning-sp {command} --help lists every option)"
    ], argv
