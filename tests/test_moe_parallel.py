"""The MoE layer under expert, data, tensor (+SP), expert tensor and context parallelism equals
one float64 process: outputs, auxiliary and z losses, dropped counts, every gradient (after
``finalize_grads``: experts reduced over their expert-data group), the global gradient norm
and the auxiliary-loss-free bias update.

Real gloo ranks; each builds the one-process reference itself and compares its own shard. The
reference runs the ``d`` micro-batches one after another and averages the gradients (what data
parallelism equals); a rank's micro-batch is ``dp_rank``'s, and its tokens the slice
``cp_rank·t + tp_rank`` of it (sequence parallel: the TP shard; CP: the MoE layer is
token-wise, so a contiguous slice stands for the load-balanced chunks). Under expert tensor
parallelism (``t_e = t``) the layer's input and output keep that layout; an expert weight's
shard is its experts' ``f_e`` slice (:func:`~lightning_sp.parallel.init.local_slice`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lightning_sp import GPT, GPTConfig
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.layer import MoE
from lightning_sp.parallel.buffer import GradBuffer
from lightning_sp.parallel.grads import finalize_grads, global_grad_norm
from lightning_sp.parallel.init import local_slice
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing.spawn import run_distributed

from models import (
    assert_matches_reference,
    batch,
    context_shards,
    moe_context,
    relative_error,
    tiny_config,
)

S, B, H, F = 8, 2, 16, 24
SEED = 11
RTOL = 1e-10

BASE = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=F, aux_loss_coef=0.1,
                 z_loss_coef=0.01, router_dtype="fp64")  # fmt: skip
CASES = {
    "top2": BASE,
    "top1": dataclasses.replace(BASE, top_k=1),
    "shared": dataclasses.replace(BASE, num_shared_experts=2, num_experts=8),
    "capacity": dataclasses.replace(BASE, capacity_factor=0.75),
    "sigmoid_bias": dataclasses.replace(BASE, score="sigmoid", expert_bias=True, aux_loss_coef=0),
}
"""The MoE settings every layout runs."""


def _micro_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``m``'s input ``[S, B, H]`` and the weights of the linear loss on the
    output."""
    g = torch.Generator().manual_seed(100 + m)
    x = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    return x, torch.randn(S, B, H, generator=g, dtype=torch.float64)


def _run(moe: MoE, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * w).sum().backward()
    return out.detach(), x.grad  # type: ignore[return-value]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _reference(config: MoEConfig, d: int) -> tuple[MoE, list[tuple], list[dict], torch.Tensor]:
    """One process over the ``d`` micro-batches: the model (gradients averaged), per micro-batch
    (output, input gradient) and metrics, and the gradient norm."""
    moe = MoE(moe_context(config, H, dtype=torch.float64), config)
    moe.reset_parameters(SEED)
    results, metrics = [], []
    for m in range(d):
        results.append(_run(moe, *_micro_batch(m)))
        metrics.append(dict(moe.metrics))
    for p in moe.parameters():
        p.grad.div_(d)  # type: ignore[union-attr]
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in moe.parameters()))  # type: ignore[union-attr]
    return moe, results, metrics, norm


