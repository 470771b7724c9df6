"""FP8 in the experts' grouped GEMMs (:mod:`lightning_sp.parallel.fp8_grouped`), with torchao's
emulated GEMMs on CPU.

Parity: at ``e = 2`` (each rank two of the four experts) and at ``t = etp = 2`` (each rank half
of every expert's ``f_e``, the TP group's gathered rows) our experts equal torchao's
``Float8Linear`` applied per expert (gate, up and down three converted ``nn.Linear``, SwiGLU
between them written out here) on the unsharded expert weights and the same rows, in the
output, the rows' gradient and every weight gradient, with and without the ``mlp_act``
recompute module, both recipes. Tolerance :data:`TOLERANCE` of each tensor's largest value:
the float8 operands are the same values (the scales are agreed where they span the slices),
so what is left is the order of the fp32 sums (the partial sums over the etp ranks, the
SwiGLU kernel); one flipped e4m3 rounding of an operand moves an output by about 2⁻⁴ of
that element's products, far above it. Controls: high precision misses the reference by
more than 100x the tolerance, and at etp = 2 with every amax left local tensorwise does too.

Bytes: a one-layer Llama-MoE in FP8 (bf16, forced-balanced routing) keeps what its parts state
(:meth:`~lightning_sp.model.moe.part.MoEFeedForward.float8_terms`), measured with saved-tensor
hooks at t = 1 and t = etp = 2 + SP, to the byte.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_sp import GPT, GPTConfig, ParallelState, SavedTensorTracker
from lightning_sp.memory.formulas import activation_bytes_per_layer, layernorm_stats_bytes_per_layer
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.experts import Experts
from lightning_sp.parallel import fp8
from lightning_sp.parallel.fp8 import FP8Config, Recipe
from lightning_sp.testing.spawn import run_distributed

from models import layout_at, moe_context

pytest.importorskip("torchao")

H, F, E = 32, 32, 4
COUNTS = (5, 0, 6, 3)  # rows per global expert, uneven, one expert without rows
TOLERANCE = 1e-5
MOE = MoEConfig(num_experts=E, top_k=2, expert_ffn_size=F)


def _inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def draw(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    n = sum(COUNTS)
    return {"x": draw(n, H), "gate": draw(E, F, H, std=0.1), "up": draw(E, F, H, std=0.1),
            "down": draw(E, H, F, std=0.1), "target": draw(n, H)}  # fmt: skip


def _reference(recipe: str | None, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per expert, torchao's Float8Linear for its gate, up and down on its rows (``None``:
    the same linears in high precision, the control)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x = t["x"].clone().requires_grad_(True)
    outs, mlps = [], []
    for i, rows in enumerate(x.split(COUNTS)):
        mlp = nn.ModuleDict({
            "gate": nn.Linear(H, F, bias=False), "up": nn.Linear(H, F, bias=False),
            "down": nn.Linear(F, H, bias=False),
        })  # fmt: skip
        with torch.no_grad():
            for name, linear in mlp.items():
                linear.weight.copy_(t[name][i])
        if recipe is not None:
            config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
            convert_to_float8_training(mlp, config=config)
            assert type(mlp["gate"]).__name__ == "Float8Linear", "torchao did not convert"
        mlps.append(mlp)
        if not rows.shape[0]:  # an expert without rows: no output, no gradient
            outs.append(rows.new_zeros(0, H))
            continue
        act = nn.functional.silu(mlp["gate"](rows)) * mlp["up"](rows)
        outs.append(mlp["down"](act))
    y = torch.cat(outs)
    (y * t["target"]).sum().backward()

    def grad(linear: nn.Module) -> torch.Tensor:
        return linear.weight.grad if linear.weight.grad is not None else 0 * linear.weight

    grads = {n: torch.stack([grad(m[n]) for m in mlps]).detach() for n in ("gate", "up", "down")}
    return {"y": y.detach(), "x": x.grad, **grads}


def _ours(
    recipe: str | None, t: dict[str, torch.Tensor], state: ParallelState, recompute_act: bool
) -> dict[str, torch.Tensor]:
    """This rank's experts (its EP block, its etp slice) on the rows dispatched to them."""
    e, t_e = state.expert_parallel_size, state.expert_tensor_parallel_size
    r = state.tensor_parallel_rank if t_e > 1 else 0
    ctx = moe_context(MOE, H, state, sequence_parallel=t_e > 1, recompute_act=recompute_act)
    experts = Experts(ctx, MOE)
    local = E // e
    first = state.expert_parallel_rank * local
    mine, inner = slice(first, first + local), slice(r * F // t_e, (r + 1) * F // t_e)
    with torch.no_grad():
        experts.gate_up.copy_(torch.cat([t["gate"][mine, inner], t["up"][mine, inner]], 1))
        experts.down.copy_(t["down"][mine][:, :, inner])
    experts.fp8 = Recipe.build(FP8Config(recipe, emulate=True)) if recipe else None
    start, stop = sum(COUNTS[:first]), sum(COUNTS[: first + local])
    x = t["x"][start:stop].clone().requires_grad_(True)
    y = experts(x, list(COUNTS[mine]), recompute_act)  # [N_local, h], partial sums under etp
    (y * t["target"][start:stop]).sum().backward()
    assert x.grad is not None and experts.gate_up.grad is not None
    y, grad_x = y.detach(), x.grad
    if t_e > 1:  # the partial sums the layer's scatter_rows reduces
        for partial in (y, grad_x):
            torch.distributed.all_reduce(partial, group=state.tp_group)
    gate, up = experts.gate_up.grad.chunk(2, dim=1)
    return {
        "y": y,
        "x": grad_x,
        "gate": gate,
        "up": up,
        "down": experts.down.grad,
        "where": torch.tensor([start, stop, first, first + local, inner.start, inner.stop]),
    }


def _errors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's largest error over its reference's largest value."""
    start, stop, e0, e1, f0, f1 = ours["where"].tolist()
    rows, mine, inner = slice(start, stop), slice(e0, e1), slice(f0, f1)
    pairs = {
        "y": (ours["y"], ref["y"][rows]),
        "x": (ours["x"], ref["x"][rows]),
        "gate": (ours["gate"], ref["gate"][mine, inner]),
        "up": (ours["up"], ref["up"][mine, inner]),
        "down": (ours["down"], ref["down"][mine][:, :, inner]),
    }
    return {k: ((a - b).abs().max() / b.abs().max()).item() for k, (a, b) in pairs.items()}


LAYOUTS = {"e=2": {"expert_parallel_size": 2}, "t=etp=2": {"tensor_parallel_size": 2,
           "expert_tensor_parallel_size": 2}}  # fmt: skip


def _worker(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    t = _inputs()
    refs = {recipe: _reference(recipe, t) for recipe in fp8.RECIPES}
    results = {}
    for layout, sizes in LAYOUTS.items():
        state = ParallelState.from_process_group(**sizes)
        for recipe in fp8.RECIPES:
            for recompute_act in (False, True):
                ours = _ours(recipe, t, state, recompute_act)
                results[f"{layout} {recipe} mlp_act={recompute_act}"] = _errors(ours, refs[recipe])
        results[f"{layout} control: bf16 path"] = _errors(_ours(None, t, state, False),
                                                        refs["tensorwise"])  # fmt: skip
        if layout == "t=etp=2":  # the control: every amax local
            saved = dict(fp8.LAYOUTS)
            fp8.LAYOUTS["column"] = fp8.LAYOUTS["row"] = (None, None, None)
            ours = _ours("tensorwise", t, state, False)
            results[f"{layout} control: local amax"] = _errors(ours, refs["tensorwise"])
            fp8.LAYOUTS.update(saved)
    return results


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_experts_equal_torchao_float8_linear_per_expert_one_process(recipe: str) -> None:
    t = _inputs()
    errors = _errors(_ours(recipe, t, ParallelState.single(), False), _reference(recipe, t))
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= TOLERANCE, (
        f"{recipe}: {worst} off torchao's per-expert Float8Linear by {errors[worst]:.3g}"
    )


@pytest.mark.slow
def test_fp8_experts_equal_torchao_float8_linear_per_expert_at_e2_and_etp2() -> None:
    for rank, result in enumerate(run_distributed(_worker, 2)):
        for case, errors in result.items():
            worst = max(errors, key=errors.__getitem__)
            if "control" in case:
                assert errors[worst] > 100 * TOLERANCE, (
                    f"rank {rank} {case}: still within 100x the tolerance of torchao's "
                    f"Float8Linear ({worst} {errors[worst]:.3g}): the test cannot see FP8"
                )
            else:
                assert errors[worst] <= TOLERANCE, (
                    f"rank {rank} {case}: {worst} off torchao's per-expert Float8Linear by "
                    f"{errors[worst]:.3g} (tolerance {TOLERANCE})"
                )


# -- bytes --------------------------------------------------------------------------------

S, B, BYTES_H = 16, 2, 32
BYTES_MOE = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=32, num_shared_experts=1,
                      shared_expert_ffn_size=32, force_balanced=True)  # fmt: skip
BYTE_ROWS = ("tensorwise-none", "tensorwise-mlp_act", "rowwise-none")


def _byte_config(row: str, t: int) -> GPTConfig:
    recipe, recompute = row.split("-")  # mlp_act: the experts' down inputs (and scales) go
    return GPTConfig.of(
        "llama", vocab_size=64, seq_length=S, hidden_size=BYTES_H, num_layers=1, num_heads=4,
        num_query_groups=4, feed_forward="moe", moe=BYTES_MOE,
        recompute=[recompute] if recompute != "none" else recompute,
        sequence_parallel=t > 1, fp8=FP8Config(recipe, emulate=True),
    )  # fmt: skip


def _byte_check(state: ParallelState, rows: tuple[str, ...] = BYTE_ROWS) -> list[str]:
    """Each row's measured bytes of the layer against the formula (the layer's terms and the
    norms' statistics); the misses."""
    t, etp = state.tensor_parallel_size, state.expert_tensor_parallel_size
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(0))
    misses = []
    for row in rows:
        config = _byte_config(row, t)
        model = GPT(config, state, dtype=torch.bfloat16).train()
        with SavedTensorTracker.for_model(model) as tracker:
            loss = model(ids, ids)
        loss.backward()  # the saved tensors were real: backward runs on them
        got = tracker.report.bytes_of("layers.0")
        shape = config.activation_shape(layout_at(t, etp=etp), B)
        expected = activation_bytes_per_layer(shape, config.recompute)
        expected += layernorm_stats_bytes_per_layer(shape, config.recompute)
        if got != expected:
            misses.append(f"t={t} etp={etp} {row}: measured {got}, formula {expected}")
    return misses


@pytest.mark.parametrize("row", BYTE_ROWS)
def test_fp8_moe_bytes_one_process(row: str) -> None:
    misses = _byte_check(ParallelState.single(), (row,))
    assert not misses, "; ".join(misses)


def _byte_worker(rank: int, world_size: int) -> list[str]:
    state = ParallelState.from_process_group(tensor_parallel_size=2, expert_tensor_parallel_size=2)
    return _byte_check(state)


@pytest.mark.slow
def test_fp8_moe_bytes_at_t2_etp2() -> None:
    misses = [m for result in run_distributed(_byte_worker, 2) for m in result]
    assert not misses, "; ".join(misses)
