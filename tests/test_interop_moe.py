"""Mixtral, Qwen3-MoE and OLMoE both ways: a random model saved by transformers (the Hub's
per-expert tensors) read into one process, and into e = 2 x t = 2 + SP (Mixtral also t = 2 + SP
and e = 2), equals transformers' float64 logits and loss (and each layer's auxiliary loss, to
fp32 rounding, in the spawned layouts); so does the same model written with
transformers 5's fused in-memory expert tensors (``mlp.experts.gate_up_proj [E, 2f, h]``,
``down_proj [E, h, f]``); our model exported is loaded by ``AutoModelForCausalLM`` as the same
class holding every tensor of the original, with the same logits.

OLMoE meets the same 1e-10: ``OlmoeRMSNorm`` computes its statistics in fp32 even for float64
inputs, and our ``qk_norm: projection`` computes them in float64 (the model's dtype, widened to
fp32 at least, the same under any t, as for OLMo 2); so the float64 reference runs its
``q_norm`` / ``k_norm`` in float64 (``hf_families.wide_olmo2_norms``, the OLMo 2 tests'
helper). Unpatched the difference is fp32 rounding, ~2e-7 of the logits."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_families import wide_olmo2_norms
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_sp import GPT
from lightning_sp.interop.hf import hf_layout, load_hf_weights, read_hf_config
from lightning_sp.interop.hf_export import save_hf
from lightning_sp.interop.hf_types import hf_model_type
from lightning_sp.model.moe.layer import MoE
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing.spawn import run_distributed

from hf_models import full_logits, hf_logits_and_loss, tokens, unpadded_elements

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


def float64_reference(model: Any) -> Any:
    """``model`` in float64 eval mode with the eager expert loop (``torch._grouped_mm``
    refuses float64), OLMoE's query/key norms in float64 (module docstring)."""
    model.config._experts_implementation = "eager"
    model = model.double().eval()
    if model.config.model_type == "olmoe":
        wide_olmo2_norms(model)
    return model


