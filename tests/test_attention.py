"""The attention backends and the recompute modules on one process: what each stores, how
``sdpa`` draws its dropout, and the descriptors the rest of the package reads."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_sp import GPT, ParallelState
from lightning_sp.memory.formulas import layer_saved_terms
from lightning_sp.model.attention import ATTENTION_BACKENDS, sdpa_core
from lightning_sp.model.fused import gelu_row_linear, heads_row_linear, norm_column_linear
from lightning_sp.model.recompute import PRESETS, RECOMPUTE_MODULES, parse_recompute, policy_name
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.random import dropout

from models import batch, loss_and_grads, relative_error, tiny_config


def _qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(8, 16, 4, generator=g, dtype=torch.float64) for _ in range(3))


def test_sdpa_equals_math_without_dropout() -> None:
    q, k, v = _qkv()
    gen = torch.Generator()
    math_out = ATTENTION_BACKENDS["math"].core(q, k, v, 0.0, gen, True)
    sdpa_out = ATTENTION_BACKENDS["sdpa"].core(q, k, v, 0.0, gen, True)
    assert relative_error(sdpa_out, math_out) <= 1e-12


def test_sdpa_dropout_is_drawn_from_our_stream_and_leaves_the_global_rng_alone() -> None:
    """Same stream state -> same masks (recompute replays); another stream (another TP rank)
    -> other masks; torch's global RNG is where it was."""
    warnings.filterwarnings("ignore", message="attention='sdpa' with attention_dropout")
    q, k, v = _qkv()
    global_state = torch.get_rng_state()
    stream = torch.Generator().manual_seed(1)
    saved = stream.get_state()
    first = sdpa_core(q, k, v, 0.5, stream, True)
    stream.set_state(saved)
    replay = sdpa_core(q, k, v, 0.5, stream, True)
    other_rank = sdpa_core(q, k, v, 0.5, torch.Generator().manual_seed(2), True)
    assert torch.equal(first, replay), "the same stream state did not replay the same masks"
    assert not torch.equal(first, other_rank), (
        "another stream drew the same masks: SDPA's dropout does not draw from the stream given"
    )
    assert not torch.equal(first, sdpa_core(q, k, v, 0.5, stream, True))  # the stream moved on
    assert torch.equal(torch.get_rng_state(), global_state)
    # eval: no dropout, nothing drawn
    before = stream.get_state()
    sdpa_core(q, k, v, 0.5, stream, False)
    assert torch.equal(stream.get_state(), before)


def test_regenerated_dropout_draws_the_stored_mask() -> None:
    x = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    grads = []
    for regenerate in (False, True):
        gen = torch.Generator().manual_seed(3)
        out = dropout(x, 0.3, gen, True, regenerate=regenerate)
        (grad,) = torch.autograd.grad(out.sum(), x)
        grads.append((out.detach(), grad, gen.get_state()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert torch.equal(grads[0][2], grads[1][2])  # the stream advanced the same way


def test_fused_linears_equal_the_modules_they_replace() -> None:
    config = tiny_config()
    layer = GPT(config, ParallelState.single(), dtype=torch.float64).layers[0]
    x = torch.randn(16, 2, 32, dtype=torch.float64, requires_grad=True)
    checks = [
        (lambda: norm_column_linear(x, layer.ln1, layer.attention.qkv),
         lambda: layer.attention.qkv(layer.ln1(x))),
        (lambda: gelu_row_linear(layer.mlp.fc1(x), layer.mlp.fc2),
         lambda: layer.mlp.fc2(torch.nn.functional.gelu(layer.mlp.fc1(x)))),
        (lambda: heads_row_linear(x.view(16, 8, 8).transpose(0, 1), layer.attention.proj, 2),
         lambda: layer.attention.proj(x)),
    ]  # fmt: skip
    params = [x, *layer.parameters()]
    for fused, plain in checks:
        outs = []
        for fn in (fused, plain):
            out = fn()
            grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
            outs.append((out, grads))
        assert relative_error(outs[0][0], outs[1][0]) <= 1e-14
        for a, b in zip(outs[0][1], outs[1][1], strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert relative_error(a, b) <= 1e-13


def test_descriptors_name_real_terms_and_presets_parse() -> None:
    terms = layer_saved_terms(ActivationShape(16, 2, 32, 4))
    for module in RECOMPUTE_MODULES.values():
        assert set(module.drops) <= set(terms), module.name
    assert parse_recompute("lean") == tuple(RECOMPUTE_MODULES)
    assert parse_recompute(["mlp_act", "core_attn"]) == ("core_attn", "mlp_act")
    for name, modules in PRESETS.items():
        assert policy_name(list(modules)) == name
    assert policy_name(["mlp_act", "layernorm"]) == "layernorm+mlp_act"
    assert parse_recompute("layernorm+mlp_act") == ("layernorm", "mlp_act")
    assert parse_recompute("mlp_act") == ("mlp_act",) and policy_name(["mlp_act"]) == "mlp_act"


@pytest.mark.parametrize("attention", list(ATTENTION_BACKENDS))
def test_lean_replays_selective_with_dropout_on_one_process(attention: str) -> None:
    """A quick single-process check beside the spawned one in test_parity.py."""
    warnings.filterwarnings("ignore", message="attention='sdpa' with attention_dropout")
    results = []
    for recompute in ("selective", "lean"):
        cfg = tiny_config(recompute=recompute, attention=attention, hidden_dropout=0.2,
                          attention_dropout=0.3)  # fmt: skip
        model = GPT(cfg, ParallelState.single(), dtype=torch.float64)
        loss = loss_and_grads(model, *batch(cfg))
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    assert relative_error(results[1][0], results[0][0]) <= 1e-12
    for name, grad in results[0][1].items():
        assert relative_error(results[1][1][name], grad) <= 1e-12, name
