"""Shared by the LoRA tests: a saved random Llama, ``peft`` on its transformers model as the
reference (adapters on every linear, B non-zero), and our model in any layout with the same
base and adapter weights.

Transformers' ``LlamaRMSNorm`` computes its statistics in fp32 even in a float64 model, and
autograd then runs the norm's backward in fp32: its float64 gradients are fp32-accurate
(5e-8 relative on the base weights against ours, measured). Gradient parity to 1e-10 needs
float64 norms on both sides: :func:`wide_norms` runs both models' RMSNorms in float64 (plain
autograd on our side, the reference's forward on theirs), leaving everything else as it is;
logits and loss are compared with the stock norms too.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_sp.interop.hf import load_hf_weights
from lightning_sp.interop.hf_types import model_type_for
from lightning_sp.interop.peft import hf_modules, peft_name
from lightning_sp.model import ops, qk_norm
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.lora import LoRAConfig, apply_lora, lora_parameters
from lightning_sp.parallel.init import local_slice
from lightning_sp.parallel.state import ParallelState

from hf_models import llama_config, tokens

LORA = LoRAConfig(r=4, lora_alpha=8.0, target_modules=["all-linear"])
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _wide_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _wide_hf_norm(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    return _wide_rms(hidden, self.weight, self.variance_epsilon)


def _wide_qk_norm(
    qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float, per_head: bool,
    *rest: Any,
) -> torch.Tensor:  # fmt: skip
    """Qwen3's per-head query/key norm on ``[s, b, G, r + 2, d]`` in the input's dtype."""
    assert per_head, "wide_norms widens the per-head (Qwen3) query/key norm only"
    r = qkv.shape[3] - 2
    q, k, v = qkv[:, :, :, :r], qkv[:, :, :, r : r + 1], qkv[:, :, :, r + 1 :]
    return torch.cat([_wide_rms(q, wq, eps), _wide_rms(k, wk, eps), v], dim=3)


@contextmanager
def wide_norms() -> Iterator[None]:
    """Inside: our RMSNorm, and Qwen3's per-head query/key norm (fp32 statistics as
    transformers' ``Qwen3RMSNorm``), are float64 throughout for float64 inputs (plain
    autograd)."""
    saved, saved_qk = ops._RMSNorm.apply, qk_norm._QKNorm.apply
    ops._RMSNorm.apply = staticmethod(_wide_rms)  # type: ignore[method-assign]
    qk_norm._QKNorm.apply = staticmethod(_wide_qk_norm)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ops._RMSNorm.apply = saved  # type: ignore[method-assign]
        qk_norm._QKNorm.apply = saved_qk  # type: ignore[method-assign]


def widen_hf_norms(model: Any) -> None:
    """Every RMSNorm of a transformers model with float64 statistics."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_wide_hf_norm, module)


def full_adapters(config: GPTConfig, lora: LoRAConfig, seed: int = 5) -> dict[str, torch.Tensor]:
    """Random full adapter tensors (``B`` non-zero) of ``config``'s one-process model, by our
    global names."""
    model = GPT(config, ParallelState.single(), dtype=torch.float64, device="meta")
    apply_lora(model, lora)
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.2
        for name, p in lora_parameters(model).items()
    }


class FixedDropout(torch.nn.Module):
    """Dropout with a given keep-mask: ``x · mask / (1 - p)`` (plain autograd), in place of
    peft's ``nn.Dropout`` so that it drops what ours drew."""

    def __init__(self, mask: torch.Tensor, p: float) -> None:
        super().__init__()
        self.mask, self.p = mask, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask.to(x.dtype) / (1.0 - self.p)


def peft_reference(
    directory: Path,
    config: GPTConfig,
    adapters: dict[str, torch.Tensor],
    wide: bool,
    lora: LoRAConfig = LORA,
    targets: list[str] | None = None,
    prepare: Any = None,
    masks: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """``peft`` on the saved model (Llama, or any family ``config`` reads) with ``adapters``
    (``lora``'s settings on the Hugging Face linears ``targets``, default every one of
    Llama's): logits, loss, and every adapter's gradient by our global name (float64;
    ``wide``: float64 norms; an MoE model's experts run transformers' eager loop, as
    ``torch._grouped_mm`` refuses float64; ``prepare(model)``: a last change to the
    transformers model, e.g. a wider router; ``masks``: ``lora.lora_dropout`` applied with
    these keep-masks, ``[b, s, k]`` by our linear's global name, as :class:`FixedDropout`)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    hf.config._experts_implementation = "eager"
    hf = hf.double().eval()
    if wide:
        widen_hf_norms(hf)
    if prepare is not None:
        prepare(hf)
    settings = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.lora_alpha, target_modules=targets or HF_TARGETS,
        use_rslora=lora.use_rslora, lora_dropout=lora.lora_dropout,
    )  # fmt: skip
    model = peft.get_peft_model(hf, settings).double()
    modules = hf_modules(model_type_for(config), config)
    theirs = dict(model.named_parameters())
    keys = {}
    with torch.no_grad():
        for name, value in adapters.items():
            linear, _, which = name.rpartition(".lora.")
            keys[name] = peft_name(linear, which, modules).replace(".weight", ".default.weight")
            theirs[keys[name]].copy_(value)
    for linear, mask in (masks or {}).items():  # peft's dropout module, with our mask
        layer = keys[f"{linear}.lora.A"].removesuffix(".lora_A.default.weight")
        dropout = model.get_submodule(layer).lora_dropout
        dropout["default"] = FixedDropout(mask, lora.lora_dropout)
    ids, labels = tokens()
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {name: theirs[key].grad.detach().clone() for name, key in keys.items()}
    return {"ids": ids, "labels": labels, "logits": logits.detach(), "loss": loss.detach(),
            "grads": grads}  # fmt: skip


def adapted_shard(
    config: GPTConfig,
    state: ParallelState,
    directory: str,
    adapters: dict[str, torch.Tensor],
    model: Any = None,
    lora: LoRAConfig = LORA,
) -> list[GPT]:
    """Our chunks (``model``'s, or one GPT) loaded from ``directory``, adapted with ``lora``,
    their adapter shards set to their slices of ``adapters``."""
    chunks = list(model.chunks) if model is not None else [GPT(config, state, dtype=torch.float64)]
    for chunk in chunks:
        load_hf_weights(chunk, directory)
        apply_lora(chunk, lora)
        with torch.no_grad():
            for name, param in lora_parameters(chunk).items():
                param.copy_(local_slice(param, adapters[chunk.global_name(name)]))
    return chunks


__all__ = [
    "LORA", "adapted_shard", "full_adapters", "llama_config", "peft_reference", "wide_norms",
]  # fmt: skip
