"""A checkpoint loads only into the architecture it was trained with (issue 32, item 1; issue 39,
item 3): a model that differs in any field of its architecture record
(:attr:`lightning_sp.model.config.GPTConfig.architecture`, the MoE shape included) is refused
in one line naming each differing field with both values, before launch (``fit --ckpt_path``,
``generate``) and in every rank's load (``Checkpointer.load``, which ``fit``, ``validate``,
``predict`` and ``generate`` go through); so is a checkpoint tensor the model lacks. What may
change on resume (recompute, attention backend, dropout, SP, seed) still loads the same
weights and optimizer state, bit for bit, and gives the same loss; so do an MoE model's
training settings (auxiliary-loss coefficients, capacity, router dtype, bias update rate). In
process, one process."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from lightning_sp import GPT, ConfigError, GPTConfig, ParallelState
from lightning_sp.checkpoint import Checkpointer, Meta
from lightning_sp.checkpoint.verify import check_checkpoint
from lightning_sp.cli import main as cli
from lightning_sp.model.architecture import Architecture
from lightning_sp.model.moe.config import MoEArchitecture, MoEConfig, MoETraining
from lightning_sp.model.run_settings import RunSettings
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.parallel.config import ParallelConfig

from cli_runs import TINY
from models import batch, loss_and_grads

TRAINED = dict(vocab_size=257, seq_length=16, hidden_size=32, num_layers=4, num_heads=8,
               hidden_dropout=0.0, attention_dropout=0.0, seed=3)  # fmt: skip
"""A GPT-2 style model of 4 layers and 8 heads (configs/tiny.yaml's, narrower)."""

SUFFIX = ": another architecture; load it with the checkpoint's values"


def _save(path: Path, config: GPTConfig) -> tuple[GPT, torch.optim.Optimizer]:
    """Train ``config`` one float64 step and save it (model and AdamW state) at ``path``."""
    model = GPT(config, ParallelState.single(), dtype=torch.float64)
    optimizer = build_adamw(model, 1e-2, 0.1, (0.9, 0.95), 1e-8)
    loss_and_grads(model, *batch(config))
    optimizer.step()
    meta = Meta(1, ParallelConfig(), config.values())
    Checkpointer().save(path, model, [optimizer], meta=meta, lightning_state={},
                        rng=("rng.pp0.dp0.tp0", None))  # fmt: skip
    return model, optimizer


def _load(path: Path, model: GPT, optimizers: list, config: GPTConfig) -> None:
    """``Checkpointer.load``, the load every rank runs, in one process."""
    fields = config.values()
    layout = ParallelConfig()
    Checkpointer().load(path, model, optimizers, layout=layout, model_config=fields,
                        rng_name="rng.pp0.dp0.tp0")  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT, torch.optim.Optimizer]:
    config = GPTConfig(**TRAINED)
    path = tmp_path_factory.mktemp("arch") / "last.ckpt"
    return (path, *_save(path, config))


def _refused(path: Path, config: GPTConfig, changed: object = "") -> str:
    try:
        check_checkpoint(str(path), config)
    except ConfigError as error:
        message = str(error)
    else:
        raise AssertionError(
            f"the resume check accepted a checkpoint trained with another {changed or 'config'} "
            "(a field of the architecture it does not compare)"
        )
    assert "\n" not in message
    return message


CASES = [
    ({"num_layers": 2}, "model.config.num_layers=2 but the checkpoint was trained with "
     "num_layers=4"),
    ({"num_heads": 4}, "model.config.num_heads=4 but the checkpoint was trained with num_heads=8"),
    ({"position_embedding": "rope"}, "model.config.position_embedding='rope' but the checkpoint "
     "was trained with position_embedding='learned'"),
    ({"normalization": "rmsnorm"}, "model.config.normalization='rmsnorm' but the checkpoint was "
     "trained with normalization='layernorm'"),
    ({"activation": "gelu_tanh"}, "model.config.activation='gelu_tanh' but the checkpoint was "
     "trained with activation='gelu'"),
    ({"num_query_groups": 2}, "model.config.num_query_groups=2 but the checkpoint was trained "
     "with num_query_groups=None"),
    ({"layernorm_eps": 1e-6}, "model.config.layernorm_eps=1e-06 but the checkpoint was trained "
     "with layernorm_eps=1e-05"),
    ({"num_layers": 2, "activation": "gelu_tanh"}, "model.config.num_layers=2 but the checkpoint "
     "was trained with num_layers=4; model.config.activation='gelu_tanh' but the checkpoint was "
     "trained with activation='gelu'"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "expected"), CASES, ids=[str(c) for c, _ in CASES])
def test_another_architecture_is_refused_in_one_line(saved, change, expected) -> None:
    path = saved[0]
    config = GPTConfig(**{**TRAINED, **change})
    assert _refused(path, config, change) == expected + SUFFIX


