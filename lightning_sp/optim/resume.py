"""A resumed run trains with the optimizer settings it was given, not the checkpoint's.

Lightning restores the optimizer's parameter groups (learning rate, weight decay, betas, ε)
and the scheduler's base learning rates from the checkpoint, so ``--ckpt_path X
--model.optimizer.lr 1e-5`` would train on with the checkpoint's settings while
``hparams.yaml`` records 1e-5. Here the settings of this run's ``configure_optimizers`` are
taken (:func:`configured_settings`) before the restore and put back after it
(:func:`apply_settings`): each group's weight decay, betas, ε and peak learning rate, the
scheduler's base learning rates, and the learning rate recomputed from this run's schedule at
the resumed step. The moments, step counts and (fp32) master weights stay the checkpoint's.
With unchanged settings this rewrites the restored values with equal ones (the continuation
is exact); with changed ones :func:`changed_settings` names them, in the one line
``GPTModule`` prints.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from lightning_sp.optim.adamw import OptimizerConfig

GROUP_SETTINGS = ("initial_lr", "weight_decay", "betas", "eps")
"""The parameter-group entries a run's configuration sets (``initial_lr``: the peak, which
the scheduler multiplies)."""


def configured_settings(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's :data:`GROUP_SETTINGS` as this run configured them."""
    return [{k: group[k] for k in GROUP_SETTINGS if k in group} for group in optimizer.param_groups]


def apply_settings(optimizer: Optimizer, scheduler: object, settings: list[dict[str, Any]]) -> None:
    """Put ``settings`` (:func:`configured_settings` before the restore) back into the
    restored ``optimizer``, and with a ``LambdaLR`` ``scheduler`` its base learning rates and
    each group's learning rate at the scheduler's (restored) step."""
    for group, configured in zip(optimizer.param_groups, settings, strict=True):
        group.update(configured)
    if isinstance(scheduler, LambdaLR):
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, base, factor in zip(
            optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base * factor(scheduler.last_epoch)  # as LambdaLR.step computes it
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # get_last_lr


def changed_settings(saved: dict[str, Any] | None, current: OptimizerConfig) -> list[str]:
    """``"field old -> new"`` for each ``model.optimizer`` field whose value differs from the
    checkpoint's (``saved``: its ``hyper_parameters["optimizer"]``; None: not recorded)."""
    if not saved:
        return []
    return [
        f"{name} {saved[name]!r} -> {value!r}"
        for name, value in asdict(current).items()
        if name in saved and saved[name] != value
    ]


def notice(changes: list[str], step: int) -> str:
    """The one line a resumed run prints when its optimizer settings differ."""
    return (
        f"resuming with model.optimizer settings that differ from the checkpoint's: "
        f"{', '.join(changes)}; applied (schedule recomputed at step {step})"
    )
