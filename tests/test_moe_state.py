"""Nothing of an MoE run is lost on resume, and full recompute counts each routed token once.

* The router's ``expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing, moved after each
  optimizer step) is a persistent buffer and travels in checkpoints: a run of 6 AdamW steps
  at d = 2 with e = 2 (the real ``MegatronSPStrategy`` under Lightning's Trainer, float64) equals
  the same run resumed from its step-3 checkpoint, in the same layout and resharded to one
  process (e = 1, d = 1), to p = 2 and to t = 2 + SP: every bias exactly (at the start of the
  resumed run and at step 6), the step-6 weights and the losses of steps 3-5 to 1e-10. A checkpoint
  written without the biases (before they were saved) loads them as zero, with one notice.
* ``tokens_per_expert`` (the loads counted since the last bias update; reset by every update,
  so not saved) and the layer's routing totals count a step's choices once under ``recompute:
  full`` as under ``none``: the replay in backward adds nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_context_trainer import STEPS, assert_same_tensors, fit, metrics, module
from test_moe_trainer import EP_STEPS, moe_module
from test_resume import Notices

from lightning_sp import GPT, GPTModule, ParallelState
from lightning_sp.checkpoint import Checkpointer, Meta, read_full
from lightning_sp.checkpoint.verify import check_checkpoint
from lightning_sp.model.hooks import step_metrics
from lightning_sp.model.moe.layer import MoE
from lightning_sp.parallel.config import ParallelConfig

from models import batch, loss_and_grads, moe_context, relative_error, tiny_config

RTOL = 1e-10
BIAS = "mlp.router.expert_bias"
MOE = moe_module().config.moe
"""``test_moe_trainer.moe_module``'s experts: 4, top-2, sigmoid, the bias moved by 0.05."""
assert MOE is not None


