"""Pipeline parallelism with mixture-of-experts layers across real ranks: a whole MoE GPT at
p = 2 x d = 2 with e = 2 folded into d (4 gloo ranks), n = 2 micro-batches per replica, 1F1B
and interleaved (m = 2), equals one float64 process running the same ``d·n`` micro-batches one
after another with the loss and the auxiliary losses each divided by ``d·n``: the step's loss,
each micro-batch's load-balancing and z losses (and dropped count: capacity 1.0) in every layer,
and every gradient after ``finalize_grads``, to 1e-10.

The step's logged routing metrics (``train/moe/*``, :func:`step_metrics`) are global: summed
over micro-batches, data-parallel replicas and pipeline stages before their ratios, on every
rank the one process's, computed here from its recorded per-micro-batch values and its routers'
choice counts (4 ranks as above; 2 ranks at d = 2 with e = 2, and at p = 2).

The auxiliary losses ride on the layer output's backward (``attach_loss``), so the stages carry
them with the activations; the pipeline scales them by ``1/n`` as its loss, data parallelism
averages them over ``d`` with the rest of the gradients, and the experts' gradients are reduced
over their expert-data group (here one rank: e = d).
"""

from __future__ import annotations

import pytest
import torch

from lightning_sp import GPT
from lightning_sp.model.hooks import step_metrics
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.layer import MoE
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.testing.spawn import run_distributed

from models import (
    assert_matches_reference,
    batch,
    max_gradient_error,
    relative_error,
    tiny_config,
)

RTOL = 1e-10
N, B = 2, 2  # micro-batches per replica, rows per micro-batch
KEYS = ("aux_loss", "z_loss", "dropped", "load_imbalance")


def moe_config(**overrides: object):  # type: ignore[no-untyped-def]
    """A 4-layer tiny Llama whose feed-forward is 4 experts of width 24, top-2, with a shared
    expert, both auxiliary losses and a capacity of 1.0 (assignments are dropped); the choice
    bias is on, never updated here (it stays 0), so the routers count their choices."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=24, aux_loss_coef=0.1,
                    z_loss_coef=0.01, router_dtype="fp64", num_shared_experts=1,
                    capacity_factor=1.0, expert_bias=True)  # fmt: skip
    return tiny_config("llama", num_layers=4, feed_forward="moe", moe=moe, recompute="none",
                       **overrides)  # fmt: skip


def record_metrics(module: GPT | Pipeline) -> dict[str, list[dict]]:
    """Forward hooks appending each MoE layer's :attr:`MoE.metrics` after every forward, by
    the layer's global name (``layers.<i>``)."""
    records: dict[str, list[dict]] = {}
    for name, m in module.named_modules():
        if isinstance(m, MoE):
            key = module.global_name(name + ".weight").rsplit(".mlp", 1)[0]
            records[key] = []
            m.register_forward_hook(lambda mod, args, out, key=key: records[key].append(
                {k: v.clone() for k, v in mod.metrics.items()}))  # fmt: skip
    return records


def expected_step_metrics(model: GPT, records: dict[str, list[dict]]) -> dict[str, float]:
    """The step's metrics of one process that ran the step's micro-batches: from each layer's
    recorded values (:func:`record_metrics`) and its router's choices per expert."""
    config = model.config
    assert config.moe is not None
    routers = [m.router for m in model.modules() if isinstance(m, MoE)]
    loads = [r.tokens_per_expert.double() for r in routers]  # type: ignore[union-attr]
    assignments = sum(float(load.sum()) for load in loads)
    per_layer = {
        key: [sum(float(r[key]) for r in rs) / len(rs) for rs in records.values()]
        for key in ("aux_loss", "z_loss")
    }
    dropped = sum(float(r["dropped"]) for rs in records.values() for r in rs)
    return {
        "moe/aux_loss": sum(per_layer["aux_loss"]) / len(records),
        "moe/z_loss": sum(per_layer["z_loss"]) / len(records),
        "moe/load_imbalance": sum(float(x.max() / x.mean()) for x in loads) / len(loads),
        "moe/dropped_fraction": dropped / assignments,
    }


def check_step_metrics(got: dict, want: dict[str, float], case: str) -> float:
    """``got`` (:func:`step_metrics`) equals ``want`` to :data:`RTOL`; returns the largest
    relative error."""
    assert got.keys() == want.keys(), f"{case}: {sorted(got)}"
    errors = {k: abs(float(got[k]) - want[k]) / abs(want[k]) for k in want}
    assert max(errors.values()) <= RTOL, f"{case}: step metrics {errors}"
    return max(errors.values())


