"""MoE settings a user gets wrong, each one line naming the field (issue 40), in process: a
wrong-typed ``moe`` value on the command line (not jsonargparse's ~500-character Union
report), ``expert_tensor_parallel_size`` checked before launch, ``init_from`` of another
routing (the YAML to set), and export of a routing no Hugging Face family holds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lightning as L
import pytest

from lightning_sp import ConfigError
from lightning_sp.cli import main as cli
from lightning_sp.interop.hf_config import check_config, write_config
from lightning_sp.interop.hf_types import model_type_for
from lightning_sp.model.moe.config import MoEConfig

from models import tiny_config

MOE = "configs/moe_tiny.yaml"
STRATEGY = "--trainer.strategy.init_args."


@pytest.mark.parametrize(
    ("args", "expected"),
    [(["router_dtype", "bf16"], "model.config.moe.router_dtype='bf16' must be one of fp32, fp64, "
      "input"),
     (["aux_loss_coef", "nan"], "model.config.moe.aux_loss_coef='nan' must be a finite number"),
     (["top_k", "two"], "model.config.moe.top_k='two' must be an integer"),
     (["capacity_factor", "x"], "model.config.moe.capacity_factor='x' must be a finite number or "
      "null")],
    ids=["router_dtype", "aux_nan", "top_k", "capacity"],
)  # fmt: skip
def test_wrong_typed_moe_value_is_one_line(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["fit", "--config", MOE, f"--model.config.moe.{args[0]}", args[1]])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {expected}"]


def test_expert_tensor_parallel_size_is_checked_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """t = 2 with the experts' f_e split over it: an odd f_e is refused before any rank
    starts (the pre-launch layout must carry ``expert_tensor_parallel_size``)."""

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            "fit launched: the pre-launch check dropped expert_tensor_parallel_size"
        )

    monkeypatch.setattr(L.Trainer, "fit", launched)
    with pytest.raises(ConfigError) as error:
        cli.main(["fit", "--config", MOE, "--trainer.devices", "2",
                  STRATEGY + "tensor_parallel_size", "2",
                  STRATEGY + "expert_tensor_parallel_size", "2",
                  STRATEGY + "expert_parallel_size", "1",
                  "--model.config.sequence_parallel", "true",
                  "--model.config.moe.expert_ffn_size", "127",
                  "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert str(error.value) == (
        "moe.expert_ffn_size=127 is not divisible by expert_tensor_parallel_size=2"
    ), "the pre-launch check dropped expert_tensor_parallel_size"


def _mixtral():  # type: ignore[no-untyped-def]
    return tiny_config(
        "mistral", feed_forward="moe", moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_size=32)
    )


def test_init_from_another_routing_says_the_yaml_to_set() -> None:
    config = _mixtral()
    table = model_type_for(config).config
    other = dataclasses.replace(config, moe=MoEConfig(num_experts=8, top_k=1, expert_ffn_size=32))
    with pytest.raises(ConfigError) as error:
        check_config(table, write_config(table, config), other, "init_from=hub/mixtral")
    assert str(error.value) == (
        "moe.num_experts=8, moe.top_k=1 does not match moe.num_experts=4, moe.top_k=2 of "
        "init_from=hub/mixtral; set moe: {num_experts: 4, top_k: 2}"
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({"score": "sigmoid", "expert_bias": True}, "moe.score='sigmoid', moe.expert_bias=True"),
     ({"num_shared_experts": 1}, "moe.num_shared_experts=1")],
    ids=["sigmoid-bias", "shared"],
)  # fmt: skip
@pytest.mark.parametrize("architecture", ["mistral", "qwen3"])
def test_export_of_a_routing_no_family_holds_is_one_short_line(
    architecture: str, fields: dict, expected: str
) -> None:
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=32, **fields)
    with pytest.raises(ConfigError) as error:
        model_type_for(tiny_config(architecture, feed_forward="moe", moe=moe))
    assert str(error.value) == (
        f"no Hugging Face family we export holds {expected} (mixtral, qwen3_moe, olmoe do not)"
    )