def _check_layout(t: int, c: int, e: int, t_e: int, names: list[str]) -> None:
    state = ParallelState.from_process_group(
        tensor_parallel_size=t, context_parallel_size=c, expert_parallel_size=e,
        expert_tensor_parallel_size=t_e,
    )  # fmt: skip
    sp = t > 1
    d = state.data_parallel_size
    shards = t * c
    index = state.context_parallel_rank * t + state.tensor_parallel_rank
    rows = slice(index * S // shards, (index + 1) * S // shards)
    # under expert TP every case runs twice: with and without the mlp_act recompute module
    runs = [(n, r) for n in names for r in ((False, True) if t_e > 1 else (False,))]
    for name, recompute_act in runs:
        config = CASES[name]
        case = f"t={t} c={c} e={e} etp={t_e} d={d} {name}" + " mlp_act" * recompute_act
        ref, ref_results, ref_metrics, ref_norm = _reference(config, d)
        ctx = moe_context(config, H, state, sequence_parallel=sp, recompute_act=recompute_act,
                          dtype=torch.float64)  # fmt: skip
        moe = MoE(ctx, config)
        moe.reset_parameters(SEED)
        m = state.data_parallel_rank
        x, w = _micro_batch(m)
        out, grad_x = _run(moe, x[rows], w[rows])
        assert _rel(out, ref_results[m][0][rows]) <= RTOL, f"{case}: output"
        assert _rel(grad_x, ref_results[m][1][rows]) <= RTOL, f"{case}: input gradient"
        for key, value in moe.metrics.items():
            assert _rel(value, ref_metrics[m][key]) <= RTOL, f"{case}: {key}"
        finalize_grads(moe, state)
        reference = dict(ref.named_parameters())
        for pname, param in moe.named_parameters():
            full = reference[pname].grad
            assert full is not None and param.grad is not None, f"{case}: {pname}"
            if getattr(param, "expert", False):  # its experts (and their f_e slice)
                expected = local_slice(param, full)
            else:
                expected = param.shard.full_slice(full, param.shape)  # type: ignore[attr-defined]
            assert _rel(param.grad, expected) <= RTOL, f"{case}: grad {pname}"
        norm = global_grad_norm(list(moe.parameters()), state)
        assert _rel(norm, ref_norm) <= RTOL, f"{case}: gradient norm {norm} vs {ref_norm}"
        if config.expert_bias:
            moe.update_expert_bias()
            ref.update_expert_bias()
            assert torch.equal(moe.router.expert_bias, ref.router.expert_bias), f"{case}: bias"


LAYOUTS = {
    2: [(1, 1, 2, 1), (2, 1, 1, 1), (1, 2, 2, 1), (2, 1, 1, 2)],
    4: [(1, 1, 4, 1), (1, 1, 2, 1), (2, 1, 2, 1), (1, 2, 2, 1), (1, 2, 4, 1), (2, 2, 1, 1),
        (2, 1, 2, 2)],
}  # fmt: skip
"""(t, c, e, expert tensor parallel size) per world size; d = world / (t·c)."""


def _worker(rank: int, world_size: int, names: list[str]) -> None:
    for t, c, e, t_e in LAYOUTS[world_size]:
        _check_layout(t, c, e, t_e, names)


def test_moe_layouts_match_single_process_quick() -> None:
    """Two ranks, e = 2 over d = 2, t = 2 + SP (experts whole, and split over TP), and e = 2
    over c = 2: top-2 with both auxiliary losses, capacity, and sigmoid scores with the
    auxiliary-loss-free bias (its update's load summed over data x context)."""
    run_distributed(_worker, 2, ["top2", "capacity", "sigmoid_bias"])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_layouts_match_single_process(world_size: int) -> None:
    run_distributed(_worker, world_size, list(CASES))


def _gpt_config(**overrides: object) -> GPTConfig:
    """tiny Llama with an MoE feed-forward: 4 experts of width 24, top-2, both losses."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=24, aux_loss_coef=0.1,
                    z_loss_coef=0.01, router_dtype="fp64", num_shared_experts=1)  # fmt: skip
    return tiny_config("llama", feed_forward="moe", moe=moe, **{"recompute": "none", **overrides})


GPTLayout = tuple[int, int, int, int, str]
"""(t, c, e, expert tensor parallel size, recompute)."""


def _gpt_worker(rank: int, world_size: int, layouts: list[GPTLayout]) -> None:
    """The whole model: loss and every gradient (after ``finalize_grads``) equal one process
    running the d data-parallel batches and averaging."""
    for t, c, e, t_e, recompute in layouts:
        state = ParallelState.from_process_group(
            tensor_parallel_size=t, context_parallel_size=c, expert_parallel_size=e,
            expert_tensor_parallel_size=t_e,
        )  # fmt: skip
        case = f"GPT t={t} c={c} e={e} etp={t_e} d={state.data_parallel_size} {recompute}"
        config = _gpt_config(sequence_parallel=t > 1, recompute=recompute)
        reference = GPT(_gpt_config(), ParallelState.single(), dtype=torch.float64)
        d = state.data_parallel_size
        for layer in reference.layers:  # d micro-batches accumulated: as the main loss's / d
            layer.mlp.aux_loss_scale = 1 / d
        losses = []
        for m in range(d):
            losses.append(reference(*batch(config, seed=m)))
            (losses[-1] / d).backward()
        model = GPT(config, state, dtype=torch.float64)
        ids, labels = context_shards(state, *batch(config, seed=state.data_parallel_rank))
        loss = model(ids, labels)
        loss.backward()
        finalize_grads(model, state)
        ref_loss = losses[state.data_parallel_rank].detach()
        assert relative_error(loss.detach(), ref_loss) <= RTOL, f"{case}: loss"
        compared = assert_matches_reference(model, reference, RTOL, case)
        assert compared.parameters == len(list(model.parameters()))
        # the same through a bucketed gradient buffer (experts in buckets of their own)
        buffered = GPT(config, state, dtype=torch.float64)
        buffer = GradBuffer(list(buffered.parameters()), state, bucket_numel=2000)
        buffered(ids, labels).backward()
        finalize_grads(buffered, state, buffer)
        for (name, p), q in zip(buffered.named_parameters(), model.parameters(), strict=True):
            assert _rel(p.main_grad, q.grad) <= RTOL, f"{case}: buffer {name}"  # type: ignore[attr-defined, arg-type]
        # sharded (the distributed optimizer's): each rank's owned range, experts split over
        # their expert-data group; the sharded norm equals the replicated one
        sharded = GPT(config, state, dtype=torch.float64)
        params = list(sharded.parameters())
        buffer = GradBuffer(params, state, bucket_numel=2000, distributed=True)
        sharded(ids, labels).backward()
        finalize_grads(sharded, state, buffer)
        owned = buffer.owned()
        for (name, p), q in zip(sharded.named_parameters(), model.parameters(), strict=True):
            if id(p) in owned:
                start, end, grad = owned[id(p)]
                expected = q.grad.reshape(-1)[start:end]  # type: ignore[union-attr]
                assert _rel(grad, expected) <= RTOL, f"{case}: sharded {name}"
        norm = global_grad_norm(params, state, sharded_over_dp=True)
        reference_norm = global_grad_norm(list(model.parameters()), state)
        assert _rel(norm, reference_norm) <= RTOL, f"{case}: sharded norm"


def test_moe_gpt_layouts_match_single_process_quick() -> None:
    layouts = [(2, 1, 1, 1, "none"), (1, 1, 2, 1, "none"), (1, 2, 2, 1, "none")]
    run_distributed(_gpt_worker, 2, [*layouts, (2, 1, 1, 2, "lean")])


@pytest.mark.slow
def test_moe_gpt_layouts_match_single_process() -> None:
    layouts = [(2, 1, 2, 1, "none"), (1, 1, 4, 1, "none"), (1, 2, 2, 1, "none")]
    etp = [(2, 1, 2, 2, "none"), (2, 1, 2, 2, "full")]
    run_distributed(_gpt_worker, 4, [*layouts, (2, 2, 1, 1, "none"), *etp])


def _checkpoint_worker(rank: int, world_size: int, root: str) -> None:
    """A checkpoint saved at e = 2 loads at e = 1 and back (each expert at its offset of the
    full [E, ...] tensor): the weights equal the saving model's (optimizer state rides the
    same offsets; not compared here)."""
    from lightning_sp.checkpoint import Checkpointer, Meta
    from lightning_sp.optim.adamw import build_adamw
    from lightning_sp.parallel.config import ParallelConfig

    config = _gpt_config()
    models = {}
    for e in (2, 1):
        state = ParallelState.from_process_group(expert_parallel_size=e)
        model = GPT(config, state, dtype=torch.float64)
        optimizer = build_adamw(model, 1e-2, 0.1, (0.9, 0.95), 1e-8)
        layout = ParallelConfig(data_parallel_size=world_size, expert_parallel_size=e)
        models[e] = (model, optimizer, layout)
    model, optimizer, layout = models[2]
    model(*batch(config, seed=rank)).backward()
    finalize_grads(model, model.state)
    optimizer.step()
    meta = Meta(1, layout, dataclasses.asdict(config))
    Checkpointer().save(Path(root) / "e2", model, [optimizer], meta=meta,
                        lightning_state={"global_step": 1}, rng=("rng.none", None))  # fmt: skip
    for e in (1, 2):  # load at e = 1, then at e = 2 from a checkpoint e = 1 saved
        target, target_optimizer, target_layout = models[e]
        source = "e2" if e == 1 else "e1"
        Checkpointer().load(
            Path(root) / source, target, [target_optimizer], layout=target_layout,
            model_config=dataclasses.asdict(config), rng_name="rng.none",
        )  # fmt: skip
        for (name, p), q in zip(target.named_parameters(), model.parameters(), strict=True):
            full = q.detach()
            if getattr(q, "padded_vocab", False):  # padding rows are not saved
                full, p = full[: config.vocab_size], p[: config.vocab_size]
            if getattr(q, "expert", False) and e == 1:  # the e = 2 model holds half of them
                start = q.expert_start  # type: ignore[attr-defined]
                assert torch.equal(p.detach()[start : start + q.shape[0]], full), name
            else:
                assert torch.equal(p.detach(), full), f"e={e} {name}"
        if e == 1:
            meta = Meta(1, target_layout, dataclasses.asdict(config))
            Checkpointer().save(
                Path(root) / "e1", target, [target_optimizer], meta=meta,
                lightning_state={"global_step": 1}, rng=("rng.none", None),
            )  # fmt: skip
    for distributed in (True, False):
        _expert_tensor_parallel_checkpoint(Path(root), distributed)


def _expert_tensor_parallel_checkpoint(root: Path, distributed: bool) -> None:
    """Saved at t = 2 + SP with the experts split over TP (etp = 2) and the ``distributed``
    or the replicated optimizer (each expert slice of ``[gate; up]`` two chunks), loaded at
    t = 1 (whole experts, e = 2, the replicated optimizer): every weight and Adam moment equals
    the saving rank's slice of it."""
    from lightning_sp.checkpoint import Checkpointer, Meta
    from lightning_sp.optim.adamw import build_adamw
    from lightning_sp.parallel.buffer import GradBufferConfig
    from lightning_sp.parallel.config import ParallelConfig

    config = _gpt_config(sequence_parallel=True)
    state = ParallelState.from_process_group(tensor_parallel_size=2, expert_tensor_parallel_size=2)
    model = GPT(config, state, dtype=torch.float64)
    buffer = GradBufferConfig(2000, overlap=False, distributed=distributed)
    optimizer = build_adamw(model, 1e-2, 0.1, (0.9, 0.95), 1e-8, buffer)
    model(*batch(config)).backward()
    finalize_grads(model, state, optimizer.grad_buffer)  # type: ignore[attr-defined]
    optimizer.step()
    layout = ParallelConfig(tensor_parallel_size=2, expert_tensor_parallel_size=2,
                            distributed_optimizer=distributed)  # fmt: skip
    meta = Meta(1, layout, dataclasses.asdict(config))
    root = root / ("distributed" if distributed else "replicated")
    Checkpointer().save(root / "etp2", model, [optimizer], meta=meta,
                        lightning_state={"global_step": 1}, rng=("rng.none", None))  # fmt: skip
    whole = dataclasses.replace(config, sequence_parallel=False)
    target = GPT(whole, ParallelState.from_process_group(expert_parallel_size=2),
                 dtype=torch.float64)  # fmt: skip
    target_optimizer = build_adamw(target, 1e-2, 0.1, (0.9, 0.95), 1e-8)
    Checkpointer().load(
        root / "etp2", target, [target_optimizer], rng_name="rng.none",
        layout=ParallelConfig(data_parallel_size=2, expert_parallel_size=2),
        model_config=dataclasses.asdict(whole),
    )  # fmt: skip
    if distributed:
        moments = {id(s.param): s.state["exp_avg"] for s in optimizer.segments()}  # type: ignore[attr-defined]
    else:
        moments = {id(q): optimizer.state[q]["exp_avg"] for q in model.parameters()}
    experts = 0
    for (name, p), q in zip(target.named_parameters(), model.parameters(), strict=True):
        if not getattr(q, "expert", False):
            continue
        # q: this TP rank's f_e slice of all E experts; p: E/2 whole experts (EP rank's)
        sliced, experts_held = q.expert_slice, slice(p.expert_start, p.expert_start + p.shape[0])  # type: ignore[attr-defined]
        for got, saved in (
            (p.detach(), q.detach()),
            (target_optimizer.state[p]["exp_avg"], moments[id(q)].view(q.shape)),
        ):
            held = sliced.take(got, q.shape[sliced.dim])
            assert torch.equal(held, saved[experts_held]), (
                f"{name} ({'distributed' if distributed else 'replicated'} optimizer): a "
                "weight or Adam moment saved at etp = 2 loads into other rows at t = 1"
            )
            assert saved.abs().max() > 0, name
        experts += 1
    assert experts == 2 * config.num_layers


