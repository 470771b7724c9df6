"""The new parts and options in every layout, recompute preset and attention backend equal one
float64 process, and the presets agree with dropout on:

* ``qwen2``: biases on Q, K, V only;
* ``qwen3``: query/key RMSNorm per head, head dimension 6 (not h/a = 4);
* ``olmo2``: query/key RMSNorm over the whole projections (statistics all-reduced over TP;
  2 key/value groups: at t = 4 each key norm shard is held by 2 ranks) and norms after each
  sublayer;
* ``llama`` with ``dynamic`` RoPE scaling active (its length 8 < seq_length 16) and ``linear``.

Layouts: t = 1 (quick tier, in process), t = 2 and 4 with and without SP, c = 2 and t = 2 x
c = 2 (slow). The block composition itself: GPT-2 / Llama layers are attention then MLP,
pre-norm; a part's terms, GEMMs, parameters and FLOPs sum to the layer's.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch

from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.errors import ConfigError
from lightning_sp.memory.flops import layer_forward_flops
from lightning_sp.memory.formulas import layer_saved_terms
from lightning_sp.memory.model_state import layer_parameter_count
from lightning_sp.model.ops import RopeScaling
from lightning_sp.model.parts import DenseMLP, Norm, SelfAttention
from lightning_sp.planner.ops import layer_collectives, layer_gemms
from lightning_sp.testing.spawn import run_distributed

from models import (
    assert_matches_reference,
    assert_policies_agree,
    batch,
    context_shards,
    layout_at,
    loss_and_grads,
    reference_model,
    relative_error,
    shape_at,
    tiny_config,
    two_steps,
)

RTOL = 1e-10
PRESETS = (("none", None), ("selective", None), ("lean", None), ("full", None), ("full", 1))

PARTS: dict[str, dict[str, Any]] = {
    "qwen2": {},
    "qwen3": {"kv_channels": 6},
    "olmo2": {},
    "llama_dynamic": {"rope_scaling": RopeScaling(factor=2.0, original_max_position_embeddings=8,
                                                  rope_type="dynamic")},
    "llama_linear": {"rope_scaling": RopeScaling(factor=4.0, rope_type="linear")},
}  # fmt: skip
"""Case -> the fields it sets on its family (``llama_*``: Llama)."""


def part_config(case: str, **fields: Any) -> GPTConfig:
    """The tiny 2-layer model of ``case``: 8 query heads in 2 key/value groups, SwiGLU 48."""
    family = case.split("_")[0]
    return tiny_config(
        family, num_heads=8, num_query_groups=2, ffn_hidden_size=48, **{**PARTS[case], **fields}
    )


def _parity_worker(rank: int, world_size: int, layouts: list[tuple[int, int]]) -> None:
    """Every case, preset, SP and backend at each ``(t, c)`` equals one float64 process."""
    for t, c in layouts:
        state = ParallelState.from_process_group(tensor_parallel_size=t, context_parallel_size=c)
        for case in PARTS:
            config = part_config(case)
            ids, labels = batch(config)
            reference = reference_model(config)
            ref_loss = loss_and_grads(reference, ids, labels)
            local = context_shards(state, ids, labels)
            backends = ("math", "sdpa") if world_size > 1 else ("math",)  # quick tier: math
            for sp, attention, (recompute, layers) in itertools.product(
                (False, True) if t > 1 else (False,), backends, PRESETS
            ):
                what = f"{case} t={t} c={c} sp={sp} {attention} {recompute}/{layers}"
                cfg = part_config(
                    case, sequence_parallel=sp, attention=attention, recompute=recompute,
                    recompute_num_layers=layers, recompute_rest="lean",
                )  # fmt: skip
                model = GPT(cfg, state, dtype=torch.float64)
                loss = loss_and_grads(model, *local)
                assert relative_error(loss, ref_loss) <= RTOL, f"{what}: {loss} vs {ref_loss}"
                compared = assert_matches_reference(model, reference, RTOL, what)
                assert compared.parameters == len(list(model.parameters())) > 0


def _dropout_worker(rank: int, world_size: int) -> None:
    """With dropout on, every preset draws and replays the same masks as ``none``."""
    warnings.filterwarnings("ignore", message="attention='sdpa' with attention_dropout")
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    for case, sp in itertools.product(("qwen2", "qwen3", "olmo2"), (False, True)):
        if sp and world_size == 1:
            continue
        results = []
        for recompute, layers in PRESETS:
            cfg = part_config(
                case, sequence_parallel=sp, recompute=recompute, recompute_num_layers=layers,
                recompute_rest="lean", hidden_dropout=0.2, attention_dropout=0.3,
            )  # fmt: skip
            model = GPT(cfg, state, dtype=torch.float64)
            results.append(two_steps(model, f"{recompute}/{layers}"))
        assert_policies_agree(results, f"{case} t={world_size} sp={sp} dropout")


def _worker(rank: int, world_size: int, layouts: list[tuple[int, int]]) -> None:
    """The parity at each layout; with dropout, at ``t`` = the world size if a layout is it."""
    _parity_worker(rank, world_size, layouts)
    if (world_size, 1) in layouts:
        _dropout_worker(rank, world_size)


def test_parts_one_process_match_float64_reference() -> None:
    """The quick tier's case: t = 1 in this process, every case and preset (``math``; ``sdpa``
    runs in the multi-rank layouts, c = 2 at t = 1 among them), and the presets agreeing with
    dropout on."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        _worker(0, 1, [(1, 1)])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "layouts"),
    [(2, [(2, 1), (1, 2)]), (4, [(4, 1), (2, 2)])],
    ids=["t2+c2", "t4+t2c2"],
)
def test_parts_layouts_match_single_process_float64(world_size: int, layouts: list) -> None:
    """One spawn per world size, each of its layouts in turn (a spawn costs seconds)."""
    run_distributed(_worker, world_size, layouts)


