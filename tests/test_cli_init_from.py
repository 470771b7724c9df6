"""``model.init_from: DIR`` with no sizes (lightning_sp.cli.init_from): the architecture fields
a config does not state come from ``DIR/config.json`` (a Qwen3 and a Mixtral saved by
transformers), stated ones must equal it (one line), run settings are never read from it;
``estimate`` prices the resolved model; ``cli.py fit`` trains a saved Qwen3 directory from a
config that names no size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from hf_families import save_random_family
from jsonargparse import Namespace

from lightning_sp.cli.estimate import read_estimate_args
from lightning_sp.cli.init_from import resolve_init_from
from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import read_hf_config
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.moe.config import MoEConfig

from cli_runs import CLI, error_lines, run

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3") / "base"
    save_random_family(directory, "qwen3")
    return directory


def _parsed(directory: Path, **stated: object) -> Namespace:
    """The ``model`` section as the parser gives it: every ``GPTConfig`` field at its default,
    overridden by ``stated``."""
    config = Namespace(**{**GPTConfig().values(), "moe": None, "rope_scaling": None, **stated})
    return Namespace(init_from=str(directory), config=config)


def test_unstated_architecture_comes_from_the_directory(qwen3: Path) -> None:
    model = _parsed(qwen3, seq_length=32, recompute="full")
    resolve_init_from(model, {"seq_length", "recompute"})
    ours = GPTConfig.from_values(model.config)
    theirs = read_hf_config(qwen3)
    assert ours.architecture == theirs.architecture, ours.architecture.differences(
        theirs.architecture
    )
    assert ours.hf_model_type == "qwen3", "the directory's model type is not kept for export"
    # run settings: as stated, or GPTConfig's defaults; never the directory's (its family has
    # no dropout, its position table is 64 long)
    assert (ours.seq_length, ours.recompute.value) == (32, "full"), "a stated run setting changed"
    default = GPTConfig()
    assert (ours.hidden_dropout, ours.attention_dropout, ours.sequence_parallel) == (
        default.hidden_dropout, default.attention_dropout, default.sequence_parallel,
    ), "a run setting was read from the directory"  # fmt: skip


def test_a_stated_size_must_match_the_directory(qwen3: Path) -> None:
    theirs = read_hf_config(qwen3)
    model = _parsed(qwen3, seq_length=32, num_layers=theirs.num_layers + 1)
    with pytest.raises(ConfigError) as error:
        resolve_init_from(model, {"seq_length", "num_layers"})
    line = str(error.value)
    assert "\n" not in line and f"num_layers={theirs.num_layers + 1}" in line, line
    assert f"set num_layers: {theirs.num_layers}" in line, line
    # stating the directory's own value (the same as the default or not) is fine
    model = _parsed(qwen3, seq_length=32, num_layers=theirs.num_layers, kv_channels=12)
    resolve_init_from(model, {"seq_length", "num_layers", "kv_channels"})
    # a default value stated is still stated: GPT-2's layernorm is checked, not replaced
    model = _parsed(qwen3, seq_length=32, normalization="layernorm")
    with pytest.raises(ConfigError, match="normalization='layernorm' does not match"):
        resolve_init_from(model, {"seq_length", "normalization"})


def test_moe_shape_from_the_directory_training_settings_as_stated(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=64, intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path)
    stated_moe = Namespace(**{**dataclasses.asdict(MoEConfig()), "capacity_factor": 2.0})
    model = _parsed(tmp_path, seq_length=32, moe=stated_moe)
    resolve_init_from(model, {"seq_length", "moe.capacity_factor"})
    ours = GPTConfig.from_values(model.config)
    assert ours.architecture == read_hf_config(tmp_path).architecture
    assert ours.moe is not None and (ours.moe.num_experts, ours.moe.capacity_factor) == (4, 2.0)


def test_estimate_prices_the_directory_s_model(qwen3: Path, tmp_path: Path) -> None:
    """A config file with run settings only and ``--model.init_from`` on the command line:
    stated keys are read from both; the planner's layout holds the directory's model."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "devices": 1},
        "model": {"config": {"seq_length": 32, "hidden_dropout": 0.0}},
        "data": {"batch_size": 2},
    }))  # fmt: skip
    parsed = read_estimate_args(
        ["--config", str(path), "--model.init_from", str(qwen3), "--formula_only", "true"]
    )
    config = parsed.layout.config
    assert config.architecture == read_hf_config(qwen3).architecture, "estimate: not the dir's"
    assert (config.seq_length, config.hidden_dropout) == (32, 0.0), "stated run settings lost"
    with pytest.raises(ConfigError, match="hidden_size=96 does not match"):
        read_estimate_args(["--config", str(path), "--model.init_from", str(qwen3),
                            "--model.config.hidden_size", "96"])  # fmt: skip


