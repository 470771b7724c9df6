"""FP8 in the tensor-parallel linears (:mod:`lightning_sp.parallel.fp8`), with torchao's
emulated GEMMs on CPU: at t=2 with sequence parallelism a column- then row-parallel MLP equals
``torchao``'s ``Float8Linear`` on the unsharded layers (same recipe, same inputs) in its output,
its input gradient and both weight gradients, to 1e-4 of each tensor's largest value (the
fp32 sums' order: the casts are the same float8 values); without the agreed amaxes the
tensorwise recipe misses that by far (the test's control). Bad settings are one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_sp.errors import ConfigError
from lightning_sp.parallel import fp8
from lightning_sp.parallel.comm import g_bar
from lightning_sp.parallel.fp8 import (
    FP8Config,
    Recipe,
    check_fp8,
    fp8_column_parallel_linear,
    fp8_row_parallel_matmul,
)
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing.spawn import run_distributed

pytest.importorskip("torchao")

S, B, H, F = 8, 2, 32, 64
TOLERANCE = 1e-4


def _inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def draw(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    return {"x": draw(S, B, H), "w1": draw(F, H, std=0.1), "w2": draw(H, F, std=0.1),
            "target": draw(S, B, H)}  # fmt: skip


def _reference(recipe: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchao's Float8Linear on the whole MLP."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    mlp = nn.Sequential(nn.Linear(H, F, bias=False), nn.GELU(), nn.Linear(F, H, bias=False))
    with torch.no_grad():
        mlp[0].weight.copy_(t["w1"])
        mlp[2].weight.copy_(t["w2"])
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(mlp, config=config)
    assert type(mlp[0]).__name__ == "Float8Linear", "torchao did not convert the reference"
    x = t["x"].clone().requires_grad_(True)
    y = mlp(x)
    (y * t["target"]).sum().backward()
    return {"y": y.detach(), "x": x.grad, "w1": mlp[0].weight.grad, "w2": mlp[2].weight.grad}


def _ours(recipe: str, t: dict[str, torch.Tensor], state: ParallelState) -> dict[str, torch.Tensor]:
    """The same MLP at t=2 + SP: each rank's sequence shard and weight slices."""
    r, n = state.tensor_parallel_rank, state.tensor_parallel_size
    rows, features = slice(r * S // n, (r + 1) * S // n), slice(r * F // n, (r + 1) * F // n)
    built = Recipe.build(FP8Config(recipe, emulate=True))
    x = t["x"][rows].clone().requires_grad_(True)
    w1 = t["w1"][features].clone().requires_grad_(True)
    w2 = t["w2"][:, features].clone().requires_grad_(True)
    z = fp8_column_parallel_linear(x, w1, None, built, state.tp_group, sequence_parallel=True)
    partial = fp8_row_parallel_matmul(nn.functional.gelu(z), w2, built, state.tp_group)
    y = g_bar(partial, state.tp_group)  # [s/t, b, h]
    (y * t["target"][rows]).sum().backward()
    assert x.grad is not None and w1.grad is not None and w2.grad is not None
    return {"y": y.detach(), "x": x.grad, "w1": w1.grad, "w2": w2.grad,
            "rows": torch.tensor([rows.start, rows.stop]),
            "features": torch.tensor([features.start, features.stop])}  # fmt: skip


def _errors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's largest error over its reference's largest value."""
    rows, features = (slice(*ours[k].tolist()) for k in ("rows", "features"))
    pairs = {
        "y": (ours["y"], ref["y"][rows]),
        "x": (ours["x"], ref["x"][rows]),
        "w1": (ours["w1"], ref["w1"][features]),
        "w2": (ours["w2"], ref["w2"][:, features]),
    }
    return {k: ((a - b).abs().max() / b.abs().max()).item() for k, (a, b) in pairs.items()}


def _worker(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    state = ParallelState.from_process_group(tensor_parallel_size=2)
    t = _inputs()
    results = {}
    for recipe in fp8.RECIPES:
        results[recipe] = _errors(_ours(recipe, t, state), _reference(recipe, t))
    fp8.LAYOUTS["column"] = fp8.LAYOUTS["row"] = (None, None, None)  # the control: no agreement
    results["tensorwise, local scales"] = _errors(_ours("tensorwise", t, state),
                                                  _reference("tensorwise", t))  # fmt: skip
    return results


@pytest.mark.slow
def test_tp2_sp_fp8_linears_equal_torchao_float8_linear_on_the_whole_layer() -> None:
    results = run_distributed(_worker, 2)
    for rank, result in enumerate(results):
        for recipe in fp8.RECIPES:
            for name, error in result[recipe].items():
                assert error <= TOLERANCE, (
                    f"rank {rank} {recipe} {name}: {error:.3g} of the largest value "
                    f"> {TOLERANCE} (all: {result[recipe]})"
                )
        control = result["tensorwise, local scales"]
        assert max(control.values()) > 10 * TOLERANCE, (
            f"rank {rank}: unagreed tensorwise scales gave torchao's values too ({control}): "
            "the comparison cannot see a missing amax reduction"
        )


@pytest.mark.parametrize(
    ("config", "device", "message"),
    [
        (FP8Config("blockwise", emulate=True), "cpu",
         r"^fp8.recipe='blockwise' is not a recipe; valid: tensorwise, rowwise \(or null: off\)$"),
        (FP8Config("tensorwise"), "cpu",
         r"^fp8.recipe='tensorwise' on CPU: a CPU has no FP8 GEMMs; set fp8.emulate=true"),
        (FP8Config("rowwise", emulate="yes"), "cpu",  # type: ignore[arg-type]
         r"^fp8.emulate='yes' is invalid; it must be true or false$"),
    ],
)  # fmt: skip
def test_bad_fp8_settings_are_one_line(config: FP8Config, device: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_fp8(config, torch.device(device))


def test_a_gpu_without_fp8_gemms_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """An A100 (compute capability 8.0), as CUDA would report it."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"^fp8.recipe='tensorwise' needs FP8 GEMMs \(compute "
                       r"capability >= 8.9.*NVIDIA A100-SXM4-80GB has 8.0"):  # fmt: skip
        check_fp8(FP8Config("tensorwise"), torch.device("cuda", 0))
    check_fp8(FP8Config("tensorwise", emulate=True), torch.device("cuda", 0))  # emulated: fine


def _train(recipe: str | None, steps: int) -> list[float]:
    """A two-layer MLP (h=64, f=256, bf16) fitted to a fixed random teacher for ``steps``
    AdamW steps; its linears in float8 (``recipe``) or bf16 (``None``)."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(512, 1, 64)
    with torch.no_grad():
        target = teacher(x).to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    w1 = nn.Parameter(torch.randn(256, 64, dtype=torch.bfloat16) * 0.05)
    w2 = nn.Parameter(torch.randn(64, 256, dtype=torch.bfloat16) * 0.05)
    optimizer = torch.optim.AdamW([w1, w2], lr=3e-3)
    built = Recipe.build(FP8Config(recipe, emulate=True)) if recipe else None
    losses = []
    for _ in range(steps):
        if built is None:
            y = nn.functional.linear(nn.functional.gelu(nn.functional.linear(x, w1)), w2)
        else:
            z = fp8_column_parallel_linear(x, w1, None, built, None, sequence_parallel=False)
            y = fp8_row_parallel_matmul(nn.functional.gelu(z), w2, built, None)
        loss = nn.functional.mse_loss(y.float(), target.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


BAND = 0.05
"""An FP8 run's loss may differ from bf16's by this share of bf16's, at every step."""


@pytest.mark.slow
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_a_tiny_fp8_run_stays_within_a_band_of_bf16(recipe: str) -> None:
    steps = 40
    bf16, ours = _train(None, steps), _train(recipe, steps)
    assert bf16[-1] < 0.5 * bf16[0], f"the bf16 run did not learn: {bf16[0]:.4f} -> {bf16[-1]:.4f}"
    worst = max(abs(a - b) / b for a, b in zip(ours, bf16, strict=True))
    assert worst <= BAND, (
        f"{recipe}: loss {worst:.1%} away from bf16's (band {BAND:.0%}); "
        f"bf16 {bf16[::10]}, fp8 {ours[::10]}"
    )
