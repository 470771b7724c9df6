"""``estimate`` of a LoRA run next to its full fine-tune (lightning_sp.planner.lora): the
adapters' parameter count is the built model's, the frozen base holds weights only, the
activations are the adapted formula (measured to the byte in test_lora_bytes.py), the step
drops the frozen weight-gradient GEMMs, and the command prints both."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_sp.cli.estimate import main as report_main
from lightning_sp.cli.estimate import read_estimate_args
from lightning_sp.memory.formulas import activation_bytes_per_layer
from lightning_sp.memory.model_state import expert_parameters_per_rank, parameters_per_rank
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.lora import LoRAConfig, apply_lora, lora_parameters, with_adapters
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.parallel.state import ParallelState
from lightning_sp.planner.estimate import estimate
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.lora import adapter_parameters_per_rank, lora_estimate
from lightning_sp.planner.presets import load_cluster
from lightning_sp.planner.search import base_key, search

from models import layout_at

LLAMA = GPTConfig.of(
    "llama", vocab_size=512, seq_length=256, hidden_size=256, num_layers=4, num_heads=8,
    num_query_groups=2, ffn_hidden_size=704, recompute="selective",
)  # fmt: skip
LORA = LoRAConfig(r=8, target_modules=["all-linear"])


@pytest.mark.parametrize("targets", [["all-linear"], ["query", "value"], ["proj", "down_proj"]])
def test_adapter_parameters_are_the_built_models(targets: list[str]) -> None:
    lora = LoRAConfig(r=8, target_modules=targets)
    model = GPT(LLAMA, ParallelState.single(), dtype=torch.bfloat16, device="meta")
    apply_lora(model, lora)
    built = sum(p.numel() for p in lora_parameters(model).values())
    assert adapter_parameters_per_rank(LLAMA, lora, layout_at(1)) == built, targets


def test_adapter_parameters_split_as_the_layers_at_t2() -> None:
    """At t = 2 per layer: q ``r·h + r·a·d/2``, k and v ``r·h + r·g'·d/2`` (g' = 2), o
    ``r·a·d/2 + r·h``, gate and up ``r·h + r·f/2``, down ``r·f/2 + r·h``."""
    r, h, d, f = 8, 256, 32, 704
    per_layer = (r * h + r * 8 * d // 2) + 2 * (r * h + r * 2 * d // 2) + (r * 8 * d // 2 + r * h)
    per_layer += 2 * (r * h + r * f // 2) + (r * f // 2 + r * h)
    assert adapter_parameters_per_rank(LLAMA, LORA, layout_at(2, p=2)) == 2 * per_layer


def _layout(tmp_path, *extra: str):
    args = [
        "--model.config.vocab_size=512", "--model.config.seq_length=256",
        "--model.config.hidden_size=256", "--model.config.num_layers=4",
        "--model.config.num_heads=8", "--model.config.num_query_groups=2",
        "--model.config.ffn_hidden_size=704", "--model.config.normalization=rmsnorm",
        "--model.config.activation=swiglu", "--model.config.position_embedding=rope",
        "--model.config.bias=false", "--model.config.recompute=selective",
        "--model.config.sequence_parallel=true",
        "--trainer.strategy=lightning_sp.MegatronSPStrategy",
        "--trainer.strategy.tensor_parallel_size=2", "--trainer.devices=4",
        "--data.batch_size=2", f"--data.paths={tmp_path}/x.txt",
        f"--trainer.default_root_dir={tmp_path}",
        *extra,
    ]  # fmt: skip
    return args


def test_lora_prices_frozen_base_and_adapters(tmp_path) -> None:
    cli = read_estimate_args(_layout(tmp_path, "--model.lora.r=8",
                                     "--model.lora.target_modules=[all-linear]"))  # fmt: skip
    layout, lora = cli.layout, cli.lora
    assert lora is not None and lora.r == 8
    result = lora_estimate(layout, lora, "a100-80gb")
    table = estimate(layout, measure=False, cluster="a100-80gb")
    row = next(r for r in table.rows if r.selected)
    full, adapted = result.full, result.adapted
    assert full.model_state_bytes == row.model_state_bytes, "full fine-tune: the table's state"
    assert full.iteration_seconds == pytest.approx(row.iteration_seconds), "the table's step"
    adapters = adapter_parameters_per_rank(layout.config, lora, layout_at(2))
    assert adapted.trainable_parameters == adapters
    assert adapted.model_state_bytes == adapters * 18 + full.trainable_parameters * 2, (
        "frozen base: 2 bytes a weight; adapters: 18 (mixed-precision Adam)"
    )
    shape = layout.config.activation_shape(layout_at(2), 2)
    expected = activation_bytes_per_layer(with_adapters(shape, lora, layout.config), "selective")
    assert adapted.activation_bytes_per_layer == expected
    assert full.activation_bytes_per_layer == activation_bytes_per_layer(shape, "selective")
    qv = lora_estimate(layout, dataclasses.replace(lora, target_modules=["query"]), "a100-80gb")
    assert qv.adapted.activation_bytes_per_layer < full.activation_bytes_per_layer, (
        "a frozen MLP keeps no inputs for weight gradients"
    )
    # at a Llama 3 8B layer's width the frozen weight-gradient GEMMs outweigh the adapters'
    # small ones (at h = 256 they do not: r-wide GEMMs are memory bound)
    wide = dataclasses.replace(
        layout.config, seq_length=4096, hidden_size=4096, num_heads=32, num_query_groups=8,
        ffn_hidden_size=14336,
    )  # fmt: skip
    big = lora_estimate(dataclasses.replace(layout, config=wide), lora, "a100-80gb")
    assert big.adapted.iteration_seconds < big.full.iteration_seconds, "no wgrad GEMMs"
    query = dataclasses.replace(lora, target_modules=["query"])
    few = lora_estimate(dataclasses.replace(layout, config=wide), query, "a100-80gb")
    assert few.adapted.iteration_seconds < big.adapted.iteration_seconds, "fewer adapters"


def test_estimate_prints_lora_beside_full(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _layout(tmp_path, "--model.lora.r=8", "--formula_only=true")
    assert report_main(read_estimate_args, args) == 0
    out = capsys.readouterr().out
    assert "LoRA r=8 on query, value" in out and "full fine-tune" in out, out
    for label in ("model state", "activations per layer", "first-stage activations", "iteration"):
        assert label in out, f"{label} missing: {out}"


def test_search_ranks_the_lora_run(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``estimate --search`` of a LoRA config prices every layout as the LoRA run (the
    estimate's LoRA column: frozen base, adapters' activations and step), not as a full
    fine-tune; the configured layout's row is what ``estimate`` prints for it."""
    cli = read_estimate_args(_layout(tmp_path, "--model.lora.r=8"))
    layout, lora = cli.layout, cli.lora
    assert lora is not None
    cluster = load_cluster("a100-80gb")
    found = search(layout, cluster, 80e9, lora=lora)
    assert found.ranked, "no LoRA layout fits"
    for x in found.ranked:
        adapted = lora_estimate(x.layout, lora, cluster).adapted
        assert x.row.total_bytes == int(adapted.total_bytes), f"{x.key()}: memory not LoRA's"
        assert x.row.iteration_seconds == adapted.iteration_seconds, f"{x.key()}: step"
    rank = found.rank_of(base_key(layout))
    assert rank is not None, "the configured layout is not among the LoRA rows"
    configured = lora_estimate(layout, lora, cluster).adapted
    row = found.ranked[rank - 1].row
    assert (row.total_bytes, row.iteration_seconds) == (
        int(configured.total_bytes), configured.iteration_seconds,
    ), "--search prices the configured layout otherwise than estimate"  # fmt: skip
    args = _layout(tmp_path, "--model.lora.r=8", "--search=true", "--cluster=a100-80gb")
    assert report_main(read_estimate_args, args) == 0
    assert "LoRA r=8 on query, value: memory and step of the LoRA run" in capsys.readouterr().out


