"""bf16 weights with fp32 gradient accumulation and fp32 master weights (Megatron's scheme)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sp.optim.adamw import (
    MasterWeightAdamW,
    OptimizerConfig,
    build_adamw,
    configure_adamw,
    kernel_options,
)


def test_bf16_model_gets_fp32_masters_and_fp32_gradient_accumulation() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    optimizer = build_adamw(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert isinstance(optimizer, MasterWeightAdamW)
    assert optimizer.defaults["foreach"] is True  # multi-tensor kernels on CPU
    # an fp32 AdamW on fp32 copies, fed the same fp32-accumulated gradients, is the reference:
    # the per-parameter loop implementation
    groups = [{"params": [masters[0]], "weight_decay": 0.1}, {"params": [masters[1]]}]
    reference = torch.optim.AdamW(
        groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False
    )

    for _ in range(3):
        inputs = [torch.randn(16, 8) for _ in range(4)]  # four micro-batches per step

        def loss(x: torch.Tensor) -> torch.Tensor:
            return model(x.bfloat16()).float().pow(2).mean()

        expected = [torch.zeros_like(m) for m in masters]
        for x in inputs:  # each micro-batch's bf16 gradient, summed in fp32
            grads = torch.autograd.grad(loss(x), list(model.parameters()))
            for total, g in zip(expected, grads, strict=True):
                total.add_(g)
        for x in inputs:
            loss(x).backward()
            assert model.weight.grad is None  # moved into the fp32 buffer at once
        for p, total in zip(model.parameters(), expected, strict=True):
            assert p.main_grad.dtype == torch.float32
            assert torch.equal(p.main_grad, total)

        for m, total in zip(masters, expected, strict=True):
            m.grad = total
        reference.step()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.count_nonzero(model.weight.main_grad) == 0

    saved = optimizer.state_dict()["master_weights"]
    for mine, ref, p in zip(saved, masters, model.parameters(), strict=True):
        assert mine.dtype == torch.float32
        assert torch.equal(mine, ref.detach())  # foreach does the loop's arithmetic exactly
        assert torch.equal(p, mine.to(torch.bfloat16))  # the model holds the rounded masters


def test_master_weights_survive_a_state_dict_round_trip() -> None:
    model = nn.Linear(4, 4).to(torch.bfloat16)
    optimizer = build_adamw(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    model(torch.randn(2, 4).bfloat16()).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()

    other = nn.Linear(4, 4).to(torch.bfloat16)
    restored = build_adamw(other, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    restored.load_state_dict(saved)
    for a, b in zip(restored.state_dict()["master_weights"], saved["master_weights"], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(other.weight, model.weight)


def test_fp32_model_gets_the_foreach_adamw_on_cpu() -> None:
    model = nn.Linear(4, 4)
    optimizer = build_adamw(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


def test_kernel_options_pick_fused_on_cuda_and_foreach_elsewhere() -> None:
    assert kernel_options(torch.device("cuda", 0)) == {"fused": True}
    assert kernel_options(torch.device("cpu")) == {"foreach": True}


def _lrs(cfg: OptimizerConfig, max_steps: int, steps: int) -> list[float]:
    """The learning rate of each of the first ``steps`` optimizer steps, every param group's the
    same, the scheduler stepped once per optimizer step (Lightning's ``interval: step``)."""
    configured = configure_adamw(nn.Linear(2, 2), cfg, max_steps)
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]
    assert isinstance(schedule, dict) and schedule["interval"] == "step"
    lrs = []
    for _ in range(steps):
        (lr,) = {group["lr"] for group in optimizer.param_groups}
        lrs.append(lr)
        optimizer.step()
        schedule["scheduler"].step()
    return lrs


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr() -> None:
    """GPT-3's schedule as ``configure_adamw`` builds it: lr = 1e-3, min_lr = 1e-4, 4 warm-up
    steps, the cosine ending at max_steps = 12 (no ``decay_steps``). Expected values by hand:
    step k < 4 trains at (k + 1)/4 · lr; step k >= 4 at
    min_lr + (lr - min_lr)/2 · (1 + cos(π (k - 4)/8)) (cos(π/8) = 0.9238795,
    cos(π/4) = 0.7071068); from step 12 on, min_lr."""
    lrs = _lrs(OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4), max_steps=12, steps=21)
    expected = {
        0: 2.5e-4, 1: 5.0e-4, 2: 7.5e-4, 3: 1.0e-3,  # warm-up: the peak at its last step
        4: 1.0e-3,  # the cosine starts at the peak
        5: 1e-4 + 4.5e-4 * 1.9238795,
        6: 1e-4 + 4.5e-4 * 1.7071068,
        8: 5.5e-4,  # half-way: (lr + min_lr) / 2
        10: 1e-4 + 4.5e-4 * (1 - 0.7071068),
        11: 1e-4 + 4.5e-4 * (1 - 0.9238795),
        12: 1e-4, 13: 1e-4, 20: 1e-4,  # min_lr reached at max_steps and kept
    }  # fmt: skip
    for step, want in expected.items():
        assert lrs[step] == pytest.approx(want, rel=1e-6), (
            f"step {step}: lr {lrs[step]:.7g}, expected {want:.7g} (linear warm-up to lr over "
            "warmup_steps, cosine to min_lr at max_steps)"
        )
    # decay_steps set: the cosine ends there, not at max_steps; no warm-up: the peak at step 0
    lrs = _lrs(OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=0, decay_steps=8), 100, 10)
    assert lrs[0] == pytest.approx(1e-3) and lrs[4] == pytest.approx(5.5e-4), (
        f"decay_steps=8 without warm-up: lr {lrs[0]:.4g} at step 0, {lrs[4]:.4g} at step 4; "
        "expected 1e-3 and 5.5e-4"
    )
    assert lrs[8:] == pytest.approx([1e-4, 1e-4]), f"min_lr not reached at decay_steps: {lrs}"


def test_weight_decay_skips_biases_and_norms_but_not_embeddings() -> None:
    """Decay on the matrices (linear and embedding weights), none on 1-D parameters (biases,
    LayerNorm weights and biases)."""
    model = nn.ModuleDict(
        {"embedding": nn.Embedding(8, 4), "norm": nn.LayerNorm(4), "linear": nn.Linear(4, 4)}
    )
    optimizer = build_adamw(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {g["weight_decay"]: sorted(names[id(p)] for p in g["params"])
             for g in optimizer.param_groups}  # fmt: skip
    assert decay == {
        0.1: ["embedding.weight", "linear.weight"],
        0.0: ["linear.bias", "norm.bias", "norm.weight"],
    }, f"weight-decay groups {decay}: decay on matrices only, none on biases and norms"
