"""The non-finite guard: a NaN or Inf loss or gradient never reaches the weights unnoticed.

After forward, backward and the gradient reductions of a step, every rank tells every other
whether its loss and its gradient norm are finite (one all-gather of two flags per rank, and
of a stop signal it may have received: :mod:`lightning_sp.runtime.shutdown`). If any
is not, the policy decides, identically on every rank:

* ``stop``: raise :class:`NonFiniteError`, one line naming the step, the ranks and the
  quantity. The optimizer has not stepped and no checkpoint of that state is written.
* ``skip``: drop the step's update (Megatron's behaviour for overflowed steps), count it, and go
  on; more than ``max_skipped_steps`` skips in a row stop the run as ``stop`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

POLICIES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient norm (one line: step, ranks, quantity)."""


def _loss_of(result: Any) -> Tensor | None:
    if isinstance(result, Tensor):
        return result
    if isinstance(result, dict):
        return _loss_of(result.get("loss"))
    return None


def _grad_norm_finite(module: nn.Module) -> bool:
    grads = []
    for param in module.parameters():
        grad = getattr(param, "main_grad", None)
        grad = grad if grad is not None else param.grad
        if grad is not None:
            grads.append(grad)
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    return bool(torch.isfinite(torch.stack([n.float() for n in norms]).norm()).item())


class NonFiniteGuard:
    """Checks each step (see the module docstring); ``skipped`` counts the skips in a row."""

    def __init__(self, policy: str = "stop", max_skipped_steps: int = 10) -> None:
        self.policy = policy
        self.max_skipped_steps = max_skipped_steps
        self.skipped = 0
        self.total_skipped = 0
        self.stop_signal = 0

    def check(
        self, result: Any, module: nn.Module, optimizer: Any, step: int, stop_signal: int = 0
    ) -> bool:
        """True if the step may update the weights; False to skip it (its gradients are
        zeroed); raises :class:`NonFiniteError` to stop. ``stop_signal``: a signal this rank
        received (0: none), exchanged in the same all-gather; afterwards ``self.stop_signal``
        holds the largest any rank reported, the same on every rank."""
        loss = _loss_of(result)
        flags = torch.tensor(
            [
                loss is not None and not bool(torch.isfinite(loss.detach()).all()),
                not _grad_norm_finite(module),
                stop_signal,
            ],
            dtype=torch.int32,
        )
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1:
            gathered = [torch.zeros_like(flags) for _ in range(world)]
            dist.all_gather(gathered, flags)
            table = torch.stack(gathered)  # [rank, (loss, grad)]
        else:
            table = flags.unsqueeze(0)
        self.stop_signal = int(table[:, 2].max())
        table = table[:, :2]
        if not bool(table.any()):
            self.skipped = 0
            return True
        parts = []
        for i, name in enumerate(("loss", "gradient norm")):
            ranks = table[:, i].nonzero().flatten().tolist()
            if ranks:
                parts.append(f"{name} (rank {', '.join(str(r) for r in ranks)})")
        where = f"non-finite {' and '.join(parts)} at step {step}"
        if self.policy == "skip" and self.skipped < self.max_skipped_steps:
            self.skipped += 1
            self.total_skipped += 1
            optimizer.zero_grad()
            return False
        if self.policy == "skip":
            raise NonFiniteError(
                f"{where}, after {self.skipped} skipped steps in a row "
                f"(max_skipped_steps={self.max_skipped_steps}); the run stops"
            )
        raise NonFiniteError(
            f"{where}; the run stops without saving this state (strategy nonfinite='skip' "
            "drops such steps instead)"
        )
