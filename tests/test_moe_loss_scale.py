"""How the MoE auxiliary losses enter a step's gradient, against a float64 reference whose
losses do not go through ``_AttachLoss`` or the ``AuxiliaryLosses`` hook
(:mod:`moe_reference`: recomputed from each router's input by transformers' formula):

* ``n = 2`` micro-batches accumulated by the pipeline (one process): each micro-batch's
  auxiliary losses weigh ``1/n``, as its loss;
* Lightning's ``accumulate_grad_batches = 2`` (one process, a real Trainer): each batch's
  auxiliary losses weigh ``1/2``, as its loss;
* per-token loss masks (MoE supervised fine-tuning): the step's loss is the global token mean
  of the counted tokens, and the auxiliary losses are each micro-batch's over every token its
  router sees, weighing ``1/(d·n)`` as without masks: one process under Lightning, and on 2
  gloo ranks at d = 2 with e = 2, c = 2 and p = 2 (n = 2); with ``accumulate_grad_batches = 2``
  the step is refused in one line (its count is not known before its first backward).

Every case first checks that the auxiliary losses move the gradients (the reference without
them differs), so a scale that drops them would fail.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from moe_reference import reference_with_router_losses
from torch.utils.data import DataLoader

from lightning_sp import ConfigError, GPTModule, OptimizerConfig, ParallelState
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.parallel.vocab import IGNORE_INDEX
from lightning_sp.pipeline import Pipeline
from lightning_sp.pipeline.token_mean import TokenMean, apply_loss_mask
from lightning_sp.testing.spawn import run_distributed
from lightning_sp.training.batches import scale_auxiliary_losses_to_token_mean

from models import assert_matches_reference, batch, context_shards, relative_error, tiny_config

RTOL = 1e-10


def moe_config(**overrides: object):  # type: ignore[no-untyped-def]
    """A tiny Llama whose feed-forward is 4 experts, top-2, both auxiliary losses large enough
    to move the gradients, the router in float64 (the reference's precision)."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=24, aux_loss_coef=0.5,
                    z_loss_coef=0.05, router_dtype="fp64")  # fmt: skip
    return tiny_config("llama", feed_forward="moe", moe=moe, **overrides)


def _masked_batch(config, rows: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """``rows`` sequences and their labels, row ``i`` keeping a different share of its tokens
    (row 1 none), so the micro-batches count different numbers."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (rows, config.seq_length + 1), generator=generator)
    keep = torch.rand(rows, config.seq_length, generator=generator)
    density = torch.tensor([(0.9, 0.0, 0.25, 1.0, 0.5, 0.1, 0.75, 0.4)[i % 8] for i in range(rows)])
    mask = keep < density.unsqueeze(1)
    return tokens[:, :-1], apply_loss_mask(tokens[:, 1:], mask)


def _compare(named_grads: dict[str, torch.Tensor], reference: torch.nn.Module, bug: str) -> None:
    """Every gradient equals the reference's to :data:`RTOL`; ``bug`` says what a failure
    means."""
    named = dict(reference.named_parameters())
    assert named_grads.keys() == named.keys(), sorted(set(named) ^ set(named_grads))
    scale = max(q.grad.norm().item() for q in named.values() if q.grad is not None)
    for name, grad in named_grads.items():
        ref = named[name].grad
        assert ref is not None, name
        err = relative_error(grad, ref, 1e-6 * scale)
        assert err <= RTOL, f"{name}: gradient relative error {err:.2e}: {bug}"


def _aux_moves(reference: torch.nn.Module, without: torch.nn.Module) -> None:
    """The auxiliary losses change the router gradients (else no scale could be seen)."""
    others = dict(without.named_parameters())
    gaps = [
        relative_error(p.grad, others[n].grad)
        for n, p in reference.named_parameters()
        if n.endswith("router.weight")
    ]
    assert gaps and min(gaps) > 1e-3, f"the auxiliary losses barely move the gradients: {gaps}"


def test_auxiliary_losses_weigh_one_over_the_micro_batches() -> None:
    """One process, the pipeline's ``n = 2`` micro-batches one after another: the gradients
    of ``Σ_micro (mean loss + aux losses) / n``."""
    n, rows = 2, 4
    config = moe_config()
    ids, labels = batch(config, batch_size=rows, seed=5)
    reference, losses = reference_with_router_losses(config)
    without, _ = reference_with_router_losses(config)
    for i, lab in zip(ids.chunk(n), labels.chunk(n), strict=True):
        ((reference(i, lab) + losses.take()) / n).backward()
        (without(i, lab) / n).backward()
    _aux_moves(reference, without)
    pipe = Pipeline(config, ParallelState.single(), num_microbatches=n, dtype=torch.float64)
    pipe.train_step(ids, labels)
    grads = {pipe.global_name(k): p.grad for k, p in pipe.named_parameters() if p.grad is not None}
    _compare(grads, reference, f"the auxiliary losses' gradient is not divided by n={n} "
             "micro-batches as the loss is")  # fmt: skip


class _Grads(Callback):
    """The gradients the optimizer received, by global name (after the module's token mean;
    read after the step, before the next zeroes them)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        model = pl_module.stage_model()
        for name, param in model.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                self.grads[model.global_name(name)] = grad.detach().clone()


def _fit(config, batches: list[dict], accumulate: int) -> _Grads:  # type: ignore[no-untyped-def]
    """One optimizer step of a float64 one-process Trainer over ``batches``."""
    grads = _Grads()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        module = GPTModule(config, OptimizerConfig(lr=1e-3, warmup_steps=0))
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=accumulate,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[grads],
        )  # fmt: skip
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    finally:
        torch.set_default_dtype(default)
    return grads


