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
from lightning_sp.model import ops
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


@contextmanager
def wide_norms() -> Iterator[None]:
    """Inside: our RMSNorm is float64 throughout for float64 inputs (plain autograd)."""
    saved = ops._RMSNorm.apply
    ops._RMSNorm.apply = staticmethod(_wide_rms)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ops._RMSNorm.apply = saved  # type: ignore[method-assign]


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


def peft_reference(
    directory: Path, config: GPTConfig, adapters: dict[str, torch.Tensor], wide: bool
) -> dict[str, Any]:
    """``peft`` on the saved Llama with ``adapters``: logits, loss, and every adapter's
    gradient by our global name (float64; ``wide``: float64 norms)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    hf = hf.double().eval()
    if wide:
        widen_hf_norms(hf)
    settings = peft.LoraConfig(r=LORA.r, lora_alpha=LORA.lora_alpha, target_modules=HF_TARGETS)
    model = peft.get_peft_model(hf, settings).double()
    modules = hf_modules(model_type_for(config), config)
    theirs = dict(model.named_parameters())
    keys = {}
    with torch.no_grad():
        for name, value in adapters.items():
            linear, _, which = name.rpartition(".lora.")
            keys[name] = peft_name(linear, which, modules).replace(".weight", ".default.weight")
            theirs[keys[name]].copy_(value)
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
) -> list[GPT]:
    """Our chunks (``model``'s, or one GPT) loaded from ``directory``, adapted, their adapter
    shards set to their slices of ``adapters``."""
    chunks = list(model.chunks) if model is not None else [GPT(config, state, dtype=torch.float64)]
    for chunk in chunks:
        load_hf_weights(chunk, directory)
        apply_lora(chunk, LORA)
        with torch.no_grad():
            for name, param in lora_parameters(chunk).items():
                param.copy_(local_slice(param, adapters[chunk.global_name(name)]))
    return chunks


__all__ = [
    "LORA", "adapted_shard", "full_adapters", "llama_config", "peft_reference", "wide_norms",
]  # fmt: skip
