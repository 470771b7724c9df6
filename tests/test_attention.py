"""The attention backends and the recompute modules on one process: what each stores, how
``sdpa`` draws its dropout, and the descriptors the rest of the package reads."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_sp import GPT, ParallelState
from lightning_sp.memory.formulas import layer_saved_terms
from lightning_sp.model.cores import ATTENTION_BACKENDS, sdpa_core
from lightning_sp.model.fused import act_row_linear, activate, fused_column_linear, heads_row_linear
from lightning_sp.model.recompute import PRESETS, RECOMPUTE_MODULES, parse_recompute, policy_name
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.random import dropout

from models import batch, feed_forward_terms, loss_and_grads, relative_error, tiny_config


def _qkv(seed: int = 0, per_group: int = 1) -> tuple[torch.Tensor, ...]:
    """Q ``[B, r, s, d]``, K and V ``[B, 1, s, d]`` (B = 8 / r groups of r query heads)."""
    g = torch.Generator().manual_seed(seed)
    groups = 8 // per_group
    q = torch.randn(groups, per_group, 16, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(groups, 1, 16, 4, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention, every query head against its group's K and V (expanded)."""
    s, d = q.shape[2], q.shape[3]
    scores = q @ k.expand_as(q).transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v.expand_as(q)


@pytest.mark.parametrize("per_group", [1, 2, 8])
def test_cores_equal_plain_attention_without_dropout(per_group: int) -> None:
    """Both backends, multi-head (r = 1), grouped-query (r = 2) and multi-query (r = 8)."""
    q, k, v = _qkv(per_group=per_group)
    reference = _reference_attention(q, k, v)
    gen = torch.Generator()
    for backend in ATTENTION_BACKENDS.values():
        out = backend.core(q, k, v, 0.0, gen, True)
        assert out.shape == q.shape, backend.name
        assert relative_error(out, reference) <= 1e-12, backend.name


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


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_fused_linears_equal_the_modules_they_replace(architecture: str) -> None:
    """Norm -> input linears (LayerNorm or RMSNorm; one weight or SwiGLU's gate and up),
    activation -> fc2 and heads -> projection give the modules' results and gradients."""
    config = tiny_config(architecture)
    layer = GPT(config, ParallelState.single(), dtype=torch.float64).layers[0]
    mlp, kind = layer.mlp, layer.mlp.kind
    x = torch.randn(16, 2, 32, dtype=torch.float64, requires_grad=True)

    def z() -> torch.Tensor:
        return torch.cat([linear(x) for linear in mlp.inputs], dim=-1)

    checks = [
        (lambda: fused_column_linear(x, mlp.inputs, 1, layer.ln2, mlp.norm_kind),
         lambda: torch.cat([linear(layer.ln2(x)) for linear in mlp.inputs], dim=-1)),
        (lambda: act_row_linear(z(), mlp.fc2, kind), lambda: mlp.fc2(kind.forward(z()))),
        (lambda: activate(z(), kind), lambda: kind.forward(z())),
        (lambda: heads_row_linear(x.view(16, 8, 1, 8).permute(1, 2, 0, 3),
                                  layer.attention.proj, 2),
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
    terms = set(layer_saved_terms(ActivationShape(16, 2, 32, 4))) | feed_forward_terms()
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
