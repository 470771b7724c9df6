"""Per-token loss masks and the global token mean of a step.

* One process: the vocab-parallel cross entropy with a mask gives a masked token loss 0 and
  its logits zero gradient; a micro-batch whose tokens are all masked gives loss 0 and zero
  gradients, never NaN.
* A Trainer step with the ``megatron_sp`` strategy at p = 2 (4 micro-batches, slow): its
  loss and both stages' gradients equal one process's global token mean.
* Float64 parity (gloo): a step of ``k = 2`` accumulated batches, each of ``n = 2``
  micro-batches per replica, with a different number of unmasked tokens in every micro-batch
  (one of them none at all), on d = 2, c = 2 and p = 2 (2 ranks, quick) and d = 2 x c = 2,
  d = 2 x p = 2, c = 2 x p = 2 (4 ranks, slow): the step's gradients and logged loss equal one
  process's on the whole global batch with the loss ``Σ unmasked loss / their number``. The
  p = 1 layouts divide each backward by ``k`` as Lightning's accumulation does; the p = 2
  layouts run the schedule's micro-batches. The data is built so that the mean of
  per-micro-batch means differs from the global token mean (the test can fail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_sp import GPTModule, OptimizerConfig, ParallelState
from lightning_sp.parallel.vocab import IGNORE_INDEX, vocab_parallel_cross_entropy
from lightning_sp.pipeline import Pipeline
from lightning_sp.pipeline.token_mean import TokenMean, apply_loss_mask
from lightning_sp.testing.spawn import run_distributed

from models import (
    assert_matches_reference,
    context_shards,
    reference_model,
    relative_error,
    tiny_config,
)

RTOL = 1e-10
K, N, B = 2, 2, 1  # accumulated batches per step, micro-batches per replica, rows per micro-batch
DENSITY = (0.9, 0.0, 0.25, 1.0, 0.5, 0.1, 0.75, 0.4)  # the fraction of counted tokens per row


def _global_batch(config, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences of ids and masked labels; row ``i`` keeps about ``DENSITY[i]`` of its
    tokens (row 1 none), so micro-batches count different numbers of tokens."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (rows, config.seq_length + 1), generator=generator)
    keep = torch.rand(rows, config.seq_length, generator=generator)
    density = torch.tensor([DENSITY[i % len(DENSITY)] for i in range(rows)]).unsqueeze(1)
    mask = keep < density
    mask[1] = False  # a micro-batch with no counted token
    return tokens[:, :-1], apply_loss_mask(tokens[:, 1:], mask)


def test_masked_cross_entropy_drops_the_token_and_its_gradient() -> None:
    logits = torch.randn(5, 2, 7, dtype=torch.float64, requires_grad=True)  # [s, b, v]
    target = torch.randint(0, 7, (5, 2))
    mask = torch.ones(5, 2, dtype=torch.bool)
    mask[1, 0] = mask[3, 1] = False
    losses = vocab_parallel_cross_entropy(logits, target, 0, 7, None, mask)
    full = vocab_parallel_cross_entropy(logits, target, 0, 7, None)
    assert losses[1, 0] == 0 and losses[3, 1] == 0
    assert torch.equal(losses[mask], full[mask])
    losses.sum().backward()
    assert logits.grad is not None
    assert (
        torch.count_nonzero(logits.grad[1, 0]) == 0 and torch.count_nonzero(logits.grad[3, 1]) == 0
    )
    assert torch.count_nonzero(logits.grad[0, 0]) > 0


def test_all_masked_micro_batch_is_zero_not_nan() -> None:
    config = tiny_config()
    model = reference_model(config)
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length))
    labels = torch.full_like(ids, IGNORE_INDEX)
    for reduction in ("mean", "sum"):
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels, reduction)
        loss.backward()
        assert loss.item() == 0.0, reduction
        for name, param in model.named_parameters():
            assert param.grad is not None and torch.count_nonzero(param.grad) == 0, (
                reduction,
                name,
            )
    # a step with no counted token anywhere: loss 0, gradients zero
    mean = TokenMean(ParallelState.single())
    mean.add(labels, loss)
    assert mean.finish(model).item() == 0.0


def _parity(state: ParallelState, architecture: str) -> dict[str, object]:
    """One step of ``K`` batches on ``state``'s layout against one process on all of them."""
    d, p = state.data_parallel_size, state.pipeline_parallel_size
    config = tiny_config(architecture, recompute="selective")
    rows = K * d * N * B
    ids, labels = _global_batch(config, rows)
    reference = reference_model(config)
    ref_loss = reference(ids, labels)  # the token mean over the whole global batch
    ref_loss.backward()
    # what averaging per micro-batch would give: must differ, or this test could not fail
    micro = [
        reference(i, lab).detach() for i, lab in zip(ids.split(B), labels.split(B), strict=True)
    ]
    naive = torch.stack(micro).mean()

    pipe = Pipeline(config, state, num_microbatches=N, dtype=torch.float64)
    mean = TokenMean(state)
    per_batch = d * N * B
    for k in range(K):
        start = k * per_batch + state.data_parallel_rank * N * B
        batch_ids, batch_labels = ids[start : start + N * B], labels[start : start + N * B]
        local_ids, local_labels = context_shards(state, batch_ids, batch_labels)
        if p == 1:  # as Lightning: the whole batch, backward of loss / k
            loss = pipe(local_ids, local_labels, "sum")
            (loss / K).backward()
        else:
            loss = pipe.train_step(local_ids, local_labels, "sum")
        mean.add(batch_labels, loss.detach())
    pipe.finalize_grads()
    step_loss = mean.finish(pipe, accumulation=K if p == 1 else 1)
    what = f"{architecture} d={d} c={state.context_parallel_size} p={p}"
    compared = assert_matches_reference(pipe, reference, RTOL, what)
    return {
        "loss_error": relative_error(step_loss, ref_loss.detach()),
        "naive_gap": abs(naive.item() - ref_loss.item()),
        "elements": compared.elements,
        "finite": all(torch.isfinite(q.grad).all().item() for q in pipe.parameters()),
    }