def test_auxiliary_losses_weigh_one_over_accumulate_grad_batches() -> None:
    """Lightning's ``accumulate_grad_batches = 2`` (no masks): the gradients of
    ``Σ_batches (mean loss + aux losses) / 2``."""
    config = moe_config()
    ids, labels = batch(config, batch_size=4, seed=6)
    reference, losses = reference_with_router_losses(config)
    without, _ = reference_with_router_losses(config)
    for i, lab in zip(ids.chunk(2), labels.chunk(2), strict=True):
        ((reference(i, lab) + losses.take()) / 2).backward()
        (without(i, lab) / 2).backward()
    _aux_moves(reference, without)
    halves = zip(ids.chunk(2), labels.chunk(2), strict=True)
    rows = [{"input_ids": i, "labels": lab} for i, lab in halves]
    grads = _fit(config, rows, accumulate=2)
    _compare(grads.grads, reference, "the auxiliary losses' gradient is not divided by "
             "accumulate_grad_batches=2 as the loss is")  # fmt: skip


def _sft_reference(config, ids, labels, micro_batches: int):  # type: ignore[no-untyped-def]
    """The float64 reference of a masked step over ``micro_batches`` equal slices of the rows:
    ``Σ counted losses / N + Σ_micro aux losses / micro_batches``; and the one without the
    auxiliary losses."""
    count = int((labels != IGNORE_INDEX).sum())
    reference, losses = reference_with_router_losses(config)
    without, _ = reference_with_router_losses(config)
    for i, lab in zip(ids.chunk(micro_batches), labels.chunk(micro_batches), strict=True):
        (reference(i, lab, "sum") / count + losses.take() / micro_batches).backward()
        (without(i, lab, "sum") / count).backward()
    _aux_moves(reference, without)
    return reference


def test_moe_sft_step_is_the_token_mean_plus_the_auxiliary_losses() -> None:
    """One process under Lightning, masked rows (one with no counted token): the token mean
    of the counted tokens plus the auxiliary losses over all 4 rows' tokens (one micro-batch);
    with ``accumulate_grad_batches = 2`` the step is refused in one line."""
    config = moe_config()
    ids, labels = _masked_batch(config, 4)
    reference = _sft_reference(config, ids, labels, 1)
    mask = labels != IGNORE_INDEX
    step = {"input_ids": ids, "labels": labels.clamp(min=0), "loss_mask": mask}
    grads = _fit(config, [step], accumulate=1)
    _compare(grads.grads, reference, "with loss masks the auxiliary losses are not the "
             "micro-batches' mean beside the token mean")  # fmt: skip
    halves = [{k: v[rows] for k, v in step.items()} for rows in (slice(0, 2), slice(2, 4))]
    with pytest.raises(ConfigError) as error:
        _fit(config, halves, accumulate=2)
    assert str(error.value) == (
        "trainer.accumulate_grad_batches=2 with per-token loss masks and auxiliary losses "
        "(moe.aux_loss_coef or moe.z_loss_coef > 0): the step's token count must be known "
        "before its first backward; use accumulate_grad_batches=1 (a larger data.batch_size, "
        "or num_microbatches with pipeline parallelism)"
    )


def _sft_worker(rank: int, world_size: int) -> dict[str, float]:
    """d = 2 (e = 2), c = 2, p = 2 (n = 2): one masked step through the module's own scaling
    (:func:`scale_auxiliary_losses_to_token_mean`) and the token mean, against one process."""
    config = moe_config(recompute="selective")
    worst: dict[str, float] = {}
    layouts = (dict(expert_parallel_size=2), dict(context_parallel_size=2),
               dict(pipeline_parallel_size=2))  # fmt: skip
    for layout in layouts:
        state = ParallelState.from_process_group(**layout)  # type: ignore[arg-type]
        d, p = state.data_parallel_size, state.pipeline_parallel_size
        n = 2 if p > 1 else 1  # without a pipeline, a step is one micro-batch (Lightning's)
        rows = d * n
        ids, labels = _masked_batch(config, rows, seed=11)
        reference = _sft_reference(config, ids, labels, rows)
        pipe = Pipeline(config, state, num_microbatches=n, dtype=torch.float64)
        mine = slice(state.data_parallel_rank * n, (state.data_parallel_rank + 1) * n)
        scale_auxiliary_losses_to_token_mean(pipe, labels[mine], 1)
        mean = TokenMean(state)
        local_ids, local_labels = context_shards(state, ids[mine], labels[mine])
        if p == 1:
            loss = pipe(local_ids, local_labels, "sum")
            loss.backward()
        else:
            loss = pipe.train_step(local_ids, local_labels, "sum")
        mean.add(labels[mine], loss.detach())
        pipe.finalize_grads()
        mean.finish(pipe)
        what = f"MoE SFT {layout}: with loss masks the auxiliary losses are not the mean"
        compared = assert_matches_reference(pipe, reference, RTOL, what)
        worst[str(layout)] = float(compared.elements)
    return worst


def test_moe_sft_token_mean_two_ranks() -> None:
    """d = 2 with e = 2, c = 2 and p = 2 on 2 gloo ranks equal one float64 process."""
    results = run_distributed(_sft_worker, 2)
    assert all(all(v > 0 for v in r.values()) for r in results), results