def test_estimate_json_keeps_lora_on_stderr(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--format json`` prints the rows as one JSON document on stdout and the LoRA run's
    pricing on stderr (it was dropped before)."""
    import json

    args = _layout(tmp_path, "--model.lora.r=8", "--formula_only=true", "--format=json")
    assert report_main(read_estimate_args, args) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert isinstance(rows, list) and rows, "stdout is the rows' JSON"
    assert "LoRA r=8 on query, value" in captured.err, f"LoRA pricing missing: {captured.err}"


def _saved(layout: Layout, **change: int) -> float:
    """What LoRA saves on ``layout`` (with ``change``): full fine-tune less LoRA, seconds."""
    run = lora_estimate(dataclasses.replace(layout, **change), LORA, "a100-80gb")
    return run.full.iteration_seconds - run.adapted.iteration_seconds


def test_lora_saving_spans_the_pipeline_bubble() -> None:
    """The frozen base shortens each layer's backward by some A and the output layer's by H, on
    every stage alike, so the pipeline term ``n·T_max + (p-1)/m·T_mean`` (T: L/p layers) drops
    by ``(n + (p-1)/m)·(L/p)·A + n·H``. At d = 1 (no data-parallel term) what else LoRA
    changes does not depend on n or m, so from the saving's growth with n at p = 1
    (``L·A + H`` per micro-batch) and at p = 2 (``(L/2)·A + H``), A follows, and halving the
    bubble (m = 1 -> 2 at p = 2, n = 4) gives back ``(1/2)·(L/2)·A``. (At h = 256 the adapters'
    small GEMMs outweigh the frozen weight gradients: A < 0; the relation is the same.)"""
    cfg = dataclasses.replace(LLAMA, recompute="none", sequence_parallel=False)
    L = cfg.num_layers
    flat = Layout(config=cfg, accumulate_grad_batches=1)
    e1 = _saved(flat, accumulate_grad_batches=2) - _saved(flat)  # L·A + H
    piped = Layout(config=cfg, pipeline_parallel_size=2, num_microbatches=4)
    e2 = _saved(piped, num_microbatches=8) - _saved(piped)  # 4·((L/2)·A + H)
    a = (4 * e1 - e2) / (2 * L)
    assert abs(a) > 1e-6, f"LoRA changes no layer's time (A = {a:.3e} s): the case tests nothing"
    got = _saved(piped) - _saved(piped, virtual_pipeline_size=2)
    assert got == pytest.approx(0.5 * (L / 2) * a, rel=1e-6), (
        f"LoRA at p = 2: the bubble's layers save {got:.3e} s more at m = 1 than m = 2, "
        f"expected (1/2)·(L/2)·A = {0.5 * (L / 2) * a:.3e} s (the frozen base's saving on "
        "the bubble's (p-1)/m layers' passes)"
    )


def test_lora_optimizer_step_is_sharded_by_the_distributed_optimizer() -> None:
    """LoRA's optimizer step streams 8 bytes per adapter parameter (norm, zeroing) and Adam's
    30 per parameter of this rank's shard: with the distributed optimizer over d = 4 that is
    ``30·(1 - 1/4)·adapters`` bytes less at the cluster's memory rate; the reduction is the
    same all-reduce either way."""
    layout = Layout(config=LLAMA, tensor_parallel_size=2, data_parallel_size=4,
                    accumulate_grad_batches=2)  # fmt: skip
    cluster = load_cluster("a100-80gb")
    runs = [
        lora_estimate(dataclasses.replace(layout, distributed_optimizer=z), LORA, cluster)
        for z in (False, True)
    ]
    adapters = adapter_parameters_per_rank(LLAMA, LORA, layout_at(2))
    expected = 30 * adapters * (1 - 1 / 4) / cluster.memory_rate
    got = runs[0].adapted.iteration_seconds - runs[1].adapted.iteration_seconds
    assert got == pytest.approx(expected, rel=1e-6), (
        f"LoRA with the distributed optimizer over d = 4: the step is {got:.3e} s shorter, "
        f"expected {expected:.3e} s (Adam's 30 bytes per adapter parameter over 4 shards)"
    )


def test_lora_full_fine_tune_shards_experts_over_expert_data_ranks() -> None:
    """The full fine-tune beside a LoRA run of a mixture of experts at e = 2, d = 4 with the
    distributed optimizer: 6 bytes a parameter replicated (bf16 weight, fp32 gradient), the
    12 of master and moments over the 4 dp ranks for the dense parameters, over the
    4/2 = 2 ranks that hold the same experts for the routed experts'."""
    moe = GPTConfig.of(
        "mistral", vocab_size=512, seq_length=256, hidden_size=128, num_layers=2, num_heads=4,
        num_query_groups=2, feed_forward="moe", recompute="none",
        moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_size=256),
    )  # fmt: skip
    layout = Layout(config=moe, data_parallel_size=4, expert_parallel_size=2,
                    distributed_optimizer=True)  # fmt: skip
    params, experts = parameters_per_rank(moe, layout), expert_parameters_per_rank(moe, layout)
    assert 0 < experts < params
    expected = 6 * params + 12 * (params - experts) / 4 + 12 * experts / 2
    got = lora_estimate(layout, LORA, "a100-80gb").full.model_state_bytes
    assert got == pytest.approx(expected, rel=1e-12), (
        f"full fine-tune at e = 2, d = 4, distributed optimizer: model state {got:.0f} B, "
        f"expected {expected:.0f} B (experts' optimizer state over d/e = 2 ranks)"
    )
