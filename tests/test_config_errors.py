"""Each bad input fails before any work, with one line naming the field, value and what is valid."""

from __future__ import annotations

import os
import re

import pytest
import torch

from lightning_sp import GPT, ConfigError, GPTConfig, MegatronSPStrategy, ParallelState
from lightning_sp.data import TextDataModule
from lightning_sp.errors import positive_int
from lightning_sp.model.config_checks import check_model_layout
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.pipeline import check_batch

from models import check_layout, tiny_config


def _state(t: int) -> ParallelState:
    return ParallelState(t, 1, 1, 0, 0, 0, None, None, None, torch.device("cpu"))


def _raises(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_heads_not_divisible_by_tp() -> None:
    config = tiny_config(hidden_size=96, num_heads=6)
    message = _raises(
        r"num_heads=6 is not divisible by tensor_parallel_size=4",
        check_model_layout,
        config,
        ParallelConfig(tensor_parallel_size=4),
    )
    assert "[1, 2, 3, 6]" in message


def test_hidden_not_divisible_by_tp() -> None:
    config = tiny_config(hidden_size=100, num_heads=4)
    message = _raises(
        r"hidden_size=100 is not divisible by tensor_parallel_size=8",
        check_model_layout,
        config,
        ParallelConfig(tensor_parallel_size=8),
    )
    assert "[1, 2, 4, 5, 10, 20, 25, 50, 100]" in message


def test_hidden_not_divisible_by_heads() -> None:
    _raises(r"hidden_size=32 is not divisible by num_heads=5", tiny_config, num_heads=5)


def test_sequence_not_divisible_by_tp_under_sequence_parallel() -> None:
    config = tiny_config(seq_length=18, sequence_parallel=True)
    message = _raises(
        r"seq_length=18 is not divisible by tensor_parallel_size=4",
        check_model_layout,
        config,
        ParallelConfig(tensor_parallel_size=4),
    )
    assert "sequence_parallel=False" in message
    GPT(tiny_config(seq_length=18, sequence_parallel=False), _state(1))  # fine without SP


def test_unknown_recompute_policy() -> None:
    message = _raises(r"recompute='partial'", tiny_config, recompute="partial")
    assert "none, selective, lean, full" in message
    message = _raises(
        r"recompute=\['core_attn', 'gelu'\]: 'gelu' is not a recompute module",
        tiny_config, recompute=["core_attn", "gelu"],
    )  # fmt: skip
    assert "core_attn, layernorm, mlp_act, residual_mask" in message
    assert "\n" not in message


def test_unknown_attention_backend() -> None:
    message = _raises(r"attention='flash' is not", tiny_config, attention="flash")
    assert "valid: math, sdpa" in message and "\n" not in message


def test_recompute_module_lists_build_the_layers_they_name() -> None:
    model = GPT(tiny_config(recompute=["mlp_act", "layernorm"]), _state(1))
    layer = model.layers[0]
    assert layer.recompute == "layernorm+mlp_act"
    policy, backend = layer.recompute, layer.attention_backend
    assert tuple(policy.acts(m, backend) for m in ("layernorm", "mlp_act", "residual_mask")) == (
        True,
        True,
        False,
    )
    assert not layer.attention.recompute_core
    sdpa = GPT(tiny_config(recompute="lean", attention="sdpa"), _state(1)).layers[0]
    assert sdpa.recompute == "lean" and not sdpa.attention.recompute_core  # nothing to drop


def test_world_size_not_divisible_by_model_parallel_size() -> None:
    message = _raises(r"world size 6 is not divisible by .* = 4", check_layout, 6, 2, 2)
    assert "[1, 2, 3, 6]" in message


def test_non_positive_sizes() -> None:
    _raises(r"tensor_parallel_size=0 must be a positive integer", check_layout, 4, 0, 1)
    _raises(r"num_layers=0 must be a positive integer", GPTConfig, num_layers=0)
    _raises(r"hidden_dropout=1.0 must be in \[0, 1\)", GPTConfig, hidden_dropout=1.0)


@pytest.mark.parametrize("value", [True, False, 0, -1, 2.0, "2", None])
def test_every_size_check_rejects_what_is_not_a_positive_int(value: object) -> None:
    """One validator (``errors.positive_int``) behind every size: ``True`` is not 1."""
    message = f"={value!r} must be a positive integer"
    assert _raises(re.escape(message), positive_int, "size", value) == f"size{message}"
    _raises(re.escape(f"num_layers{message}"), GPTConfig, num_layers=value)
    _raises(re.escape(f"tensor_parallel_size{message}"), check_layout, 4, value, 1)
    _raises(re.escape(f"num_microbatches{message}"), check_batch, 8, value)
    _raises(re.escape(f"batch_size{message}"), TextDataModule, batch_size=value)
    _raises(
        re.escape(f"pipeline_parallel_size{message}"),
        MegatronSPStrategy,
        pipeline_parallel_size=value,
    )
    assert positive_int("size", 3) == 3


def test_input_longer_than_positions() -> None:
    model = GPT(tiny_config(), ParallelState.single())
    ids = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(ValueError, match="input sequence length 17 exceeds seq_length=16"):
        model(ids, ids)


def test_auto_recompute_must_be_resolved_before_building() -> None:
    _raises(r"recompute='auto' must be resolved", GPT, tiny_config(recompute="auto"), _state(1))


def test_module_resolves_auto_recompute() -> None:
    from lightning_sp import GPTModule

    module = GPTModule(tiny_config(recompute="auto"))
    module.configure_model()  # a tiny model fits an 80 GB device: no recomputation at all
    assert [layer.recompute for layer in module.chunks[0].layers] == ["none", "none"]
    # resolved once: what the module, its hyperparameters (hparams.yaml) and the checkpoint's
    # model config report is the policy that runs, not "auto"
    assert module.config.recompute == "none"
    assert module.hparams["config"]["recompute"] == "none"
    assert module.hparams_initial["config"]["recompute"] == "none"  # what loggers write


def test_recompute_num_layers_mixes_full_and_selective() -> None:
    model = GPT(tiny_config(num_layers=3, recompute="full", recompute_num_layers=2), _state(1))
    assert [layer.recompute for layer in model.layers] == ["full", "full", "selective"]
    assert [layer.attention.recompute_core for layer in model.layers] == [False, False, True]


@pytest.mark.parametrize(
    ("rest", "name", "core", "masks"),
    [("none", "none", False, False), ("lean", "lean", True, True),
     (["mlp_act", "core_attn"], "core_attn+mlp_act", True, False)],
)  # fmt: skip
def test_recompute_rest_builds_the_layers_beyond_recompute_num_layers(
    rest: object, name: str, core: bool, masks: bool
) -> None:
    config = tiny_config(num_layers=3, recompute="full", recompute_num_layers=1)
    config.recompute_rest = rest  # type: ignore[assignment]
    model = GPT(config, _state(1))
    assert [layer.recompute for layer in model.layers] == ["full", name, name]
    assert [layer.attention.recompute_core for layer in model.layers] == [False, core, core]
    regenerated = [layer.recompute.acts("residual_mask", "math") for layer in model.layers]
    assert regenerated == [False, masks, masks]


def test_recompute_rest_is_ignored_without_a_split() -> None:
    for config in (
        tiny_config(recompute="selective", recompute_rest="lean"),
        tiny_config(recompute="full", recompute_rest="none"),  # every layer full
    ):
        model = GPT(config, _state(1))
        assert [layer.recompute for layer in model.layers] == [config.recompute] * 2


REST_CASES = [
    ("full", "recompute_rest='full' cannot be what the layers beyond recompute_num_layers run; "
     "valid: none, selective, lean or a list of core_attn, layernorm, mlp_act, residual_mask"),
    ("auto", "recompute_rest='auto' cannot be what the layers beyond recompute_num_layers run; "
     "valid: none, selective, lean or a list of"),
    ("partial", "recompute_rest='partial' is not a recompute policy; valid: none, selective, "
     "lean or a list of core_attn"),
    (["core_attn", "gelu"], "recompute_rest=['core_attn', 'gelu']: 'gelu' is not a recompute "
     "module; valid modules: core_attn, layernorm, mlp_act, residual_mask"),
]  # fmt: skip


@pytest.mark.parametrize(("rest", "message"), REST_CASES)
def test_bad_recompute_rest(rest: object, message: str) -> None:
    fields = {"recompute": "full", "recompute_num_layers": 1, "recompute_rest": rest}
    _raises(re.escape(message), tiny_config, **fields)  # parsed once, when the config is built
    config = tiny_config(recompute="full", recompute_num_layers=1)
    with pytest.raises(ConfigError, match=re.escape(message)):  # and whenever it is set
        config.recompute_rest = rest


# -- the README's table of bad inputs: each check in-process, through the function cli.py runs
# before any process starts (tests/test_cli.py runs a few through `python cli.py` itself)

from lightning_sp.checkpoint.verify import check_checkpoint  # noqa: E402
from lightning_sp.optim.adamw import OptimizerConfig  # noqa: E402
from lightning_sp.training import checks as validation  # noqa: E402

STRATEGY_CASES = [  # (strategy arguments, the field named in the one line)
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be a positive integer"),
    ({"pipeline_parallel_size": -1}, "pipeline_parallel_size=-1 must be a positive integer"),
    ({"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "num_microbatches": 3},
     "num_microbatches=3 is not a multiple of pipeline_parallel_size=2"),
    ({"num_microbatches": 2}, "num_microbatches=2 splits a step over pipeline stages"),
    ({"virtual_pipeline_size": 2}, "virtual_pipeline_size=2 interleaves"),
    ({"start_method": "fork"}, "start_method='fork' is not one of popen, spawn"),
    ({"process_group_backend": "mpi"}, "process_group_backend='mpi' is not one of gloo, nccl"),
    ({"timeout": 0}, "timeout=0 must be a positive number"),
    ({"nonfinite": "ignore"}, "nonfinite='ignore' is not one of stop, skip"),
    ({"max_skipped_steps": -1}, "max_skipped_steps=-1 must be a non-negative integer"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), STRATEGY_CASES)
def test_strategy_arguments(args: dict, message: str) -> None:
    from lightning_sp import MegatronSPStrategy

    _raises(re.escape(message), validation.check_strategy_args, **args)
    _raises(re.escape(message), MegatronSPStrategy, **args)  # the constructor says the same


@pytest.mark.parametrize("value", [True, False, None, "yes"])
def test_sequence_parallel_is_set_in_one_place(value: object) -> None:
    """Sequence parallelism is the model config's (``model.config.sequence_parallel``): the
    strategy argument it once also was is refused, whatever its value, in one line saying
    where it moved (the constructor, the checks ``cli.py`` runs and the CLI's parser alike:
    tests/test_cli.py)."""
    import dataclasses

    message = (
        "trainer.strategy.init_args.sequence_parallel is no longer a strategy argument: it "
        "moved to model.config.sequence_parallel; set it there"
    )
    _raises(f"^{re.escape(message)}$", validation.check_strategy_args, sequence_parallel=value)
    _raises(f"^{re.escape(message)}$", MegatronSPStrategy, sequence_parallel=value)
    assert "sequence_parallel" not in {f.name for f in dataclasses.fields(ParallelConfig)}


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "16-true"])
def test_unsupported_precision(precision: str) -> None:
    message = _raises(
        f"trainer.precision='{precision}' is not supported", validation.check_precision, precision
    )
    assert "32-true, bf16-true, 64-true" in message