def _worker(rank: int, world_size: int) -> dict[str, float]:
    state = ParallelState.from_process_group(pipeline_parallel_size=2, expert_parallel_size=2)
    d = state.data_parallel_size
    config = moe_config()
    ids, labels = batch(config, batch_size=d * N * B, seed=5)
    reference = GPT(config, ParallelState.single(), dtype=torch.float64)
    for layer in reference.layers:  # d·n micro-batches, each loss divided by d·n
        layer.mlp.aux_loss_scale = 1 / (d * N)
    ref_metrics = record_metrics(reference)
    ref_losses = []
    for micro in range(d * N):
        rows = slice(micro * B, (micro + 1) * B)
        loss = reference(ids[rows], labels[rows])
        (loss / (d * N)).backward()
        ref_losses.append(loss.detach())
    expected = expected_step_metrics(reference, ref_metrics)
    worst = {"loss": 0.0, "gradient": 0.0, "step_metrics": 0.0, **dict.fromkeys(KEYS, 0.0)}
    mine = slice(state.data_parallel_rank * N * B, (state.data_parallel_rank + 1) * N * B)
    for m in (1, 2):
        case = f"p=2 m={m} d={d} e=2"
        pipe = Pipeline(config, state, num_microbatches=N, virtual_pipeline_size=m,
                        dtype=torch.float64)  # fmt: skip
        metrics = record_metrics(pipe)
        loss = pipe.train_step(ids[mine], labels[mine])
        pipe.finalize_grads()
        first = state.data_parallel_rank * N
        want = torch.stack(ref_losses[first : first + N]).mean()
        worst["loss"] = max(worst["loss"], relative_error(loss, want))
        assert worst["loss"] <= RTOL, f"{case}: loss {loss} vs {want}"
        err = check_step_metrics(step_metrics(pipe, state, config), expected, case)
        worst["step_metrics"] = max(worst["step_metrics"], err)
        assert len(metrics) == config.num_layers // 2, f"{case}: {sorted(metrics)}"
        for layer, records in metrics.items():
            assert len(records) == N, f"{case} {layer}: {len(records)} forwards"
            for micro, got in enumerate(records):
                want = ref_metrics[layer][first + micro]
                for key in KEYS:
                    err = relative_error(got[key].double(), want[key].double())
                    worst[key] = max(worst[key], err)
                    assert err <= RTOL, f"{case} {layer} micro-batch {micro} {key}: {err:.1e}"
        compared = assert_matches_reference(pipe, reference, RTOL, case)
        assert compared.parameters == len(list(pipe.parameters())) and compared.elements > 0
        worst["gradient"] = max(worst["gradient"], max_gradient_error(pipe, reference)[0])
    dropped = sum(float(r["dropped"]) for rs in ref_metrics.values() for r in rs)
    assert dropped > 0, "the capacity dropped nothing: the dropped counts were not tested"
    return worst


@pytest.mark.slow
def test_moe_pipeline_with_expert_and_data_parallel_matches_one_process() -> None:
    results = run_distributed(_worker, 4)
    for rank, worst in enumerate(results):
        assert all(err <= RTOL for err in worst.values()), f"rank {rank}: {worst}"
    print({key: max(r[key] for r in results) for key in results[0]})


def _metrics_worker(rank: int, world_size: int) -> list[float]:
    """d = 2 with e = 2 (each replica's n micro-batches accumulated), and p = 2 (1F1B over
    the replica's micro-batches): the step's metrics on every rank equal the one process's;
    and they differ from what one replica (or stage) alone holds, so a per-rank value fails."""
    config = moe_config()
    errors = []
    for layout in (dict(expert_parallel_size=2), dict(pipeline_parallel_size=2)):
        state = ParallelState.from_process_group(**layout)  # type: ignore[arg-type]
        d = state.data_parallel_size
        ids, labels = batch(config, batch_size=d * N * B, seed=9)
        reference = GPT(config, ParallelState.single(), dtype=torch.float64)
        records = record_metrics(reference)
        for micro in range(d * N):
            reference(ids[micro * B : (micro + 1) * B], labels[micro * B : (micro + 1) * B])
        expected = expected_step_metrics(reference, records)
        pipe = Pipeline(config, state, num_microbatches=N, dtype=torch.float64)
        mine = slice(state.data_parallel_rank * N * B, (state.data_parallel_rank + 1) * N * B)
        pipe.train_step(ids[mine], labels[mine])
        alone = step_metrics(pipe, ParallelState.single(), config)  # this rank's own share
        pipe.train_step(ids[mine], labels[mine])
        got = step_metrics(pipe, state, config)
        errors.append(check_step_metrics(got, expected, f"{layout}"))
        gap = max(abs(float(alone[k]) - expected[k]) for k in expected)
        assert gap > 1e-6, f"{layout}: one rank's own metrics equal the global ones ({gap})"
    return errors


def test_step_metrics_are_global_on_two_ranks() -> None:
    """Quick tier (issue 40): the routing metrics' reductions had no quick test."""
    errors = run_distributed(_metrics_worker, 2)
    print("largest relative error of the step metrics:", max(max(e) for e in errors))
