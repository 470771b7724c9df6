"""Mixtral, Qwen3-MoE and OLMoE both ways: a random model saved by transformers (the Hub's
per-expert tensors) read into one process (and Mixtral into expert- and tensor-parallel
layouts) equals transformers' float64 logits and loss; our model exported is loaded by
``AutoModelForCausalLM`` as the same class with the same logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sp import GPT
from lightning_sp.interop.hf import load_hf_weights, read_hf_config, save_hf
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing.spawn import run_distributed

from hf_models import full_logits, hf_logits_and_loss, tokens

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-10
"""transformers' router softmax runs in fp32 (it casts): ours too (``router_dtype: fp32``), so
the same fp32 rounding on both sides; the rest is float64."""


COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=300, max_position_embeddings=64, num_experts_per_tok=2,
              attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)  # fmt: skip
FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, **COMMON)
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(  # head_dim 16 != h/a = 8
        transformers.Qwen3MoeConfig(
            moe_intermediate_size=24, num_experts=4, head_dim=16, norm_topk_prob=True, **COMMON
        )
    ),
    "olmoe": lambda: transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(
            intermediate_size=24, num_experts=4, norm_topk_prob=False, **COMMON
        )
    ),
}
"""A small random model of each family: 2 layers, 4 experts, top-2, 4 heads in 2 KV groups."""

OLMOE_TOLERANCE = 1e-6
"""OLMoE's query/key norms (``OlmoeRMSNorm``) cast back to the input dtype *before* the weight
multiply; OLMo 2's, which our ``qk_norm: projection`` follows, multiply in fp32 first. In
float64 that is fp32 rounding, ~2e-7 of the logits here: a known difference, not yet a
variant of ours (the rest of the model is exact: Mixtral and Qwen3-MoE meet 1e-10)."""


def _tolerance(family: str) -> float:
    return OLMOE_TOLERANCE if family == "olmoe" else TOLERANCE


def save_random(family: str, directory: Path) -> Any:
    """A random model of ``family``, perturbed, saved in ``directory``; returned in float64
    eval mode with the eager expert loop."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    model.save_pretrained(directory)
    model.config._experts_implementation = "eager"  # torch._grouped_mm refuses float64
    return model.double().eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, save_random(request.param, directory)


def _ours(directory: Path, state: ParallelState, **overrides: Any) -> GPT:
    config = read_hf_config(directory, seq_length=32, recompute="none", **overrides)
    model = GPT(config, state, dtype=torch.float64)
    load_hf_weights(model, directory)
    return model.eval()


def test_import_equals_transformers(saved: tuple) -> None:
    family, directory, hf = saved
    tolerance = _tolerance(family)
    model = _ours(directory, ParallelState.single())
    assert model.config.feed_forward == "moe" and model.config.moe is not None
    assert model.config.moe.num_experts == 4 and model.config.moe.top_k == 2
    ids, labels = tokens()
    hf_logits, hf_loss = hf_logits_and_loss(hf, ids, labels)
    with torch.no_grad():
        loss = model(ids, labels)
        logits = full_logits([model], model.state, ids)
    assert logits is not None
    assert float((logits - hf_logits).abs().max()) <= tolerance * float(hf_logits.abs().max())
    assert abs(float(loss) - float(hf_loss)) <= tolerance * float(hf_loss)


def test_export_loads_as_the_same_class(saved: tuple, tmp_path: Path) -> None:
    """Ours (read from the fixture) written back: ``AutoModelForCausalLM`` builds the same
    class from the Hub's per-expert names, and its logits equal ours."""
    family, directory, hf = saved
    model = _ours(directory, ParallelState.single())
    names = [(model.global_name(n), p.detach()) for n, p in model.named_parameters()]
    save_hf(model.config, names, tmp_path / "out", eos_token_id=0)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(back).__name__ == type(hf).__name__
    back.config._experts_implementation = "eager"
    back = back.double().eval()
    ids, labels = tokens()
    back_logits, _ = hf_logits_and_loss(back, ids, labels)
    with torch.no_grad():
        logits = full_logits([model], model.state, ids)
    assert logits is not None
    scale = float(logits.abs().max())
    assert float((logits - back_logits).abs().max()) <= _tolerance(family) * scale


def _layout_worker(
    rank: int, world_size: int, directory: str, hf_loss: float,
    layouts: tuple[tuple[int, int, int], ...] = ((2, 1, 1), (1, 2, 1)),
) -> None:  # fmt: skip
    ids, labels = tokens()
    for t, e, etp in layouts:
        state = ParallelState.from_process_group(
            tensor_parallel_size=t, expert_parallel_size=e, expert_tensor_parallel_size=etp
        )
        model = _ours(Path(directory), state, sequence_parallel=t > 1)
        with torch.no_grad():
            loss = float(model(ids, labels))
        case = f"t={t} e={e} etp={etp}"
        assert abs(loss - hf_loss) <= TOLERANCE * hf_loss, f"{case}: {loss} vs {hf_loss}"


def test_import_any_layout_equals_transformers(tmp_path: Path) -> None:
    """Mixtral at t = 2 with SP, and at e = 2 (each rank reads only its own experts' tensors);
    one family's layouts suffice: the other families' layer is the same part."""
    directory = tmp_path / "mixtral"
    hf = save_random("mixtral", directory)
    _, hf_loss = hf_logits_and_loss(hf, *tokens())
    run_distributed(_layout_worker, 2, str(directory), float(hf_loss))


@pytest.mark.slow
def test_import_expert_tensor_parallel_equals_transformers(tmp_path: Path) -> None:
    """Mixtral at e = 2 x t = 2 + SP with each expert's f_e split over TP (etp = 2): each
    rank reads its own experts and keeps its slice of them."""
    directory = tmp_path / "mixtral"
    hf = save_random("mixtral", directory)
    _, hf_loss = hf_logits_and_loss(hf, *tokens())
    run_distributed(_layout_worker, 4, str(directory), float(hf_loss), ((2, 2, 2),))