def _biases(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{model.<global name>: bias}`` of every router bias of ``module``'s GPT chunks."""
    chunks = [m for m in module.modules() if isinstance(m, GPT)]
    return {
        f"model.{chunk.global_name(name)}": buffer.detach().clone()
        for chunk in chunks
        for name, buffer in chunk.named_buffers()
        if name.endswith(BIAS)
    }


def _without_biases(module: torch.nn.Module) -> None:
    """Make every router bias of ``module`` non-persistent: what checkpoints wrote before they
    held the biases."""
    for m in module.modules():
        if isinstance(m, MoE) and m.router.expert_bias is not None:
            m.router.register_buffer("expert_bias", m.router.expert_bias, persistent=False)


# -- one process: the checkpoint holds the bias, not the per-step counts ----------------------


def _model(**overrides: Any) -> GPT:
    config = tiny_config("llama", feed_forward="moe", moe=MOE, **overrides)
    return GPT(config, ParallelState.single(), dtype=torch.float64)


def _save(path: Path, model: GPT) -> None:
    meta = Meta(1, ParallelConfig(), dataclasses.asdict(model.config))
    Checkpointer().save(path, model, [], meta=meta, lightning_state={},
                        rng=("rng.pp0.dp0.tp0", None))  # fmt: skip


def _load(path: Path, model: GPT) -> dict[str, Any]:
    return Checkpointer().load(path, model, [], layout=ParallelConfig(),
                               model_config=dataclasses.asdict(model.config),
                               rng_name="rng.pp0.dp0.tp0")  # fmt: skip


def test_checkpoints_hold_router_biases_and_old_ones_load_them_as_zero(tmp_path: Path) -> None:
    trained = _model()
    ids, labels = batch(trained.config)
    loss_and_grads(trained, ids, labels)
    for m in trained.modules():
        if isinstance(m, MoE):
            m.update_expert_bias()
            m.update_expert_bias()  # no counts: every load equals the mean, nothing moves
    loss_and_grads(trained, ids, labels)  # counts pending: not saved
    want = _biases(trained)
    assert len(want) == 2 and all(b.abs().max() == MOE.bias_update_rate for b in want.values())
    _save(tmp_path / "new.ckpt", trained)
    full = read_full(tmp_path / "new.ckpt")
    assert {k for k in full if k.endswith(BIAS)} == set(want), (
        f"the checkpoint holds router biases {sorted(k for k in full if k.endswith(BIAS))}, the "
        f"model {sorted(want)}: persistent buffers are not saved"
    )
    assert not [k for k in full if "tokens_per_expert" in k], "pending counts were saved"
    check_checkpoint(str(tmp_path / "new.ckpt"), trained.config)  # before launch: accepted
    fresh = _model()
    assert _load(tmp_path / "new.ckpt", fresh)["missing_buffers"] == []
    got = _biases(fresh)
    assert all(torch.equal(got[k], want[k]) for k in want), (got, want)

    _without_biases(trained)
    _save(tmp_path / "old.ckpt", trained)
    assert not [k for k in read_full(tmp_path / "old.ckpt") if k.endswith(BIAS)]
    check_checkpoint(str(tmp_path / "old.ckpt"), trained.config)
    loaded = _model()
    for bias in _biases(loaded):  # a bias this model already moved: back to zero
        loaded.get_buffer(bias.removeprefix("model.")).fill_(0.5)
    assert _load(tmp_path / "old.ckpt", loaded)["missing_buffers"] == sorted(want)
    assert all(float(b.abs().max()) == 0 for b in _biases(loaded).values())


# -- full recompute counts each routed token once ----------------------------------------------


def test_full_recompute_counts_each_routed_token_once() -> None:
    """Two micro-batches' forward and backward: each layer's ``tokens_per_expert`` and routing
    totals under ``recompute: full`` equal ``none``'s, and the counts sum to the assignments
    made (micro-batches x b x s x k)."""
    seen = {}
    for policy in ("none", "full"):
        model = _model(recompute=policy)
        for seed in (0, 1):
            loss_and_grads(model, *batch(model.config, seed=seed))
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        counts = [m.router.tokens_per_expert.clone() for m in layers]  # type: ignore[union-attr]
        totals = [m.totals.clone() for m in layers]  # type: ignore[union-attr]
        metrics = step_metrics(model, model.state, model.config)
        seen[policy] = counts, totals, metrics
        assignments = 2 * 2 * model.config.seq_length * MOE.top_k
        assert [float(c.sum()) for c in counts] == [assignments] * 2, (policy, counts)
    (counts, totals, metrics), (full_counts, full_totals, full_metrics) = seen.values()
    assert all(torch.equal(a, b) for a, b in zip(counts, full_counts, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(totals, full_totals, strict=True))
    assert metrics.keys() == full_metrics.keys()
    assert all(torch.equal(metrics[k], full_metrics[k]) for k in metrics)


# -- through the Trainer: resume, reshard ------------------------------------------------------


class HoldsBiases(Callback):
    """At the start of training every router bias equals ``want`` (the checkpoint's, loaded),
    exactly; each rank writes how many it compared to ``<report>/rank<r>`` (the run may be a
    spawned process)."""

    def __init__(self, want: dict[str, torch.Tensor], report: Path) -> None:
        self.want, self.report = want, report

    def on_train_start(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        got = _biases(pl_module)
        assert got and set(got) <= set(self.want), (sorted(got), sorted(self.want))
        for key, bias in got.items():
            assert torch.equal(bias, self.want[key].to(bias)), f"{key}: {bias} vs {self.want[key]}"
        self.report.mkdir(exist_ok=True)
        (self.report / f"rank{trainer.global_rank}").write_text(str(len(got)))

    @staticmethod
    def compared(report: Path) -> dict[str, int]:
        """``{rank<r>: biases compared}`` of a run."""
        return {p.name: int(p.read_text()) for p in sorted(report.iterdir())}


class DropsBiasesFromCheckpoints(Callback):
    """Before training, the router biases become non-persistent: the run's checkpoints are
    those written before checkpoints held them."""

    def on_train_start(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        _without_biases(pl_module)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
def test_moe_resume_equals_the_straight_run_and_reshards(tmp_path: Path, moe_ep_run: Path) -> None:
    ep = {"tensor_parallel_size": 1, "expert_parallel_size": 2}
    assert EP_STEPS == 2 * STEPS
    straight = metrics(moe_ep_run, "ep")  # the straight run at d=2 e=2 (conftest.moe_ep_run)
    corpus = moe_ep_run / "corpus"
    half = moe_ep_run / "ep" / f"step={STEPS}.ckpt"
    saved = read_full(half)
    biases = {k: v for k, v in saved.items() if k.endswith(BIAS)}
    assert len(biases) == 2 and all(b.abs().min() > 0 for b in biases.values()), biases
    reference = read_full(moe_ep_run / "ep" / f"step={2 * STEPS}.ckpt")
    moved = [k for k in biases if not torch.equal(biases[k], reference[k])]
    assert moved, "the biases did not move after the checkpoint"
    layouts: dict[str, dict[str, Any]] = {
        "d=2 e=2": {"devices": 2, **ep},
        "one process": {},
        "p=2": {"devices": 2, "tensor_parallel_size": 1, "pipeline_parallel_size": 2,
                "num_microbatches": 2},
        "t=2 + SP": {"devices": 2, "tensor_parallel_size": 2},
    }  # fmt: skip
    worst = {"loss": 0.0, "weights": 0.0}
    for number, (layout, strategy) in enumerate(layouts.items()):
        name, report = f"resumed{number}", tmp_path / f"holds{number}"
        net = moe_module()
        if strategy.get("tensor_parallel_size", 1) > 1:  # MoE under TP needs SP (resumable)
            net = module("llama", feed_forward="moe", moe=MOE, sequence_parallel=True)
        logged = fit(tmp_path, name, corpus, net, 2 * STEPS, ckpt_path=str(half),
                     callbacks=[HoldsBiases(biases, report)], **strategy)  # fmt: skip
        ranks, p = strategy.get("devices", 1), strategy.get("pipeline_parallel_size", 1)
        held = HoldsBiases.compared(report)  # every rank: its layers' biases
        assert held == {f"rank{r}": 2 // p for r in range(ranks)}, (layout, held)
        losses = logged["train/loss"]
        assert sorted(losses) == list(range(STEPS, 2 * STEPS)), (layout, sorted(losses))
        for step, loss in losses.items():
            err = _relative(loss, straight["train/loss"][step])
            assert err <= RTOL, f"{layout}: loss at step {step} {loss!r} ({err:.1e})"
            worst["loss"] = max(worst["loss"], err)
        final = read_full(tmp_path / name / f"step={2 * STEPS}.ckpt")
        for key in biases:
            assert torch.equal(final[key], reference[key]), f"{layout} {key}: {final[key]}"
        assert assert_same_tensors(final, reference, "model.", RTOL) > 10
        errors = [relative_error(final[k].double(), v.double())
                  for k, v in reference.items() if k.startswith("model.")]  # fmt: skip
        worst["weights"] = max(worst["weights"], *errors)
    print(f"biases at step {STEPS}: {biases}; largest relative error {worst}")


@pytest.mark.slow
def test_a_checkpoint_without_router_biases_loads_them_as_zero_with_one_notice(
    tmp_path: Path, corpus: Path
) -> None:
    fit(tmp_path, "old", corpus, moe_module(), STEPS, callbacks=[DropsBiasesFromCheckpoints()])
    old = tmp_path / "old" / f"step={STEPS}.ckpt"
    assert not [k for k in read_full(old) if k.endswith(BIAS)]
    zero = {f"model.layers.{i}.{BIAS}": torch.zeros(MOE.num_experts) for i in (0, 1)}
    with Notices() as printed:  # the run is in this process: its rank_zero_info lines
        fit(tmp_path, "resumed", corpus, moe_module(), STEPS + 1, ckpt_path=str(old),
            callbacks=[HoldsBiases(zero, tmp_path / "holds")])  # fmt: skip
    lines = printed.containing("holds no")
    assert lines == [
        f"{old} holds no model.layers.0.{BIAS} (nor 1 more buffers): saved before checkpoints "
        "held MoE router biases; they start at zero"
    ], printed.lines
    assert HoldsBiases.compared(tmp_path / "holds") == {"rank0": 2}


def test_expert_bias_stays_fp32_under_a_bf16_module() -> None:
    """Lightning's ``bf16-true`` casts the module (``module.to(bfloat16)``): the router's
    weight turns bf16, its ``expert_bias`` and ``tokens_per_expert`` stay fp32 (a loaded
    value is not rounded through bf16), and 300 updates of +1e-3 from 0.25 land exactly
    where fp32 arithmetic puts them. A bf16 bias does not (its spacing at 0.25 is 2^-9 ~ 2e-3:
    each +1e-3 rounds up to 2^-9 until 0.5, where it is below half the spacing 2^-8 and
    rounds away: it stalls at 0.5 instead of 0.55)."""
    from lightning_sp.model.moe.router import Router

    config = dataclasses.replace(MOE, bias_update_rate=1e-3)
    router = Router(moe_context(config, 8), config)
    assert router.expert_bias is not None and router.tokens_per_expert is not None
    router.expert_bias.fill_(0.25)
    router.expert_bias[1] = 0.25 + 1e-4  # not representable in bf16
    start = router.expert_bias.clone()
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == router.tokens_per_expert.dtype == torch.float32
    assert torch.equal(router.expert_bias, start)
    expected, rounded = start[0].clone(), start[0].to(torch.bfloat16)
    for _ in range(300):  # expert 0 below the mean load: its bias rises by γ each step
        router.tokens_per_expert.copy_(torch.tensor([0.0, 1.0, 1.0, 1.0]))
        router.update_expert_bias(())
        expected += 1e-3
        rounded += 1e-3
    assert router.expert_bias.dtype == torch.float32
    assert router.expert_bias[0].item() == expected.item() != start[0].item()
    assert expected.item() == pytest.approx(0.55, abs=1e-5)
    assert rounded.item() == 0.5  # what the bf16 buffer did before


def test_an_eval_forward_counts_no_load() -> None:
    """A validation forward (the module in ``eval()``) routes without counting: the loads the
    next bias update sums (``tokens_per_expert``) and the step's routing totals hold the
    training forwards' choices only (T·k of them per forward)."""
    moe = MoE(moe_context(MOE, 8, dtype=torch.float64), MOE)
    moe.reset_parameters(0)
    x = torch.randn(4, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    moe(x)
    load, totals = moe.router.tokens_per_expert, moe.totals
    assert load is not None and totals is not None
    trained = load.clone(), totals.clone()
    assert float(trained[0].sum()) == 4 * 2 * MOE.top_k
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert torch.equal(load, trained[0]), (
        f"an eval (validation) forward added its choices to tokens_per_expert: {load.tolist()} "
        f"after, {trained[0].tolist()} before; validation tokens would move the expert biases"
    )
    assert moe.totals is not None and torch.equal(moe.totals, trained[1]), (
        "an eval (validation) forward added to the step's routing totals"
    )
