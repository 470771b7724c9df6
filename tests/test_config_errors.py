"""Each bad input fails before any work, with one line naming the field, value and what is valid."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_sp import GPT, ConfigError, GPTConfig, MegatronSPStrategy, ParallelState
from lightning_sp.errors import positive_int
from lightning_sp.parallel.state import check_layout
from lightning_sp.pipeline import check_batch
from lightning_sp.training.data import TextDataModule

from models import tiny_config


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
        r"num_heads=6 is not divisible by tensor_parallel_size=4", GPT, config, _state(4)
    )
    assert "[1, 2, 3, 6]" in message


def test_hidden_not_divisible_by_tp() -> None:
    config = tiny_config(hidden_size=100, num_heads=4)
    message = _raises(
        r"hidden_size=100 is not divisible by tensor_parallel_size=8", GPT, config, _state(8)
    )
    assert "[1, 2, 4, 5, 10, 20, 25, 50, 100]" in message


def test_hidden_not_divisible_by_heads() -> None:
    _raises(
        r"hidden_size=32 is not divisible by num_heads=5", GPT, tiny_config(num_heads=5), _state(1)
    )


def test_sequence_not_divisible_by_tp_under_sequence_parallel() -> None:
    config = tiny_config(seq_length=18, sequence_parallel=True)
    message = _raises(
        r"seq_length=18 is not divisible by tensor_parallel_size=4", GPT, config, _state(4)
    )
    assert "sequence_parallel=False" in message
    GPT(tiny_config(seq_length=18, sequence_parallel=False), _state(1))  # fine without SP


def test_unknown_recompute_policy() -> None:
    message = _raises(r"recompute='partial'", GPT, tiny_config(recompute="partial"), _state(1))
    assert "none, selective, full" in message


def test_world_size_not_divisible_by_model_parallel_size() -> None:
    message = _raises(r"world size 6 is not divisible by .* = 4", check_layout, 6, 2, 2)
    assert "[1, 2, 3, 6]" in message


def test_non_positive_sizes() -> None:
    _raises(r"tensor_parallel_size=0 must be a positive integer", check_layout, 4, 0, 1)
    _raises(r"num_layers=0 must be a positive integer", GPTConfig(num_layers=0).validate)
    _raises(r"hidden_dropout=1.0 must be in \[0, 1\)", GPTConfig(hidden_dropout=1.0).validate)


@pytest.mark.parametrize("value", [True, False, 0, -1, 2.0, "2", None])
def test_every_size_check_rejects_what_is_not_a_positive_int(value: object) -> None:
    """One validator (``errors.positive_int``) behind every size: ``True`` is not 1."""
    message = f"={value!r} must be a positive integer"
    assert _raises(re.escape(message), positive_int, "size", value) == f"size{message}"
    _raises(re.escape(f"num_layers{message}"), GPTConfig(num_layers=value).validate)  # type: ignore[arg-type]
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
    assert [layer.recompute for layer in module.gpt.layers] == ["none", "none"]


def test_recompute_num_layers_mixes_full_and_selective() -> None:
    model = GPT(tiny_config(num_layers=3, recompute="full", recompute_num_layers=2), _state(1))
    assert [layer.recompute for layer in model.layers] == ["full", "full", "selective"]
    assert [layer.attention.selective for layer in model.layers] == [False, False, True]