OPTIMIZER_CASES = [
    ({"lr": -1e-3}, "model.optimizer.lr=-0.001 must be a finite number >= 0"),
    ({"lr": float("nan")}, "model.optimizer.lr=nan must be a finite number"),
    ({"beta2": 1.0}, "model.optimizer.beta2=1.0 must be in [0, 1)"),
    ({"eps": 0.0}, "model.optimizer.eps=0 must be > 0"),
    ({"lr": 1e-4, "min_lr": 1e-3}, "model.optimizer.min_lr=0.001 exceeds model.optimizer.lr"),
    ({"warmup_steps": -5}, "model.optimizer.warmup_steps=-5 must be >= 0"),
    ({"decay_steps": 0}, "model.optimizer.decay_steps=0 must be a positive integer"),
]


@pytest.mark.parametrize(("fields", "message"), OPTIMIZER_CASES)
def test_optimizer_values(fields: dict, message: str) -> None:
    from lightning_sp import GPTModule

    _raises(re.escape(message), validation.check_optimizer, OptimizerConfig(**fields))
    _raises(re.escape(message), GPTModule, tiny_config(), OptimizerConfig(**fields))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """A real checkpoint of the tiny model (one process) and its config."""
    import dataclasses

    from lightning_sp.checkpoint import Checkpointer, Meta
    from lightning_sp.optim.adamw import build_adamw
    from lightning_sp.parallel.config import ParallelConfig

    config = tiny_config()
    model = GPT(config, ParallelState.single())
    optimizer = build_adamw(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    path = tmp_path_factory.mktemp("saved") / "last.ckpt"
    meta = Meta(0, ParallelConfig(), dataclasses.asdict(config))
    Checkpointer().save(path, model, [optimizer], meta=meta, lightning_state={},
                        rng=("rng.pp0.dp0.tp0", None))  # fmt: skip
    return path, config


def _copy(path, tmp_path):
    import shutil

    target = tmp_path / "copy.ckpt"
    shutil.copytree(path.resolve(), target)
    return target


def test_checkpoint_missing(saved, tmp_path) -> None:
    _raises(r"ckpt_path='.*nothing' does not exist", check_checkpoint,
            str(tmp_path / "nothing"), saved[1])  # fmt: skip


def test_checkpoint_is_a_file(saved, tmp_path) -> None:
    (tmp_path / "x.ckpt").write_text("")
    _raises(r"is a file; a checkpoint is a directory", check_checkpoint,
            str(tmp_path / "x.ckpt"), saved[1])  # fmt: skip


def test_checkpoint_truncated_file_is_named(saved, tmp_path) -> None:
    copy = _copy(saved[0], tmp_path)
    shard = sorted(copy.glob("*.distcp"))[0]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    _raises(rf"file {shard} is truncated or corrupt", check_checkpoint, str(copy), saved[1])


def test_checkpoint_missing_file_is_named(saved, tmp_path) -> None:
    """A data file ``meta.json`` lists but the directory lacks (a shard lost in a copy) is
    named before anything loads, not read as a checkpoint without it."""
    copy = _copy(saved[0], tmp_path)
    shard = sorted(copy.glob("*.distcp"))[0]
    shard.unlink()
    try:
        check_checkpoint(str(copy), saved[1])
    except ConfigError as error:
        assert str(error).endswith(f"file {shard} is missing"), error
        return
    pytest.fail(f"check_checkpoint accepted a checkpoint whose data file {shard.name} is missing")


def test_checkpoint_folder_copied_whole_reads_its_own_data(saved, tmp_path) -> None:
    """A checkpoint folder copied (or moved) whole, links as links, is a checkpoint of its
    own: its name links to the data beside it (a relative link), not to the original's."""
    import shutil

    folder = tmp_path / "copied"
    shutil.copytree(saved[0].parent, folder, symlinks=True)
    name = folder / saved[0].name
    target = name.resolve()
    assert target.parent == folder.resolve(), (
        f"{name} links to {os.readlink(name)}, outside its folder: the checkpoint name is an "
        "absolute link; a copied or moved checkpoint folder reads (or loses) the original's data"
    )
    check_checkpoint(str(name), saved[1])


def test_checkpoint_corrupt_metadata_is_named(saved, tmp_path) -> None:
    copy = _copy(saved[0], tmp_path)
    (copy / "meta.json").write_text("{not json")
    _raises(r"meta.json is corrupt", check_checkpoint, str(copy), saved[1])


def test_checkpoint_incomplete(saved, tmp_path) -> None:
    copy = _copy(saved[0], tmp_path)
    (copy / ".metadata").unlink()
    _raises(r"not a complete checkpoint: .metadata is missing", check_checkpoint,
            str(copy), saved[1])  # fmt: skip


def test_checkpoint_of_another_model_names_both_values(saved) -> None:
    path, config = saved
    import dataclasses

    other = dataclasses.replace(config, hidden_size=64)
    _raises(r"model.config.hidden_size=64 but the checkpoint was trained with hidden_size=32",
            check_checkpoint, str(path), other)  # fmt: skip


def test_unknown_activation() -> None:
    _raises(r"activation='relu' is not an activation; valid: gelu, gelu_tanh",
            tiny_config, activation="relu")  # fmt: skip


# -- every float setting checked finite and in range when the config is built (issue 40, 3-4)

from lightning_sp.model.moe.config import MoEConfig  # noqa: E402

FLOAT_CASES = [
    ({"hidden_dropout": float("nan")}, "hidden_dropout=nan must be in [0, 1)"),
    ({"attention_dropout": -0.1}, "attention_dropout=-0.1 must be in [0, 1)"),
    ({"init_std": float("inf")}, "init_std=inf must be a finite number >= 0"),
    ({"layernorm_eps": 0.0}, "layernorm_eps=0.0 must be a finite number > 0"),
    ({"rope_theta": float("inf")}, "rope_theta=inf must be a positive number (Llama 3: 500000)"),
    ({"moe": {"aux_loss_coef": float("nan")}},
     "moe.aux_loss_coef=nan must be a finite number >= 0"),
    ({"moe": {"z_loss_coef": -1.0}}, "moe.z_loss_coef=-1.0 must be a finite number >= 0"),
    ({"moe": {"bias_update_rate": float("inf")}},
     "moe.bias_update_rate=inf must be a finite number >= 0"),
    ({"moe": {"capacity_factor": float("nan")}},
     "moe.capacity_factor=nan must be > 0 and finite (or null: dropless)"),
    ({"moe": {"shared_expert_ffn_size": 64}}, "moe.shared_expert_ffn_size=64 is given with "
     "moe.num_shared_experts=0; set num_shared_experts >= 1 or leave it null"),
    ({"moe": {"num_shared_experts": 1, "shared_expert_ffn_size": -8}},
     "moe.shared_expert_ffn_size=-8 must be a positive integer"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "message"), FLOAT_CASES, ids=[str(f) for f, _ in FLOAT_CASES])
def test_float_settings_are_checked_when_built(fields: dict, message: str) -> None:
    """A NaN ``aux_loss_coef`` trained as if it were 0 (the router builds the loss's graph only
    for a coefficient > 0, and ``nan > 0`` is false); now every float setting is refused when
    the config is built, from a YAML mapping (``from_values``) as from Python."""
    assert _raises(re.escape(message), GPTConfig.from_values, fields) == message
    if "moe" in fields:
        assert _raises(re.escape(message), MoEConfig, **fields["moe"]) == message


def test_force_balanced_is_refused_in_fit(tmp_path) -> None:
    """``moe.force_balanced`` routes for measurements only: ``fit`` refuses it before launch,
    and so does a module fitted from Python (``GPTModule.on_fit_start``)."""
    from lightning_sp import GPTModule
    from lightning_sp.cli import main as cli

    from cli_runs import ROOT

    message = _raises(
        r"^moe.force_balanced=True routes every token to fixed experts", cli.main,
        ["fit", "--config", str(ROOT / "configs" / "moe_tiny.yaml"),
         "--model.config.moe.force_balanced", "true", "--trainer.default_root_dir", str(tmp_path)],
    )  # fmt: skip
    assert message.endswith("fit with force_balanced: false")
    module = GPTModule(
        GPTConfig.of("llama", moe=MoEConfig(force_balanced=True), feed_forward="moe")
    )
    _raises(r"^moe.force_balanced=True", module.on_fit_start)


def test_moe_sft_with_accumulation_is_refused_before_launch(tmp_path) -> None:
    """Loss masks with auxiliary losses cannot accumulate batches (the step's token count
    scales the auxiliary losses before its first backward): ``fit`` refuses it before launch,
    not at the first step after both ranks started."""
    from lightning_sp.cli import main as cli

    from cli_runs import ROOT

    message = _raises(
        r"^trainer.accumulate_grad_batches=2 with per-token loss masks and auxiliary losses",
        cli.main,
        ["fit", "--config", str(ROOT / "configs" / "moe_tiny.yaml"), "--data.eod_mask_loss",
         "true", "--trainer.accumulate_grad_batches", "2",
         "--trainer.default_root_dir", str(tmp_path)],
    )  # fmt: skip
    assert message.endswith("or num_microbatches with pipeline parallelism)"), message


def test_expert_sizes_on_a_dense_model_are_refused_before_launch(tmp_path) -> None:
    """Issue 40: ``expert_parallel_size 2`` on a dense model trained without a word (the
    layout's expert sizes were read only by an MoE part). The one model x layout check
    refuses both expert sizes, so ``fit`` stops before launch with one line."""
    from lightning_sp.cli import main as cli

    from cli_runs import ROOT

    dense = tiny_config(num_heads=4, hidden_size=32)
    for name, layout in (
        ("expert_parallel_size", ParallelConfig(expert_parallel_size=2, data_parallel_size=2)),
        ("expert_tensor_parallel_size",
         ParallelConfig(tensor_parallel_size=2, expert_tensor_parallel_size=2)),
    ):  # fmt: skip
        try:
            check_model_layout(dense, layout)
        except ConfigError as error:
            message = str(error)
        else:
            raise AssertionError(f"a dense model took {name}=2 without a word (ignored)")
        assert message == (
            f"{name}=2 shares out the experts of a mixture-of-experts model, but "
            f"feed_forward='dense' has none; set {name}=1 (or feed_forward: moe)"
        ), f"a dense model took {name}=2 (ignored): {message}"
    message = _raises(
        r"^expert_parallel_size=2 shares out the experts", cli.main,
        ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
         "--trainer.strategy.init_args.tensor_parallel_size", "1",
         "--trainer.strategy.init_args.expert_parallel_size", "2",
         "--trainer.default_root_dir", str(tmp_path)],
    )  # fmt: skip
    assert message.endswith("set expert_parallel_size=1 (or feed_forward: moe)"), message