def save_random(family: str, directory: Path) -> Any:
    """A random model of ``family``, perturbed, saved in ``directory`` by ``save_pretrained``;
    returned as :func:`float64_reference` makes it."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    model.save_pretrained(directory)
    return float64_reference(model)


def save_fused(model: Any, directory: Path) -> Path:
    """``model`` written with transformers' in-memory names (its ``state_dict`` as is: fused
    ``[E, n, k]`` experts, Mixtral's router under ``mlp.gate``) and its ``config.json``."""
    model.config.save_pretrained(directory)
    weights = {name: value.float().contiguous() for name, value in model.state_dict().items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _file_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, save_random(request.param, directory)


def _ours(directory: Path, state: ParallelState, **overrides: Any) -> GPT:
    config = read_hf_config(directory, seq_length=32, recompute="none", **overrides)
    model = GPT(config, state, dtype=torch.float64)
    load_hf_weights(model, directory)
    return model.eval()


def test_save_pretrained_writes_the_hubs_per_expert_tensors(saved: tuple) -> None:
    """transformers 5.24 holds the experts fused in memory but ``save_pretrained`` writes one
    tensor per expert under the Hub's names (Mixtral ``block_sparse_moe.experts.{e}.w1/w2/w3``,
    Qwen3-MoE and OLMoE ``mlp.experts.{e}.gate_proj/up_proj/down_proj``): exactly the names
    and shapes of our per-expert layout; a ``state_dict`` holds the fused layout instead."""
    family, directory, hf = saved
    config = read_hf_config(directory)
    model_type = hf_model_type({"model_type": family}, "test")
    per_expert = {n: t.shape for n, t in hf_layout(model_type, config).items()}
    assert _file_shapes(directory) == per_expert
    moe = config.moe
    assert moe is not None
    gate = "block_sparse_moe.experts.3.w1" if family == "mixtral" else "mlp.experts.3.gate_proj"
    assert per_expert[f"model.layers.1.{gate}.weight"] == (moe.expert_ffn_size, 32)
    fused = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    assert fused == {n: t.shape for n, t in hf_layout(model_type, config, fused=True).items()}
    assert fused["model.layers.1.mlp.experts.gate_up_proj"] == (4, 2 * moe.expert_ffn_size, 32)
    assert fused["model.layers.1.mlp.experts.down_proj"] == (4, 32, moe.expert_ffn_size)


def test_fused_expert_tensors_read_as_the_per_expert_ones(saved: tuple, tmp_path: Path) -> None:
    """The same model written fused is read into the same weights, every one equal."""
    family, directory, hf = saved
    fused = save_fused(hf, tmp_path / "fused")
    assert "model.layers.0.mlp.experts.gate_up_proj" in _file_shapes(fused)
    per_expert = _ours(directory, ParallelState.single())
    from_fused = _ours(fused, ParallelState.single())
    pairs = zip(per_expert.named_parameters(), from_fused.parameters(), strict=True)
    for (name, a), b in pairs:
        assert torch.equal(a, b), f"{family} {name}"


def test_import_equals_transformers(saved: tuple) -> None:
    _, directory, hf = saved
    tolerance = TOLERANCE
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
    class from the Hub's per-expert names, every tensor equal to the original model's, and its
    logits equal ours."""
    family, directory, hf = saved
    model = _ours(directory, ParallelState.single())
    names = [(model.global_name(n), p.detach()) for n, p in model.named_parameters()]
    save_hf(model.config, names, tmp_path / "out", eos_token_id=0)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(back).__name__ == type(hf).__name__
    back = float64_reference(back)
    original = hf.state_dict()
    assert back.state_dict().keys() == original.keys()
    for name, value in back.state_dict().items():
        assert torch.equal(value, original[name]), f"{family} {name}"
    ids, labels = tokens()
    back_logits, _ = hf_logits_and_loss(back, ids, labels)
    with torch.no_grad():
        logits = full_logits([model], model.state, ids)
    assert logits is not None
    scale = float(logits.abs().max())
    assert float((logits - back_logits).abs().max()) <= TOLERANCE * scale


AUX_TOLERANCE = 1e-6
"""The auxiliary loss is summed in fp32 on both sides (transformers' ``load_balancing_loss_func``
casts the probabilities to fp32; our router dtype is fp32, to route as transformers does), so
the two agree to fp32 rounding, not 1e-10 (seen: one fp32 ulp, ~1.2e-7 relative)."""


def hf_reference(model: Any) -> dict[str, Any]:
    """transformers' float64 logits ``[b, s, V]`` and loss on :func:`tokens`' batch, and its
    unscaled auxiliary loss of each layer: the family's ``load_balancing_loss_func`` of that
    layer's router logits alone (``output_router_logits=True``). transformers' own
    ``aux_loss`` (of every layer together) is checked to be that function of all of them."""
    ids, labels = tokens()
    logits, loss = hf_logits_and_loss(model, ids, labels)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    experts, top_k = model.num_experts, model.config.num_experts_per_tok
    assert torch.equal(out.aux_loss, balance(out.router_logits, experts, top_k))
    aux = [float(balance((layer,), experts, top_k)) for layer in out.router_logits]
    return {"logits": logits, "loss": float(loss), "aux": aux}


def _layout_worker(
    rank: int, world_size: int, cases: list[tuple[str, dict[str, Any]]],
    layouts: tuple[tuple[int, int, int], ...] = ((2, 1, 1), (1, 2, 1)),
) -> None:  # fmt: skip
    ids, labels = tokens()
    for (directory, ref), (t, e, etp) in itertools.product(cases, layouts):
        case = f"{Path(directory).name} t={t} e={e} etp={etp}"
        state = ParallelState.from_process_group(
            tensor_parallel_size=t, expert_parallel_size=e, expert_tensor_parallel_size=etp
        )
        config = read_hf_config(directory, seq_length=32, recompute="none", sequence_parallel=t > 1)
        model = GPT(config, state, dtype=torch.float64)
        read = load_hf_weights(model, directory)
        if etp == 1:  # under etp a rank reads its experts whole and keeps its slice
            assert read == unpadded_elements([model]), f"{case}: read {read} elements"
        with torch.no_grad():
            loss = float(model.eval()(ids, labels))
            logits = full_logits([model], state, ids)  # [b, s, V] on every rank
        hf_loss = ref["loss"]
        assert abs(loss - hf_loss) <= TOLERANCE * hf_loss, f"{case}: {loss} vs {hf_loss}"
        assert logits is not None and logits.shape == ref["logits"].shape, case
        error = float((logits - ref["logits"]).abs().max())
        assert error <= TOLERANCE, f"{case}: logits differ by {error:.1e}"
        aux = [float(m.metrics["aux_loss"]) for m in model.modules() if isinstance(m, MoE)]
        errors = [abs(a - b) / b for a, b in zip(aux, ref["aux"], strict=True)]
        assert max(errors) <= AUX_TOLERANCE, f"{case}: aux losses {aux} vs {ref['aux']}"
        if rank == 0:
            print(f"{case}: loss {abs(loss - hf_loss) / hf_loss:.1e} (relative), logits "
                  f"{error:.1e} (max abs), aux losses {max(errors):.1e} (relative)")  # fmt: skip


def test_import_any_layout_equals_transformers(tmp_path: Path) -> None:
    """Mixtral at t = 2 with SP, and at e = 2, from the per-expert and the fused files: each
    rank reads exactly its shard's elements (at e = 2 its own experts' tensors, or their rows
    of the fused ones), and its logits (gathered over the sequence and the vocabulary), loss
    and each layer's auxiliary loss are transformers'; the three families at e = 2 x t = 2 +
    SP are :func:`test_import_expert_parallel_equals_transformers`'."""
    directory = tmp_path / "mixtral"
    hf = save_random("mixtral", directory)
    fused = save_fused(hf, tmp_path / "mixtral_fused")
    ref = hf_reference(hf)
    run_distributed(_layout_worker, 2, [(str(directory), ref), (str(fused), ref)])