@pytest.mark.slow
def test_fit_trains_a_saved_qwen3_from_a_config_without_sizes(qwen3: Path, tmp_path: Path) -> None:
    args = [CLI, "fit", "--model.init_from", str(qwen3), "--model.config.seq_length", "32",
            "--model.lora.r", "4", "--model.lora.target_modules", "[all-linear]",
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", "logs", "--data.batch_size", "2",
            "--data.max_documents", "20"]  # fmt: skip
    result = run(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (hparams,) = (tmp_path / "logs" / "csv").glob("version_*/hparams.yaml")
    saved = GPTConfig.from_values(yaml.safe_load(hparams.read_text())["config"])
    assert saved.architecture == read_hf_config(qwen3).architecture, "not the directory's model"
    (metrics,) = (tmp_path / "logs" / "csv").glob("version_*/metrics.csv")
    losses = [row for row in metrics.read_text().splitlines()[1:] if row.split(",")[-1]]
    assert len(losses) == 2, f"expected 2 logged steps: {metrics.read_text()}"

    (tmp_path / "wrong").mkdir()
    wrong = run([*args, "--model.config.num_layers", "3"], tmp_path / "wrong")
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr[-2000:]
    errors = error_lines(wrong.stderr)
    assert len(errors) == 1 and "num_layers=3 does not match" in errors[0], wrong.stderr[-2000:]


@pytest.mark.slow  # builds the demo's tokenizer and base (transformers)
def test_the_lora_chat_demo_is_the_sft_demo_with_adapters(tmp_path: Path) -> None:
    """``configs/llama_lora_tiny.yaml`` names no size (its model is ``examples/
    sft_tiny_setup.py``'s base, read from init_from), trains r = 8 adapters on every linear, and
    reads the SFT demo's data as ``configs/llama_sft_tiny.yaml`` does."""
    import importlib.util

    from lightning_sp.model.lora import LoRAConfig

    from cli_runs import ROOT

    spec = importlib.util.spec_from_file_location(
        "sft_setup", ROOT / "examples" / "sft_tiny_setup.py"
    )
    assert spec is not None and spec.loader is not None
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    setup.main(tmp_path / "sft")
    path = ROOT / "configs" / "llama_lora_tiny.yaml"
    demo, sft = (yaml.safe_load((ROOT / "configs" / name).read_text())
                 for name in ("llama_lora_tiny.yaml", "llama_sft_tiny.yaml"))  # fmt: skip
    stated = set(demo["model"]["config"])
    assert stated <= {"seq_length", "hidden_dropout", "attention_dropout", "recompute"}, stated
    assert demo["data"] == sft["data"] and demo["model"]["init_from"] == sft["model"]["init_from"]
    parsed = read_estimate_args(
        ["--config", str(path), "--model.init_from", str(tmp_path / "sft" / "base"),
         "--formula_only", "true"]
    )  # fmt: skip
    assert parsed.lora == LoRAConfig(r=8, lora_alpha=16, target_modules=["all-linear"])
    wanted = read_hf_config(tmp_path / "sft" / "base").architecture
    assert parsed.layout.config.architecture == wanted, "not the SFT demo's base"
