"""Every field checked before launch whatever its form (issue 32, item 3), in one line, in
process (no rank starts): ``trainer.devices`` as an int, a digit string (what
``--trainer.devices 2`` parses to), ``auto``, -1, a list or ``"0,1"``; ``num_query_groups``,
``rope_theta`` and ``rope_scaling`` (values and keys); ``predict`` at c > 1; ``generate
--tensor_parallel_size`` with the t the model allows; a JSONL value that is not a string."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sp import ConfigError
from lightning_sp.cli import main as cli
from lightning_sp.cli.checks import device_count
from lightning_sp.data.sources import _load_entry
from lightning_sp.model.ops import RopeScaling

from cli_runs import TINY
from models import tiny_config

LAYOUT_3 = (
    "world size 3 is not divisible by tensor_parallel_size * pipeline_parallel_size = 2 * 1 = "
    "2; t * p must be one of [1, 3]"
)


def _main_error(args: list[str], tmp_path: Path) -> str:
    """``cli.main``'s ConfigError (what ``cli.run`` prints as its one line)."""
    with pytest.raises(ConfigError) as error:
        cli.main([*args, "--trainer.default_root_dir", str(tmp_path)])
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("devices", "accelerator", "count"),
    [(2, "cpu", 2), ("2", "cpu", 2), (" 3 ", "cpu", 3), ("auto", "cpu", 1), (-1, "cpu", 1),
     ("-1", "cpu", 1), ([0, 1], "gpu", 2), ("0,1", "cuda", 2), ("1, 3", "gpu", 2)],
)  # fmt: skip
def test_device_count_of_every_form(devices: object, accelerator: str, count: int) -> None:
    assert device_count(devices, accelerator) == count


@pytest.mark.parametrize(
    ("devices", "expected"),
    [(0, "trainer.devices=0 must be a positive integer, -1 or auto"),
     (True, "trainer.devices=True is not a device count; valid: a positive integer or auto"),
     ("two", "trainer.devices='two' is not a device count; valid: a positive integer, auto, or "
      "a list of GPU indices such as 0,1"),
     ([0, 1], "trainer.devices=[0, 1] lists device indices, which the CPU accelerator does not "
      "take; give a count (trainer.devices=2)")],
)  # fmt: skip
def test_device_count_refusals(devices: object, expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        device_count(devices, "cpu")
    assert str(error.value) == expected


CLI_CASES = [
    (["--trainer.devices", "3"], LAYOUT_3),  # the string '3': checked as 3
    (["--trainer.devices", "0,1"], "trainer.devices='0,1' lists device indices, which the CPU "
     "accelerator does not take; give a count (trainer.devices=2)"),
    (["--model.config.num_query_groups", "0"], "num_query_groups=0 must be a positive integer "
     "dividing num_heads=8 (one of [1, 2, 4, 8]), or null for multi-head attention"),
    (["--trainer.gradient_clip_val", "-1"], "trainer.gradient_clip_val=-1 must be a finite "
     "number >= 0 (0 or null: no clipping)"),
    pytest.param(["--trainer.devices", "auto"], "world size 1 is not divisible by "
                 "tensor_parallel_size * pipeline_parallel_size = 2 * 1 = 2; t * p must be one "
                 "of [1]", marks=pytest.mark.slow),
    pytest.param(["--model.config.rope_scaling", "{factor: 0}"],
                 "rope_scaling.factor=0.0 must be a positive number", marks=pytest.mark.slow),
]  # fmt: skip


CLI_IDS = ["devices-3", "devices-0,1", "groups-0", "clip-negative", "devices-auto", "factor"]


@pytest.mark.parametrize(("args", "expected"), CLI_CASES, ids=CLI_IDS)
def test_fit_fields_in_every_form_refused_before_launch(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    assert _main_error(["fit", "--config", TINY, *args], tmp_path) == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({"num_query_groups": 0}, "num_query_groups=0 must be a positive integer dividing "
      "num_heads=4 (one of [1, 2, 4]), or null for multi-head attention"),
     ({"position_embedding": "rope", "rope_theta": -10000.0},
      "rope_theta=-10000.0 must be a positive number (Llama 3: 500000)"),
     ({"rope_theta": float("nan")}, "rope_theta=nan must be a positive number (Llama 3: 500000)"),
     ({"rope_scaling": RopeScaling(factor=0.0)},
      "rope_scaling.factor=0.0 must be a positive number"),
     ({"rope_scaling": RopeScaling(low_freq_factor=4.0, high_freq_factor=4.0)},
      "rope_scaling.high_freq_factor=4.0 must be greater than rope_scaling.low_freq_factor=4.0 "
      "(Llama 3.1: 4 and 1)"),
     ({"rope_scaling": RopeScaling(original_max_position_embeddings=0)},
      "rope_scaling.original_max_position_embeddings=0 must be a positive integer")],
    ids=["groups-0", "theta", "theta-nan", "factor", "freqs", "context"],
)  # fmt: skip
def test_model_values_checked(fields: dict, expected: str) -> None:
    """What ``check_fit_config`` runs before launch (``GPTConfig.validate``)."""
    with pytest.raises(ConfigError) as error:
        tiny_config(**fields)
    assert str(error.value) == expected


def test_predict_with_context_parallelism_is_refused_before_launch(tmp_path: Path) -> None:
    args = ["predict", "--config", TINY, "--trainer.devices", "4",
            "--trainer.strategy.init_args.context_parallel_size", "2"]  # fmt: skip
    assert _main_error(args, tmp_path) == (
        "context_parallel_size=2: predict needs the whole model and sequence on each rank; "
        "predict with context_parallel_size=1"
    )


def test_generate_tensor_parallel_size_lists_the_t_the_model_allows(tmp_path: Path) -> None:
    """configs/tiny.yaml: hidden 256, 8 heads (no GQA): t in 1, 2, 4, 8, not every divisor of
    256."""
    with pytest.raises(ConfigError) as error:
        cli.main(["generate", "--config", TINY, "--ckpt_path", str(tmp_path), "--prompt", "x",
                  "--tensor_parallel_size", "3"])  # fmt: skip
    assert str(error.value) == (
        "tensor_parallel_size=3 does not fit the model (num_heads=8, num_query_groups=8, "
        "hidden_size=256); valid: 1, 2, 4, 8"
    )


def test_rope_scaling_unknown_key_lists_the_valid_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["fit", "--config", TINY, "--model.config.rope_scaling", "{facter: 2}"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: model.config.rope_scaling has no key 'facter'; valid: factor, low_freq_factor, "
        "high_freq_factor, original_max_position_embeddings, rope_type; did you mean 'factor'?"
    ]


@pytest.mark.parametrize(
    ("rows", "expected"),
    [('{"text": "a"}\n{"text": 5}\n', "line 2 holds an integer"),
     ('{"text": "a"}\n{"text": ["x"]}\n', "line 2 holds a list"),
     ('{"text": 5}\n{"text": 6}\n', "line 1 holds an integer")],
    ids=["mixed-int", "mixed-list", "all-int"],
)  # fmt: skip
def test_jsonl_value_not_a_string_names_file_row_and_type(
    tmp_path: Path, rows: str, expected: str
) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(rows)
    with pytest.raises(ConfigError) as error:
        _load_entry(str(path), "json", "text", str(tmp_path / "cache"))
    assert str(error.value) == (
        f"text_field='text': {path} {expected}, not a string; each document's text must be a string"
    )
