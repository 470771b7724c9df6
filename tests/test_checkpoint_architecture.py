"""A checkpoint loads only into the architecture it was trained with (issue 32, item 1): a
model that differs in any field of :func:`lightning_sp.model.config.architecture` is refused
in one line naming each differing field with both values, before launch (``fit --ckpt_path``,
``generate``) and in every rank's load (``Checkpointer.load``, which ``fit``, ``validate``,
``predict`` and ``generate`` go through); so is a checkpoint tensor the model lacks. What may
change on resume (recompute, attention backend, dropout, SP, seed) still loads the same
weights and optimizer state, bit for bit, and gives the same loss. In-process, one process."""

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
from lightning_sp.model.config import RESUMABLE_FIELDS, architecture
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
    meta = Meta(1, ParallelConfig(), dataclasses.asdict(config))
    Checkpointer().save(path, model, [optimizer], meta=meta, lightning_state={},
                        rng=("rng.pp0.dp0.tp0", None))  # fmt: skip
    return model, optimizer


def _load(path: Path, model: GPT, optimizers: list, config: GPTConfig) -> None:
    """``Checkpointer.load``, the load every rank runs, in one process."""
    fields = dataclasses.asdict(config)
    layout = ParallelConfig()
    Checkpointer().load(path, model, optimizers, layout=layout, model_config=fields,
                        rng_name="rng.pp0.dp0.tp0")  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT, torch.optim.Optimizer]:
    config = GPTConfig(**TRAINED)
    path = tmp_path_factory.mktemp("arch") / "last.ckpt"
    return (path, *_save(path, config))


def _refused(path: Path, config: GPTConfig) -> str:
    with pytest.raises(ConfigError) as error:
        check_checkpoint(str(path), config)
    message = str(error.value)
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
    assert _refused(path, config) == expected + SUFFIX


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
    assert {"recompute", "attention", "hidden_dropout", "sequence_parallel"} <= RESUMABLE_FIELDS
    changed = GPTConfig(**{**TRAINED, "recompute": "full", "attention": "sdpa", "seed": 11,
                           "sequence_parallel": True})  # fmt: skip
    assert architecture(changed) == architecture(GPTConfig(**TRAINED))
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