def _worker(rank: int, world_size: int) -> dict[str, dict[str, object]]:
    layouts = (
        [dict(), dict(context_parallel_size=2), dict(pipeline_parallel_size=2)]
        if world_size == 2
        else [
            dict(context_parallel_size=2),
            dict(pipeline_parallel_size=2),
            dict(context_parallel_size=2, pipeline_parallel_size=2),
        ]
    )
    results = {}
    architectures = ("gpt2",) if world_size == 2 else ("gpt2", "llama")  # quick tier: one
    for layout in layouts:
        state = ParallelState.from_process_group(**layout)
        for architecture in architectures:
            what = f"{architecture} {layout}"
            results[what] = _parity(state, architecture)
    return results


def _check(results: list[dict[str, dict[str, object]]], cases_per_rank: int) -> None:
    for rank, cases in enumerate(results):
        assert len(cases) == cases_per_rank
        for what, result in cases.items():
            assert result["loss_error"] <= RTOL, f"rank {rank} {what}: {result}"
            assert result["naive_gap"] > 1e-3, f"rank {rank} {what}: equal counts, {result}"
            assert result["elements"] > 0 and result["finite"], f"rank {rank} {what}: {result}"


def test_global_token_mean_two_ranks() -> None:
    """d = 2, c = 2, p = 2 (GPT-2): masked step equals one process's global token mean."""
    _check(run_distributed(_worker, 2), 3)


@pytest.mark.slow
def test_global_token_mean_four_ranks() -> None:
    """d = 2 x c = 2, d = 2 x p = 2, c = 2 x p = 2; GPT-2 and Llama."""
    _check(run_distributed(_worker, 4), 6)


class _Grads(Callback):
    """The gradients the optimizer received (after the module's token mean), per parameter."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        for name, param in pl_module.named_parameters():  # the last batch's (after the step)
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                self.grads[name] = grad.detach().clone()


def test_trainer_step_with_accumulation_is_the_global_token_mean(tmp_path: Path) -> None:
    """One process under Lightning, ``accumulate_grad_batches=2``, batches of 2 rows with
    different counted tokens (one row none): the step's gradients and the logged
    ``train/loss`` equal one process's token mean over the 4 rows."""
    config = tiny_config(recompute="selective")
    ids, labels = _global_batch(config, 4)
    mask = labels != IGNORE_INDEX
    rows = [
        {
            "input_ids": ids[i : i + 2],
            "labels": labels.clamp(min=0)[i : i + 2],
            "loss_mask": mask[i : i + 2],
        }
        for i in (0, 2)
    ]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        reference = reference_model(config)
        ref_loss = reference(ids, labels)
        ref_loss.backward()
        module = GPTModule(config, OptimizerConfig(lr=1e-3, warmup_steps=0))
        grads = _Grads()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=2,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[grads],
        )  # fmt: skip
        trainer.fit(module, train_dataloaders=DataLoader(rows, batch_size=None))
    finally:
        torch.set_default_dtype(default)
    logged = trainer.callback_metrics["train/loss"].double()
    assert relative_error(logged, ref_loss.detach()) <= 1e-6, (  # logged as float32
        f"logged train/loss {logged.item():.6f}, the token mean over the step's 4 rows is "
        f"{ref_loss.item():.6f}: the step's counts do not run over both accumulated batches "
        "(the step boundary is not batch_idx % accumulate_grad_batches == 0?)"
    )
    assert len(grads.grads) == len(list(reference.parameters())), sorted(grads.grads)
    for name, grad in grads.grads.items():
        ref = dict(reference.named_parameters())[
            module.stage_model().global_name(name.removeprefix("pipeline."))
        ]
        assert ref.grad is not None, f"{name}: the reference has no gradient"
        err = relative_error(
            grad, ref.grad, 1e-6 * max(q.grad.norm().item() for q in reference.parameters())
        )
        assert err <= RTOL, f"{name}: gradient relative error {err:.2e}"