def test_moe_checkpoint_reshards_between_expert_parallel_sizes(tmp_path: Path) -> None:
    """e = 2 <-> e = 1 (2 ranks of d = 2), and etp = 2 at t = 2 -> t = 1, e = 2 (saved by the
    distributed and by the replicated optimizer)."""
    run_distributed(_checkpoint_worker, 2, str(tmp_path))


def test_pipeline_micro_batches_scale_the_auxiliary_losses() -> None:
    """A pipeline step of n = 2 micro-batches equals the two half batches run one after the
    other with the loss and the auxiliary losses each divided by 2 (one process)."""
    from lightning_sp.pipeline import Pipeline

    config = _gpt_config()
    ids, labels = batch(config, batch_size=4, seed=3)
    pipeline = Pipeline(config, ParallelState.single(), num_microbatches=2, dtype=torch.float64)
    pipeline.train_step(ids, labels)
    reference = GPT(config, ParallelState.single(), dtype=torch.float64)
    for layer in reference.layers:
        layer.mlp.aux_loss_scale = 0.5
    for half in (slice(0, 2), slice(2, 4)):
        (reference(ids[half], labels[half]) / 2).backward()
    grads = dict(reference.named_parameters())
    for name, param in pipeline.named_parameters():
        expected = grads[name.removeprefix("chunks.0.")].grad
        assert _rel(param.grad, expected) <= 1e-12, name  # type: ignore[arg-type]
