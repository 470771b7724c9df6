"""bf16 weights with fp32 gradient accumulation and fp32 master weights (Megatron's scheme)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sp.optim.adamw import MasterWeightAdamW, build_adamw, kernel_options


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