def test_every_load_refuses_it_too(saved) -> None:
    """The load every rank runs (fit, validate, predict, generate): the same line."""
    path = saved[0]
    config = GPTConfig(**{**TRAINED, "num_layers": 2})
    model = GPT(config, ParallelState.single(), dtype=torch.float64)
    with pytest.raises(ConfigError) as error:
        _load(path, model, [], config)
    assert str(error.value) == CASES[0][1] + SUFFIX


def test_a_checkpoint_tensor_the_model_lacks_is_refused(saved, tmp_path: Path) -> None:
    """A checkpoint whose meta.json says ``bias: false`` but holds biases: the first bias is
    named (meta.json is the one file without a checksum)."""
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(saved[0].resolve(), copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["model"]["bias"] = False
    (copy / "meta.json").write_text(json.dumps(meta))
    message = _refused(copy, GPTConfig(**{**TRAINED, "bias": False}))
    assert re.fullmatch(
        r"the checkpoint holds model\.\S+\.bias, which this model lacks; load it into the model "
        r"it was trained with",
        message,
    ), message


def test_fit_ckpt_path_refuses_before_launch(tmp_path: Path) -> None:
    """``cli.py fit --ckpt_path`` with configs/tiny.yaml's model (narrowed) at 2 layers, not 4."""
    config = GPTConfig(vocab_size=257, seq_length=16, hidden_size=32, num_layers=4,
                       num_heads=8, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    path = tmp_path / "tiny.ckpt"
    _save(path, config)
    with pytest.raises(ConfigError) as error:
        cli.main(["fit", "--config", TINY, "--ckpt_path", str(path),
                  "--model.config.num_layers", "2", "--model.config.hidden_size", "32",
                  "--model.config.seq_length", "16", "--trainer.devices", "2",
                  "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert str(error.value) == CASES[0][1] + SUFFIX


def test_what_may_change_on_resume_loads_exactly(saved) -> None:
    """Recompute, attention backend, dropout, SP, seed and (with RoPE) the sequence length are
    not architecture: the load gives the saved weights and Adam state bit for bit, and the same
    float64 loss under full recompute and SDPA as the saved model under selective / math."""
    path, trained, trained_optimizer = saved
    resumable = {f.name for f in dataclasses.fields(RunSettings)}
    assert {"recompute", "attention", "hidden_dropout", "sequence_parallel"} <= resumable
    changed = GPTConfig(**{**TRAINED, "recompute": "full", "attention": "sdpa", "seed": 11,
                           "sequence_parallel": True})  # fmt: skip
    assert changed.architecture == GPTConfig(**TRAINED).architecture
    check_checkpoint(str(path), changed)  # no error
    model = GPT(changed, ParallelState.single(), dtype=torch.float64)
    optimizer = build_adamw(model, 1e-2, 0.1, (0.9, 0.95), 1e-8)
    _load(path, model, [optimizer], changed)
    for (name, mine), theirs in zip(model.named_parameters(), trained.parameters(), strict=True):
        rows = changed.vocab_size if getattr(mine, "padded_vocab", False) else len(mine)
        same = torch.equal(mine[:rows], theirs[:rows])  # padding rows are not saved
        assert same, f"{name}: loaded weight differs from the saved one"
        a, b = optimizer.state[mine], trained_optimizer.state[theirs]
        assert torch.equal(a["exp_avg"][:rows], b["exp_avg"][:rows]), f"{name}: exp_avg differs"
    ids, labels = batch(changed, seed=1)
    assert loss_and_grads(model, ids, labels).item() == pytest.approx(
        loss_and_grads(trained, ids, labels).item(), rel=1e-12, abs=0
    )


def test_a_recorded_config_with_nested_settings_builds_their_records() -> None:
    """A checkpoint records its config as JSON values (``meta.json``: ``moe`` and
    ``rope_scaling`` as mappings); read back, they are a ``MoEConfig`` and a ``RopeScaling``
    again, so the model builds (``export`` of an MoE checkpoint failed on a dict before)."""
    from lightning_sp.checkpoint.verify import saved_config
    from lightning_sp.model.moe.config import MoEConfig
    from lightning_sp.model.ops import RopeScaling

    config = GPTConfig.of(
        "llama", vocab_size=64, seq_length=16, hidden_size=32, num_layers=1, num_heads=4,
        feed_forward="moe", moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_size=16),
        rope_scaling=RopeScaling(rope_type="linear", factor=2.0),
    )  # fmt: skip
    recorded = json.loads(json.dumps(dataclasses.asdict(config)))
    meta = Meta(step=1, layout=ParallelConfig(), model=recorded)
    back = saved_config(meta)
    assert back == config and isinstance(back.moe, MoEConfig)
    assert isinstance(back.rope_scaling, RopeScaling)
    GPT(back, ParallelState.single(), device="meta")


def test_every_field_is_architecture_or_run_setting() -> None:
    """``GPTConfig`` is its two records, flat: each field in exactly one of them (a field added
    later must say which it is), and so is ``MoEConfig``."""
    for whole, parts in ((GPTConfig, (Architecture, RunSettings)),
                         (MoEConfig, (MoEArchitecture, MoETraining))):  # fmt: skip
        names = [{f.name for f in dataclasses.fields(part)} for part in parts]
        assert not names[0] & names[1], f"{whole.__name__}: in both records: {names[0] & names[1]}"
        fields = {f.name for f in dataclasses.fields(whole)}
        assert fields == names[0] | names[1], (
            f"{whole.__name__}: in neither: {fields - names[0] - names[1]}"
        )


MOE = dict(vocab_size=64, seq_length=16, hidden_size=32, num_layers=2, num_heads=4,
           num_query_groups=2, seed=5, feed_forward="moe")  # fmt: skip
MOE_SHAPE = dict(num_experts=4, top_k=2, expert_ffn_size=16, expert_bias=True)
"""A Llama-style mixture of experts: 4 experts of width 16, top-2, with the choice bias."""


def _moe(**training: object) -> GPTConfig:
    return GPTConfig.of("llama", **MOE, moe=MoEConfig(**MOE_SHAPE, **training))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT, torch.optim.Optimizer]:
    path = tmp_path_factory.mktemp("moe") / "last.ckpt"
    return (path, *_save(path, _moe(aux_loss_coef=0.01)))


MOE_TRAINING = [
    {"aux_loss_coef": 0.1, "z_loss_coef": 0.001},
    {"capacity_factor": 1.5},
    {"router_dtype": "fp64"},
    {"bias_update_rate": 0.01},
]


@pytest.mark.parametrize("training", MOE_TRAINING, ids=[",".join(t) for t in MOE_TRAINING])
def test_moe_training_settings_may_change_on_resume(saved_moe, training: dict) -> None:
    """Issue 39: a changed MoE training setting was refused as "another architecture". It now
    loads the saved weights, choice biases and Adam state bit for bit, and the loaded model
    gives the float64 loss and gradients of the trained weights under the new settings."""
    path, trained, trained_optimizer = saved_moe
    changed = _moe(**training)
    assert changed.architecture == _moe().architecture
    check_checkpoint(str(path), changed)  # no error
    model = GPT(changed, ParallelState.single(), dtype=torch.float64)
    optimizer = build_adamw(model, 1e-2, 0.1, (0.9, 0.95), 1e-8)
    _load(path, model, [optimizer], changed)
    for (name, mine), theirs in zip(model.named_parameters(), trained.parameters(), strict=True):
        rows = changed.vocab_size if getattr(mine, "padded_vocab", False) else len(mine)
        assert torch.equal(mine[:rows], theirs[:rows]), f"{name}: loaded weight differs"
        a, b = optimizer.state[mine], trained_optimizer.state[theirs]
        assert torch.equal(a["exp_avg"][:rows], b["exp_avg"][:rows]), f"{name}: exp_avg differs"
    for (name, mine), theirs in zip(model.named_buffers(), trained.buffers(), strict=True):
        if "expert_bias" in name:
            assert torch.equal(mine, theirs), f"{name}: loaded choice bias differs"
    reference = GPT(changed, ParallelState.single(), dtype=torch.float64)
    reference.load_state_dict(trained.state_dict())
    ids, labels = batch(changed, seed=1)
    assert torch.equal(loss_and_grads(model, ids, labels), loss_and_grads(reference, ids, labels))
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad), f"{name}: gradient differs after the load"


MOE_SHAPES = [
    ({"num_experts": 8}, "model.config.moe.num_experts=8 but the checkpoint was trained with "
     "moe.num_experts=4"),
    ({"top_k": 1}, "model.config.moe.top_k=1 but the checkpoint was trained with moe.top_k=2"),
    ({"expert_ffn_size": 8}, "model.config.moe.expert_ffn_size=8 but the checkpoint was trained "
     "with moe.expert_ffn_size=16"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "expected"), MOE_SHAPES, ids=[str(c) for c, _ in MOE_SHAPES])
def test_another_moe_shape_is_refused_in_one_line(saved_moe, change, expected) -> None:
    """Issue 39: a changed ``moe.top_k`` was accepted silently (the check skipped ``moe``). The
    MoE shape is part of the architecture record: one line naming the dotted field."""
    config = GPTConfig.of("llama", **MOE, moe=MoEConfig(**{**MOE_SHAPE, **change}))  # type: ignore[arg-type]
    message = _refused(saved_moe[0], config, f"moe ({change})")
    assert message == expected + SUFFIX
    model = GPT(config, ParallelState.single(), dtype=torch.float64)
    with pytest.raises(ConfigError) as error:  # the load every rank runs: the same line
        _load(saved_moe[0], model, [], config)
    assert str(error.value) == expected + SUFFIX
