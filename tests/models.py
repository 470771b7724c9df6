"""Shared builders for model tests: tiny configs, a seeded batch, shard-vs-reference checks."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.parallel.grads import allreduce_sequence_parallel_grads


def tiny_config(**overrides: object) -> GPTConfig:
    """A 2-layer GPT small enough for float64 on four ranks; vocab 300 exercises padding."""
    fields: dict[str, object] = dict(
        vocab_size=300, seq_length=16, hidden_size=32, num_layers=2, num_heads=4,
        hidden_dropout=0.0, attention_dropout=0.0, seed=7,
    )  # fmt: skip
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


def batch(
    config: GPTConfig, batch_size: int = 2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels ``[b, s]``, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(
        0, config.vocab_size, (batch_size, config.seq_length + 1), generator=generator
    )
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model: GPT, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One forward/backward; gradients finished as the trainer does (SP grads reduced)."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels)
    loss.backward()
    allreduce_sequence_parallel_grads(model, model.state)
    return loss.detach()


def reference_model(config: GPTConfig) -> GPT:
    """The one-process float64 model from the same seed."""
    return GPT(config, ParallelState.single(), dtype=torch.float64)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.norm().item()
    return (a - b).norm().item() / (scale if scale > 0 else 1.0)


def assert_matches_reference(model: GPT, reference: nn.Module, rtol: float, what: str = "") -> int:
    """Every parameter (and gradient) shard of ``model`` equals its slice of ``reference``.

    Rows past the true vocabulary (padding, whose size depends on t) are not model weights and
    are skipped. Returns the number of parameters compared.
    """
    reference_params = dict(reference.named_parameters())
    compared = 0
    for name, param in model.named_parameters():
        ref = reference_params[model.global_name(name)]
        spec = param.shard
        ref_param = spec.full_slice(ref.detach(), param.shape)
        ref_grad = spec.full_slice(ref.grad, param.shape)
        rows = tuple(slice(0, n) for n in ref_param.shape)
        assert param.grad is not None, f"{what} {name}: no gradient"
        assert torch.equal(param.detach()[rows].to(ref_param.dtype), ref_param), (
            f"{what} {name}: weights differ"
        )
        err = relative_error(param.grad[rows].to(ref_grad.dtype), ref_grad)
        assert err <= rtol, f"{what} {name}: gradient relative error {err:.3e} > {rtol}"
        compared += 1
    return compared


def max_gradient_error(model: nn.Module, reference: nn.Module) -> tuple[float, str]:
    """The largest relative gradient error of ``model``'s shards against ``reference`` (same
    slicing as :func:`assert_matches_reference`), and the parameter it occurs in."""
    reference_params = dict(reference.named_parameters())
    worst, worst_name = 0.0, ""
    for name, param in model.named_parameters():
        ref_grad = param.shard.full_slice(
            reference_params[model.global_name(name)].grad, param.shape
        )
        rows = tuple(slice(0, n) for n in ref_grad.shape)
        err = relative_error(param.grad[rows].to(ref_grad.dtype), ref_grad)
        if err >= worst:
            worst, worst_name = err, name
    return worst, worst_name
