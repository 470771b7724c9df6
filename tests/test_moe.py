"""The MoE layer in one process: grouped GEMM equals the per-expert loop, the three transformers
families' sparse MoE blocks equal ours on the same weights (outputs, router logits' losses and
every gradient), capacity dropping, the auxiliary-loss-free bias, and bad settings refused in
one line."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lightning_sp.errors import ConfigError
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.experts import grouped_available, grouped_linear
from lightning_sp.model.moe.layer import MoE
from lightning_sp.model.moe.router import Router
from lightning_sp.parallel.config import ParallelConfig

from models import moe_context

transformers = pytest.importorskip("transformers")

H, F, E = 16, 24, 4


def _moe(config: MoEConfig, dtype: torch.dtype = torch.float64, seed: int = 5) -> MoE:
    moe = MoE(moe_context(config, H, dtype=dtype), config)
    moe.reset_parameters(seed)
    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_loop(dtype: torch.dtype) -> None:
    """``torch._grouped_mm`` and the per-expert loop: same output and gradients (empty groups
    included); float64 is refused by the grouped kernel and takes the loop."""
    assert grouped_available(dtype, 16, 32) and not grouped_available(torch.float64, 16, 32)
    torch.manual_seed(0)
    counts = [3, 0, 7, 6]
    x = torch.randn(sum(counts), 16, dtype=dtype)
    w = torch.randn(len(counts), 32, 16, dtype=dtype)
    g = torch.randn(sum(counts), 32, dtype=dtype)
    results = []
    for grouped in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        from lightning_sp.model.moe.experts import _GroupedLinear

        y = _GroupedLinear.apply(xi, wi, counts, grouped)
        y.backward(g)
        results.append((y, xi.grad, wi.grad))
    loose = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 0}
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **loose)
    assert grouped_linear(x, w, counts).shape == (sum(counts), 32)


def _hf_block(family: str, norm_topk: bool) -> tuple[Any, MoEConfig]:
    common = dict(hidden_size=H, num_experts_per_tok=2, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    if family == "mixtral":
        hf_config = transformers.MixtralConfig(
            num_local_experts=E, intermediate_size=F, router_jitter_noise=0.0, **common
        )
        block_class = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
    elif family == "qwen3_moe":
        hf_config = transformers.Qwen3MoeConfig(
            num_experts=E, moe_intermediate_size=F, norm_topk_prob=norm_topk, **common
        )
        block_class = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    else:
        hf_config = transformers.OlmoeConfig(
            num_experts=E, intermediate_size=F, norm_topk_prob=norm_topk, **common
        )
        block_class = transformers.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock
    hf_config._experts_implementation = "eager"  # torch._grouped_mm refuses float64
    torch.manual_seed(1)
    block = block_class(hf_config).double()
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    ours = MoEConfig(num_experts=E, top_k=2, expert_ffn_size=F, normalize_top_k=norm_topk)
    return block, ours


@pytest.mark.parametrize(
    "family,norm_topk", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False),
                         ("olmoe", False)],
)  # fmt: skip
def test_matches_transformers_sparse_moe_block(family: str, norm_topk: bool) -> None:
    """Same weights (``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``): same
    output, input and weight gradients, and our one-layer aux loss equals transformers'
    ``load_balancing_loss_func`` on the block's router logits. Both compute the router's
    softmax in fp32 (transformers casts; ``router_dtype='fp32'``), the rest in float64."""
    block, config = _hf_block(family, norm_topk)
    moe = _moe(config)
    with torch.no_grad():
        moe.router.weight.copy_(block.gate.weight)
        moe.experts.gate_up.copy_(block.experts.gate_up_proj)
        moe.experts.down.copy_(block.experts.down_proj)
    torch.manual_seed(2)
    x = torch.randn(6, 3, H, dtype=torch.float64)  # [s, b, h]
    grad = torch.randn_like(x)
    ours_x, hf_x = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    out = moe(ours_x)
    out.backward(grad)
    hf_out = block(hf_x)  # [b, s, h]
    hf_out.backward(grad.transpose(0, 1))
    tol = {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(out, hf_out.transpose(0, 1), **tol)
    torch.testing.assert_close(ours_x.grad, hf_x.grad.transpose(0, 1), **tol)  # type: ignore[union-attr]
    pairs = [(moe.router.weight, block.gate.weight),
             (moe.experts.gate_up, block.experts.gate_up_proj),
             (moe.experts.down, block.experts.down_proj)]  # fmt: skip
    for ours_p, hf_p in pairs:
        torch.testing.assert_close(ours_p.grad, hf_p.grad, **tol)
    logits = torch.nn.functional.linear(x.reshape(-1, H), block.gate.weight)  # s-major tokens
    lb = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
    expected = lb((logits.detach(),), E, 2)
    assert abs(float(moe.metrics["aux_loss"]) - float(expected)) <= 1e-6 * float(expected)


def test_capacity_drops_by_weight_and_counts() -> None:
    """capacity_factor 0.5 of 12 tokens x top-2 over 4 experts: each expert keeps its 3
    highest-weight choices; 24 - 12 = 12 dropped; a token whose choices are all dropped gets
    zeros (the residual alone carries it)."""
    config = MoEConfig(num_experts=E, top_k=2, expert_ffn_size=F, capacity_factor=0.5,
                       router_dtype="fp64")  # fmt: skip
    moe = _moe(config)
    torch.manual_seed(3)
    x = torch.randn(12, 1, H, dtype=torch.float64)
    routed = moe.router(x.reshape(12, H), None)
    assert routed.keep is not None and routed.dropped == 24 - int(routed.keep.sum()) == 12, (
        f"capacity 0.5: {routed.dropped} choices dropped, {24 - int(routed.keep.sum())} not kept"
        " of 24; each expert keeps 3, so 12 are dropped"
    )
    for expert in range(E):
        chosen = routed.experts == expert
        kept_w = routed.weights[chosen & routed.keep]
        dropped_w = routed.weights[chosen & ~routed.keep]
        assert len(kept_w) == min(3, int(chosen.sum())), (
            f"expert {expert} kept {len(kept_w)} of its {int(chosen.sum())} choices; its "
            "capacity is 3"
        )
        if len(dropped_w):
            assert kept_w.min() >= dropped_w.max(), (
                f"expert {expert} kept a choice of weight {float(kept_w.min()):.4f} and dropped "
                f"one of {float(dropped_w.max()):.4f}: capacity does not keep the highest weights"
            )
    out = moe(x)
    gone = ~routed.keep.any(dim=1)
    assert torch.equal(out.reshape(12, H)[gone], torch.zeros_like(out.reshape(12, H)[gone])), (
        "a token whose every choice was dropped got a non-zero expert output"
    )
    assert float(moe.metrics["dropped"]) == 12, (
        f"metrics dropped={float(moe.metrics['dropped'])}, the router dropped 12 choices"
    )


def test_expert_bias_moves_towards_balance_and_only_chooses() -> None:
    """The bias changes the top-k choice, not the combine weights; after an update the most
    loaded expert's bias drops by γ, the least loaded one's rises by γ."""
    config = MoEConfig(num_experts=E, top_k=1, expert_ffn_size=F, score="sigmoid",
                       expert_bias=True, bias_update_rate=0.1, router_dtype="fp64")  # fmt: skip
    moe = _moe(config)
    x = torch.randn(40, 1, H, dtype=torch.float64)
    moe(x)
    load = moe.router.tokens_per_expert.clone()  # type: ignore[union-attr]
    moe.update_expert_bias()
    bias = moe.router.expert_bias
    assert bias is not None
    assert float(bias[load.argmax()]) == pytest.approx(-0.1)
    assert float(bias[load.argmin()]) == pytest.approx(0.1)
    assert float(moe.router.tokens_per_expert.sum()) == 0  # type: ignore[union-attr]
    with torch.no_grad():
        bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    routed = moe.router(x.reshape(40, H), None)
    assert bool((routed.experts == 3).all())  # the bias decides the choice
    assert torch.allclose(routed.weights, torch.ones_like(routed.weights))  # top-1 renormalised


def _router(**fields: Any) -> Router:
    """A float64 router over 4 experts whose logits are the token's own 4 values (``weight``
    the identity), so the expected weights below are written by hand."""
    defaults = dict(num_experts=4, top_k=2, expert_ffn_size=F, score="sigmoid",
                    router_dtype="fp64")  # fmt: skip
    config = MoEConfig(**{**defaults, **fields})
    router = Router(moe_context(config, 4, dtype=torch.float64), config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4, dtype=torch.float64))
    return router


# logits ln 9, ln 3, 0, -ln 3: sigmoid scores 0.9, 0.75, 0.5, 0.25
SIGMOID_LOGITS = torch.tensor([[math.log(9), math.log(3), 0.0, -math.log(3)]], dtype=torch.float64)


@pytest.mark.parametrize(
    "normalize,expected", [(False, [0.9, 0.75]), (True, [0.9 / 1.65, 0.75 / 1.65])]
)
def test_sigmoid_top2_weights_by_hand(normalize: bool, expected: list[float]) -> None:
    """Sigmoid scores 0.9, 0.75, 0.5, 0.25, top-2: experts 0 and 1, weighing their own scores
    0.9 and 0.75 with ``normalize_top_k: false`` (DeepSeek's ``norm_topk_prob`` off), or
    0.9/1.65 and 0.75/1.65 renormalised."""
    routed = _router(normalize_top_k=normalize)(SIGMOID_LOGITS, None)
    assert routed.experts.tolist() == [[0, 1]]
    got = routed.weights[0].tolist()
    if not normalize:
        assert got != pytest.approx([0.9 / 1.65, 0.75 / 1.65]), (
            f"sigmoid router with normalize_top_k=false renormalised its top-k weights: {got}"
        )
    assert got == pytest.approx(expected, abs=1e-15), f"normalize_top_k={normalize}: {got}"


@pytest.mark.parametrize(
    "normalize,expected", [(False, [0.9, 0.25]), (True, [0.9 / 1.15, 0.25 / 1.15])]
)
def test_expert_bias_chooses_but_does_not_weigh_top2(
    normalize: bool, expected: list[float]
) -> None:
    """Scores 0.9, 0.75, 0.5, 0.25 with the bias 0, 0, 0.3, 0.6: the biased scores 0.9, 0.75,
    0.8, 0.85 choose experts 0 and 3 (the bias changed the second choice), which weigh their
    *unbiased* scores 0.9 and 0.25 (renormalised: 0.9/1.15, 0.25/1.15); the bias leaking into
    the weights would give 0.9 and 0.85 (0.9/1.75, 0.85/1.75)."""
    router = _router(normalize_top_k=normalize, expert_bias=True)
    assert router.expert_bias is not None
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.3, 0.6]))
    routed = router(SIGMOID_LOGITS, None)
    assert sorted(routed.experts[0].tolist()) == [0, 3], routed.experts
    order = routed.experts[0].argsort()
    got = routed.weights[0][order].tolist()
    leaked = [0.9, 0.85] if not normalize else [0.9 / 1.75, 0.85 / 1.75]
    assert got != pytest.approx(leaked), f"the expert bias leaks into the combine weights: {got}"
    assert got == pytest.approx(expected, abs=1e-15), f"normalize_top_k={normalize}: {got}"


def test_capacity_rounds_up_by_hand() -> None:
    """``ceil(cf·T·k/E)`` where it is not an integer: 5 tokens, top-1 over 4 experts at
    ``capacity_factor`` 1 give capacity ceil(1.25) = 2 (floor or round: 1). Sigmoid scores,
    not renormalised, of logits 3, 2, 1 on expert 0 and 2, 1 on expert 1: expert 0 keeps its
    two highest (tokens 0 and 1) and drops token 2; expert 1 keeps both."""
    router = _router(top_k=1, normalize_top_k=False, capacity_factor=1.0)
    logits = torch.zeros(5, 4, dtype=torch.float64)
    logits[[0, 1, 2], 0] = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    logits[[3, 4], 1] = torch.tensor([2.0, 1.0], dtype=torch.float64)
    routed = router(logits, None)
    assert routed.experts[:, 0].tolist() == [0, 0, 0, 1, 1], routed.experts
    assert routed.keep is not None
    kept = routed.keep[:, 0].tolist()
    assert kept == [True, True, False, True, True] and routed.dropped == 1, (
        f"capacity_factor 1 of 5 tokens x top-1 over 4 experts: kept {kept}, dropped "
        f"{routed.dropped}; the capacity ceil(1.25) = 2 keeps tokens 0, 1 of expert 0 and "
        "both of expert 1 (1 dropped): the capacity does not round up"
    )


def test_router_losses_by_hand() -> None:
    """One token of logits ln 9, ln 3, 0, -ln 3 over 4 experts, top-2, sigmoid scores 0.9,
    0.75, 0.5, 0.25 (sum 2.4): the load-balancing loss ``E/T² · Σ_i counts_i · Σ_t p_i``
    normalises each token's sigmoid scores first, 4 · (0.9 + 0.75) / 2.4 = 2.75 (unnormalised:
    6.6); the z-loss is ``logsumexp(logits)²`` = ln(9 + 3 + 1 + 1/3)² = ln(40/3)² (ST-MoE)."""
    routed = _router()(SIGMOID_LOGITS, None)
    assert routed.experts.tolist() == [[0, 1]]
    aux = float(routed.aux_loss)
    assert aux == pytest.approx(4 * 1.65 / 2.4, rel=1e-14), (
        f"sigmoid router's load-balancing loss {aux}, by hand 2.75: the sigmoid scores are not "
        "normalised per token in the auxiliary loss (unnormalised: 6.6)"
    )
    z = float(routed.z_loss)
    assert z == pytest.approx(math.log(40 / 3) ** 2, rel=1e-14), (
        f"router z-loss {z}, by hand ln(40/3)² = {math.log(40 / 3) ** 2}: the z-loss is not the "
        "mean over tokens of logsumexp(logits)²"
    )


@pytest.mark.parametrize(
    "fields,layout,message",
    [
        ({"num_experts": 6}, {"expert_parallel_size": 4}, "moe.num_experts=6 is not divisible"),
        ({"top_k": 9}, {}, "moe.top_k=9 exceeds moe.num_experts=8"),
        ({"capacity_factor": 0.0}, {}, "moe.capacity_factor=0.0 must be > 0"),
        ({}, {"tensor_parallel_size": 2}, "needs sequence_parallel=True"),
        ({}, {"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size=2"),
    ],
)
def test_bad_settings_one_line(fields: dict, layout: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        MoEConfig(**fields).check_layout(ParallelConfig(**layout), sequence_parallel=False)
    assert message in str(info.value) and "\n" not in str(info.value)


REFUSED = [
    ({"num_shared_experts": -1}, "moe.num_shared_experts=-1 must be >= 0"),
    ({"score": "relu"}, "moe.score='relu' is not one of softmax, sigmoid"),
]


@pytest.mark.parametrize(("fields", "message"), REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_routing_settings_are_refused_when_built(fields: dict, message: str) -> None:
    """A negative shared-expert count or an unknown score function is refused in one line when
    the config is built (else the shared MLP's width is negative, and any score but softmax
    routes silently as sigmoid)."""
    try:
        MoEConfig(**fields)
    except ConfigError as error:
        assert str(error) == message, f"{fields}: {error}"
        return
    pytest.fail(f"MoEConfig({fields}) was accepted; expected the one line {message!r}")


def test_shared_experts_width_must_divide_tp() -> None:
    """The shared experts are a TP MLP: their width 6 at t = 4 (with SP) is refused in one
    line naming both values, before any model is built."""
    moe = MoEConfig(num_shared_experts=1, expert_ffn_size=6)
    try:
        moe.check_layout(ParallelConfig(tensor_parallel_size=4), sequence_parallel=True)
    except ConfigError as error:
        expected = "moe.shared_expert_ffn_size=6 is not divisible by tensor_parallel_size=4"
        assert str(error) == expected, error
        return
    pytest.fail("shared experts of width 6 at tensor_parallel_size=4 were accepted")


def test_expert_parallel_size_must_divide_data_context_ranks() -> None:
    def check_expert_layout(data_context_ranks: int, e: int) -> int:
        layout = ParallelConfig(expert_parallel_size=e).for_world_size(data_context_ranks)
        return layout.expert_data_parallel_size

    with pytest.raises(ConfigError, match="expert_parallel_size=4 does not divide") as info:
        check_expert_layout(6, 4)
    assert "\n" not in str(info.value)
    assert check_expert_layout(8, 4) == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_recompute_act_gives_the_same_gradients(dtype: torch.dtype) -> None:
    """The ``mlp_act`` recompute module (experts' and shared experts' down projections saving
    SwiGLU's input): the same output and gradients, loop (float64) and grouped (fp32) paths."""
    config = MoEConfig(num_experts=E, top_k=2, expert_ffn_size=F, num_shared_experts=1,
                       aux_loss_coef=0.1, router_dtype="fp64")  # fmt: skip
    results = []
    for recompute_act in (False, True):
        moe = MoE(moe_context(config, H, recompute_act=recompute_act, dtype=dtype), config)
        moe.reset_parameters(5)
        x = torch.randn(6, 3, H, dtype=dtype, generator=torch.Generator().manual_seed(1))
        x.requires_grad_()
        out = moe(x)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), x.grad, *(p.grad for p in moe.parameters())])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
