"""``torch.compile`` per layer (:mod:`lightning_sp.model.compile`): inductor gives the eager loss
and gradients in float64 under every recompute preset (t=1) and at t=2 + SP and p=2, dropout
included; an option that cannot be honoured is one line before any step.

Tolerance: the loss to 1e-13 relative, each gradient to 1e-12 of the model's largest gradient
(inductor fuses and reorders reductions; measured: 8.9e-16 on the loss, <= 7e-16 on the
gradients). A gradient that is zero in exact arithmetic (a key bias under a causal softmax) is
rounding noise on both sides, hence the model-wide scale rather than a per-tensor one.
"""

from __future__ import annotations

import pytest
import torch

from lightning_sp import GPTModule, ParallelState, Pipeline
from lightning_sp.errors import ConfigError
from lightning_sp.model.compile import CompileOptions, compile_layers
from lightning_sp.testing.spawn import run_distributed

from models import batch, tiny_config

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}


def _assert_same(
    name: str, eager: tuple[torch.Tensor, dict], compiled: tuple[torch.Tensor, dict]
) -> None:
    (loss, grads), (closs, cgrads) = eager, compiled
    torch.testing.assert_close(closs, loss, rtol=1e-13, atol=0, msg=f"{name}: loss")
    assert cgrads.keys() == grads.keys() and grads, f"{name}: gradients of other parameters"
    scale = max(g.abs().max().item() for g in grads.values())
    for key, grad in grads.items():
        error = (cgrads[key] - grad).abs().max().item()
        assert error <= 1e-12 * scale, (
            f"{name} {key}: compiled vs eager {error:.3g} > 1e-12·{scale:.3g}"
        )


def _run(model: Pipeline, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = model.train_step(ids, labels) if model.runs_backward else model(ids, labels)
    if not model.runs_backward:
        loss.backward()
    model.finalize_grads()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _eager_and_compiled(
    state: ParallelState, microbatches: int, batch_size: int, **fields: object
) -> list[tuple[torch.Tensor, dict]]:
    config = tiny_config(**fields)
    ids, labels = batch(config, batch_size)
    results = []
    for compiled in (False, True):
        model = Pipeline(config, state, num_microbatches=microbatches, dtype=torch.float64)
        if compiled:
            for chunk in model.chunks:
                compile_layers(chunk.layers, CompileOptions())
        results.append(_run(model, ids, labels))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "selective", "lean", "full"])
def test_inductor_gives_the_eager_float64_loss_and_gradients(recompute: str) -> None:
    eager, compiled = _eager_and_compiled(
        ParallelState.single(), 1, 2, num_layers=1, recompute=recompute, **DROPOUT
    )
    _assert_same(f"t=1 {recompute}", eager, compiled)


def _parallel_worker(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float64)
    tp = ParallelState.from_process_group(tensor_parallel_size=2)
    eager, compiled = _eager_and_compiled(
        tp, 1, 2, num_layers=1, recompute="lean", sequence_parallel=True, **DROPOUT
    )
    _assert_same(f"rank {rank} t=2 SP lean", eager, compiled)
    pp = ParallelState.from_process_group(pipeline_parallel_size=2)
    eager, compiled = _eager_and_compiled(pp, 2, 4, num_layers=2, recompute="selective", **DROPOUT)
    _assert_same(f"rank {rank} p=2 selective", eager, compiled)


@pytest.mark.slow
def test_inductor_at_t2_sp_and_p2_gives_the_eager_float64_loss_and_gradients() -> None:
    run_distributed(_parallel_worker, 2, held_groups=True)  # compiled code's (spawn.py)


@pytest.mark.parametrize(
    ("options", "fields", "message"),
    [
        ({"backend": "no-such"}, {}, r"^compile_options.backend='no-such' is not a torch.compile"),
        ({"mode": "fast"}, {}, r"^compile_options.mode='fast' is invalid; valid: default, "),
        (
            {"backend": "aot_eager", "mode": "max-autotune"},
            {},
            r"^compile_options.mode='max-autotune' applies to backend 'inductor' only",
        ),
        ({"fullgraph": "yes"}, {}, r"^compile_options.fullgraph='yes' is invalid"),
    ],
)
def test_bad_options_are_one_line_at_construction(
    options: dict, fields: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        GPTModule(tiny_config(**fields), compile_layers=True,
                  compile_options=CompileOptions(**options))  # fmt: skip
    assert "\n" not in str(error.value)


def test_options_without_compile_layers_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^compile_options.mode='max-autotune' is set but"):
        GPTModule(tiny_config(), compile_options=CompileOptions(mode="max-autotune"))


@pytest.mark.parametrize(
    ("options", "fields", "message"),
    [
        (
            {"mode": "reduce-overhead"},
            {},
            r"^compile_options.mode='reduce-overhead' captures CUDA graphs and the device is "
            r"'cpu'; valid there: default, max-autotune-no-cudagraphs$",
        ),
        (
            {"fullgraph": True},
            {"hidden_dropout": 0.1},
            r"^compile_options.fullgraph=true with hidden_dropout=0.1: ",
        ),
        (
            {"fullgraph": True},
            {"hidden_dropout": 0.0, "attention_dropout": 0.0, "recompute": "selective"},
            r"^compile_options.fullgraph=true with recompute 'selective' on layer 0: ",
        ),
    ],
)
def test_options_the_device_or_model_cannot_honour_are_one_line_before_any_step(
    options: dict, fields: dict, message: str
) -> None:
    module = GPTModule(tiny_config(**fields), compile_layers=True,
                       compile_options=CompileOptions(**options))  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        module.configure_model()
    assert module.pipeline is None, "the model was built before the options were checked"


def test_fullgraph_without_dropout_or_recompute_compiles_whole_layers() -> None:
    """The honoured case: ``aot_eager`` with ``fullgraph=True`` traces each layer as one graph
    (a break would raise) and gives the eager loss."""
    config = tiny_config(num_layers=1, hidden_dropout=0.0, attention_dropout=0.0,
                         recompute="none")  # fmt: skip
    ids, labels = batch(config)
    options = CompileOptions(backend="aot_eager", fullgraph=True)
    module = GPTModule(config, compile_layers=True, compile_options=options)
    with pytest.warns(UserWarning, match="saves for backward what the compiler"):
        module.configure_model()
    eager = GPTModule(config)
    eager.configure_model()
    loss = module.chunks[0](ids, labels)
    torch.testing.assert_close(loss, eager.chunks[0](ids, labels), rtol=1e-6, atol=0)