@pytest.mark.slow
def test_import_expert_parallel_equals_transformers(tmp_path: Path) -> None:
    """Mixtral (per-expert and fused files), Qwen3-MoE and OLMoE at e = 2 x t = 2 + SP, each
    expert whole on its rank (etp = 1) and each expert's f_e split over TP (etp = 2, a rank
    reads its own experts and keeps its slice): on every rank the logits gathered to
    ``[b, s, V]`` are transformers' float64 ones (max abs error <= 1e-10), so is the loss,
    and each layer's auxiliary loss is transformers' (to :data:`AUX_TOLERANCE`).

    The auxiliary losses compare layer by layer. With ``c_li`` the micro-batch's top-k choices
    of expert ``i`` at layer ``l`` and ``p_li`` the sum over its ``T`` tokens of that expert's
    router probability, ours (``MoE.metrics["aux_loss"]``, unscaled) is, per layer,
    ``E / T² · Σ_i c_li · p_li``: transformers' ``load_balancing_loss_func`` given that one
    layer's router logits. transformers' ``aux_loss`` is the same function of every layer's
    logits concatenated, ``E / (L·T)² · Σ_i (Σ_l c_li)(Σ_l p_li)``: it holds the cross-layer
    terms ``c_li · p_mi`` (``l ≠ m``) too, so it is no function of the per-layer values and is
    only checked to be that function (:func:`hf_reference`). Scaled, transformers adds
    ``router_aux_loss_coef · aux_loss`` to its returned loss; ours adds ``aux_loss_coef`` times
    the sum of the layers' to the gradient alone (0 as imported), so the losses compared are
    the language-model ones."""
    cases = []
    for family in FAMILIES:
        hf = save_random(family, tmp_path / family)
        ref = hf_reference(hf)
        cases.append((str(tmp_path / family), ref))
        if family == "mixtral":
            cases.append((str(save_fused(hf, tmp_path / "mixtral_fused")), ref))
    run_distributed(_layout_worker, 4, cases, ((2, 2, 1), (2, 2, 2)))
