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
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.lora import LoRAConfig, apply_lora, lora_parameters, with_adapters
from lightning_sp.parallel.state import ParallelState
from lightning_sp.planner.estimate import estimate
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