def test_validation_with_loss_masks_is_the_token_mean_of_the_split() -> None:
    """One process under Lightning: ``val/loss`` over two batches of 2 rows with different
    counted tokens (one row none) equals one process's token mean over the 4 rows, not the
    mean of the two batches' means (which the data makes differ)."""
    config = tiny_config()
    ids, labels = _global_batch(config, 4)
    mask = labels != IGNORE_INDEX
    rows = [{"input_ids": ids[i : i + 2], "labels": labels.clamp(min=0)[i : i + 2],
             "loss_mask": mask[i : i + 2]} for i in (0, 2)]  # fmt: skip
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        reference = reference_model(config)
        with torch.no_grad():
            want = reference(ids, labels).item()
            means = [reference(ids[i : i + 2], labels[i : i + 2]).item() for i in (0, 2)]
        module = GPTModule(config, OptimizerConfig())
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False)  # fmt: skip
        (metrics,) = trainer.validate(module, DataLoader(rows, batch_size=None), verbose=False)
    finally:
        torch.set_default_dtype(default)
    mean_of_means = sum(means) / 2
    assert abs(mean_of_means - want) > 1e-4 * want, "the data cannot tell the two means apart"
    got = metrics["val/loss"]
    assert abs(got - want) <= 1e-6 * want, (
        f"val/loss {got:.6f}, the token mean over the split's 4 rows is {want:.6f} (the mean "
        f"of the batches' means: {mean_of_means:.6f})"
    )


class _SaveStep(Callback):
    """In each spawned rank: this rank's gradients after the step (by global name) and the
    step's loss in float64 (the returned sum over the batch's counted tokens divided by their
    number, d = 1), written to ``out/rank<r>.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        assert isinstance(pl_module, GPTModule)
        grads = {}
        for name, param in pl_module.stage_model().named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grads[pl_module.stage_model().global_name(name)] = grad.detach().clone()
        labels = apply_loss_mask(batch["labels"], batch["loss_mask"])
        loss = outputs["loss"].detach().double() / int((labels != IGNORE_INDEX).sum())
        torch.save({"grads": grads, "loss": loss}, self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.slow
def test_trainer_pipeline_step_with_loss_masks_is_the_global_token_mean(tmp_path: Path) -> None:
    """Lightning's Trainer with the ``megatron_sp`` strategy at p = 2 (gloo, 1F1B over 4
    micro-batches of one row with 0 to all of their tokens counted): the step's loss and every
    gradient of both stages equal one float64 process's global token mean over the batch
    (<= 1e-10), which the mean of the micro-batches' means misses."""
    from lightning_sp import MegatronSPStrategy

    config = tiny_config(recompute="selective")
    ids, labels = _global_batch(config, 4)
    mask = labels != IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels.clamp(min=0), "loss_mask": mask}
    reference = reference_model(config)
    ref_loss = reference(ids, labels)  # the token mean over the whole batch
    ref_loss.backward()
    rows = zip(ids.split(1), labels.split(1), strict=True)  # the mean of micro-batch means
    naive = torch.stack([reference(i, lab).detach() for i, lab in rows])
    assert abs(naive.mean().item() - ref_loss.item()) > 1e-3  # the test can fail
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=1, logger=False,
        strategy=MegatronSPStrategy(start_method="spawn", pipeline_parallel_size=2,
                                    num_microbatches=4),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[_SaveStep(tmp_path)],
    )  # fmt: skip
    module = GPTModule(config, OptimizerConfig(lr=1e-3, warmup_steps=0))
    trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    named = dict(reference.named_parameters())
    scale = max(q.grad.norm().item() for q in reference.parameters() if q.grad is not None)
    seen = set()
    for rank, saved in enumerate(ranks):
        err = relative_error(saved["loss"], ref_loss.detach())
        assert err <= RTOL, f"rank {rank}: loss {saved['loss'].item()} vs {ref_loss.item()}"
        for name, grad in saved["grads"].items():
            ref = named[name].grad
            assert ref is not None
            err = relative_error(grad, ref, 1e-6 * scale)  # t = 1: the same padded shapes
            assert err <= RTOL, f"rank {rank} {name}: gradient relative error {err:.2e}"
            seen.add(name)
    assert seen == set(named), sorted(set(named) - seen)
