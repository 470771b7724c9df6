"""RMSNorm in bf16 keeps its statistics in fp32 (as Llama's reference code and Hugging Face's
``LlamaRMSNorm`` do): every other numerical test runs float64, where the statistics' dtype
cannot show. Here a bf16 input of width 4096 with a spread of magnitudes: the forward equals
the fp32-statistics formula bit for bit, the saved ``rstd`` is fp32, and forward and backward
stay within bf16's own rounding of the float64 norm."""

from __future__ import annotations

import torch

from lightning_sp.model.ops import rms_norm

WIDTH, ROWS, EPS = 4096, 16, 1e-5


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    scale = torch.logspace(-2, 2, ROWS, dtype=torch.float64)[:, None]  # rows of every size
    x = (torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64) + 3.0) * scale
    weight = 1 + 0.1 * torch.randn(WIDTH, generator=generator, dtype=torch.float64)
    grad = torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    return x, weight, grad


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def test_bf16_rms_norm_keeps_fp32_statistics() -> None:
    x64, w64, g64 = _inputs()
    x = x64.to(torch.bfloat16).requires_grad_()
    w = w64.to(torch.bfloat16).requires_grad_()
    y = rms_norm(x, w, None, EPS)
    # the contract: fp32 statistics, the normalised input cast to bf16, then the weight
    x32 = x.detach().float()
    formula = w.detach() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16()
    assert torch.equal(y.detach(), formula), (
        "bf16 RMSNorm differs from the fp32-statistics formula (max |diff| "
        f"{(y.detach().float() - formula.float()).abs().max().item():.3e}): statistics not in fp32"
    )
    saved = [t for t in y.grad_fn.saved_tensors if t.dim() == 2 and t.shape[-1] == 1]
    assert [t.dtype for t in saved] == [torch.float32], "rstd must be saved in fp32"
    # accuracy against float64 on the same bf16 inputs: two bf16 roundings at most
    x_ref = x.detach().double().requires_grad_()
    w_ref = w.detach().double().requires_grad_()
    y_ref = _reference(x_ref, w_ref)
    err = ((y.detach().double() - y_ref.detach()).abs() / y_ref.detach().abs()).max().item()
    assert err <= 2 * 2**-8, f"bf16 RMSNorm forward relative error {err:.3e} > 2^-7"
    grad = g64.to(torch.bfloat16)
    y.backward(grad)
    y_ref.backward(grad.double())
    for name, got, want in (("input", x.grad, x_ref.grad), ("weight", w.grad, w_ref.grad)):
        assert got is not None and want is not None
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel <= 2**-7, f"bf16 RMSNorm {name} gradient relative error {rel:.3e} > 2^-7"
