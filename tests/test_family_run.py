"""Tiny runs end to end. A new family: ``configs/qwen3_tiny.yaml``'s model (Qwen3: query/key
norms per head, head dimension 48 != h/a) shrunk to seconds, trained 10 steps at t = 2 + SP
from the seeded init on byte-level data, exported by ``export_checkpoint`` (what ``cli.py
export`` runs): the directory loads in ``AutoModelForCausalLM`` as a ``Qwen3ForCausalLM`` and
gives the run's own loss on a held-out batch (fp32 run vs float64 transformers from the same
fp32 weights: relative 1e-6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from test_hf_export import assert_held_out_loss, fit_and_export
from test_interop_moe import float64_reference

from lightning_sp import GPTConfig, GPTModule, OptimizerConfig
from lightning_sp.model.config_checks import check_model_layout
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.parallel.config import ParallelConfig

from cli_runs import ROOT
from hf_models import SEQ, transformers


def qwen3_tiny(**overrides: object) -> GPTConfig:
    """``configs/qwen3_tiny.yaml``'s model config with ``overrides``."""
    raw = yaml.safe_load((ROOT / "configs" / "qwen3_tiny.yaml").read_text())
    return GPTConfig(**{**raw["model"]["config"], **overrides})  # type: ignore[arg-type]


def test_qwen3_tiny_config_is_a_qwen3() -> None:
    config = qwen3_tiny()
    check_model_layout(config, ParallelConfig(tensor_parallel_size=2))
    assert (config.qk_norm, config.head_dim, config.hf_model_type) == ("head", 48, "qwen3")


@pytest.mark.slow
def test_trained_qwen3_exported_gives_its_own_loss(tmp_path: Path, corpus: Path) -> None:
    config = qwen3_tiny(hidden_size=64, num_layers=2, ffn_hidden_size=96, kv_channels=12,
                        seq_length=SEQ, recompute="lean")  # fmt: skip
    module = GPTModule(config, OptimizerConfig(lr=1e-2, warmup_steps=1))
    _, out, saved = fit_and_export(tmp_path, corpus, module, {"tensor_parallel_size": 2})
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert_held_out_loss(model, saved)


def moe_tiny(**overrides: object) -> GPTConfig:
    """``configs/moe_tiny.yaml``'s model config with ``overrides`` (``moe`` merged)."""
    raw = yaml.safe_load((ROOT / "configs" / "moe_tiny.yaml").read_text())["model"]["config"]
    moe = MoEConfig(**{**raw.pop("moe"), **overrides.pop("moe", {})})  # type: ignore[arg-type]
    return GPTConfig(**{**raw, "moe": moe, **overrides})  # type: ignore[arg-type]


@pytest.mark.slow
def test_trained_moe_tiny_exported_gives_its_own_loss(tmp_path: Path, corpus: Path) -> None:
    """``configs/moe_tiny.yaml``'s model shrunk (8 experts, top-2), trained 10 steps with its
    experts shared out over 2 ranks (e = 2), exported: the directory loads as a
    ``MixtralForCausalLM`` and gives the run's own loss on a held-out batch."""
    config = moe_tiny(hidden_size=64, num_layers=2, num_heads=4, seq_length=SEQ,
                      moe={"expert_ffn_size": 32})  # fmt: skip
    module = GPTModule(config, OptimizerConfig(lr=1e-2, warmup_steps=1))
    _, out, saved = fit_and_export(tmp_path, corpus, module, {"expert_parallel_size": 2})
    model = float64_reference(transformers.AutoModelForCausalLM.from_pretrained(out))
    assert type(model).__name__ == "MixtralForCausalLM"
    assert_held_out_loss(model, saved)