def _qk_norm_reduce_worker(rank: int, world_size: int) -> list[tuple[str, int]]:
    """One bf16 forward and backward of OLMo 2 at t = 2 + SP, every all-reduce the query/key
    norm runs recorded (phase, bytes), the real one run."""
    import torch.distributed as dist

    from lightning_sp.model import qk_norm

    calls: list[tuple[str, int]] = []
    phase = ["forward"]

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(dist, name)

        @staticmethod
        def all_reduce(tensor: torch.Tensor, **kwargs: Any) -> Any:
            calls.append((phase[0], tensor.numel() * tensor.element_size()))
            return dist.all_reduce(tensor, **kwargs)

    qk_norm.dist = Spy()  # type: ignore[assignment]
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    model = GPT(part_config("olmo2", sequence_parallel=True), state, dtype=torch.bfloat16)
    loss = model(*batch(model.config))
    phase[0] = "backward"
    loss.backward()
    return calls


@pytest.mark.slow  # a 2-rank spawn, 15 s on 2 busy cores
def test_olmo2_query_key_norm_all_reduces_are_what_the_step_time_prices() -> None:
    """The all-reduces OLMo 2's query/key norm runs at t = 2 (counted on the real gloo ranks)
    are the part's declared collectives (:func:`layer_collectives`, which the step-time model
    prices) on every layer: as many calls, as many bytes, in forward and in backward."""
    config = part_config("olmo2", sequence_parallel=True)
    [stats] = layer_collectives(shape_at(config, 2, batch(config)[0].shape[0]))
    for calls in run_distributed(_qk_norm_reduce_worker, 2):
        for phase, count in (("forward", stats.forward), ("backward", stats.backward)):
            sizes = [n for p, n in calls if p == phase]
            assert sizes == [stats.nbytes] * count * config.num_layers, (phase, sizes)


def test_gpt2_and_llama_layers_are_attention_then_mlp_pre_norm() -> None:
    for config in (GPTConfig(), GPTConfig.of("llama")):
        block = config.block()
        (attention, mlp) = block.sublayers
        assert (attention.name, attention.norm, attention.placement) == (
            "attention", Norm(config.normalization, "ln1"), "pre")  # fmt: skip
        assert (mlp.name, mlp.norm, mlp.placement) == (
            "mlp", Norm(config.normalization, "ln2"), "pre")  # fmt: skip
        assert isinstance(attention.mixer, SelfAttention)
        assert mlp.mixer == DenseMLP(config.activation, config.bias, config.bias)


@pytest.mark.parametrize("case", list(PARTS))
def test_the_layer_is_the_sum_of_its_parts(case: str) -> None:
    """Terms, GEMMs, parameters and FLOPs of the layer are the parts' (and the residuals')."""
    config = part_config(case)
    shape = config.activation_shape(layout_at(2), 2)
    block = config.block()
    terms: dict[str, Any] = {}
    for sub in block.sublayers:
        for part in sub.parts:
            terms.update(part.saved_terms(shape))
        terms.update(sub.residual_terms(shape))
    if config.norm_placement == "post":  # the mixers' inputs: the residual stream, kept
        terms["attention_input"] = terms.pop("qkv_input")
        terms["mlp_input"] = terms.pop("fc1_input")
    assert layer_saved_terms(shape) == {k: terms[k] for k in layer_saved_terms(shape)}
    assert set(layer_saved_terms(shape)) == set(terms)
    gemms = [g for p in block.parts for g in p.gemms(shape)]
    assert layer_gemms(shape_at(config, 2, 2)) == gemms
    counted = sum(p.numel() for n, p in GPT(config, ParallelState.single(), device="meta")
                  .named_parameters() if n.startswith("layers.0."))  # fmt: skip
    assert layer_parameter_count(config.hidden_size, config=config) == counted
    one = config.activation_shape(layout_at(1), 3)
    assert layer_forward_flops(config, 3) == sum(p.forward_flops(one) for p in block.parts)


def test_bad_part_options_fail_with_one_line() -> None:
    for fields, message in [
        ({"qk_norm": "layer"}, "qk_norm='layer' is not a query/key norm; valid: null, head, "
         "projection"),
        ({"norm_placement": "sandwich"}, "norm_placement='sandwich' is not a placement; valid: "
         "pre, post"),
        ({"bias": ["qkv", "gate"]}, "bias=['qkv', 'gate'] names 'gate', not a projection"),
        ({"feed_forward": "mamba"}, "feed_forward='mamba' is not a feed-forward part; valid: "
         "dense, moe"),
        ({"rope_scaling": RopeScaling(rope_type="yarn")}, "rope_scaling.rope_type='yarn' is not "
         "a RoPE scaling; valid: llama3, linear, dynamic"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as error:
            part_config("qwen2", **fields)
        assert message in str(error.value) and "\n" not in str(error.value), fields
