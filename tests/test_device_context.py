"""The model under a default-device or default-dtype context other than the CPU's, on CPU.

Lightning builds the model in ``configure_model`` inside ``torch.device(root_device)`` (and, for
``*-true`` precisions, a default-dtype context). Code that assumes the CPU there (a CPU
generator drawing for a tensor created on the default device) crashes on CUDA; the ``meta``
device reproduces that class of bug on a CPU-only machine. Deferred initialisation (build on
``meta``, ``materialize`` (``to_empty``), ``reset_parameters``) must give the same model as
building directly.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from lightning_sp import GPT, ParallelState, Pipeline
from lightning_sp.errors import ConfigError
from lightning_sp.parallel.init import materialize
from lightning_sp.parallel.random import RNGStreams, dropout
from lightning_sp.parallel.state import _group_options
from lightning_sp.testing.spawn import run_distributed
from lightning_sp.training.checks import check_compile
from lightning_sp.training.gpt_module import GPTModule

from models import batch, tiny_config

CONFIG = tiny_config(hidden_dropout=0.1, attention_dropout=0.1, recompute="selective")


def _assert_same_parameters(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert torch.equal(param, ref[name].to(param.dtype)), name


def test_build_under_a_meta_default_device_equals_the_cpu_model() -> None:
    reference = GPT(CONFIG, ParallelState.single())
    with torch.device("meta"):  # what Lightning's torch.device("cuda") context does to CPU code
        model = GPT(CONFIG, ParallelState.single())
    _assert_same_parameters(model, reference)


def test_deferred_init_on_meta_then_to_empty_equals_the_cpu_model() -> None:
    reference = GPT(CONFIG, ParallelState.single())
    model = GPT(CONFIG, ParallelState.single("meta"))
    assert all(p.device.type == "meta" for p in model.parameters())
    materialize(model, "cpu")
    model.reset_parameters()
    _assert_same_parameters(model, reference)
    # the RNG streams of a meta state are CPU generators seeded alike: same dropout masks
    ids, labels = batch(CONFIG)
    assert torch.equal(model(ids, labels), reference(ids, labels))


def test_module_configure_model_under_meta_device_and_bf16_default_dtype() -> None:
    """GPTModule.configure_model as Lightning calls it with ``precision="bf16-true"`` on a
    non-CPU device: the bf16 model holds the fp32 model's weights, rounded."""
    reference = GPT(CONFIG, ParallelState.single())
    module = GPTModule(CONFIG)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("meta"):
            module.configure_model()
    finally:
        torch.set_default_dtype(default)
    (gpt,) = module.chunks
    assert next(gpt.parameters()).dtype == torch.bfloat16
    _assert_same_parameters(gpt, reference)


def test_dropout_refuses_a_generator_of_another_device() -> None:
    streams = RNGStreams(0, ParallelState.single())
    x = torch.empty(4, 4, device="meta")
    with pytest.raises(RuntimeError, match=r"ParallelState\.device = meta"):
        dropout(x, 0.5, streams.sharded)


def test_rng_state_of_another_generator_kind_fails_in_one_line() -> None:
    streams = RNGStreams(0, ParallelState.single())
    saved = streams.state_dict()
    philox_sized = {k: v[:16].clone() for k, v in saved.items()}  # a CUDA generator's state size
    with pytest.raises(ValueError, match="16-byte generator state"):
        streams.load_state_dict(philox_sized)
    streams.load_state_dict(saved)  # its own state round-trips


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_process_group_options_carry_the_timeout(backend: str) -> None:
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        pytest.skip("NCCL is not available in this torch build / machine")
    timeout = datetime.timedelta(seconds=37)
    result = _group_options(backend, timeout)
    assert result is not None
    name, options = result
    assert name == backend
    assert options._timeout == timeout  # type: ignore[attr-defined]


@pytest.mark.slow
def test_compiled_layers_give_the_eager_loss_and_gradients() -> None:
    """``GPTModule(compile_layers=True)``: dropout and selective recomputation included."""
    config = tiny_config(
        num_layers=1, hidden_dropout=0.1, attention_dropout=0.1, recompute="selective"
    )
    ids, labels = batch(config)
    modules = [GPTModule(config), GPTModule(config, compile_layers=True)]
    losses = []
    for module in modules:
        if module.compile_layers:  # its bytes are the compiler's: the module says so, once
            with pytest.warns(UserWarning, match="saves for backward what the compiler"):
                module.configure_model()
        else:
            module.configure_model()
        (gpt,) = module.chunks
        loss = gpt(ids, labels)
        loss.backward()
        losses.append(loss.detach())
    eager, compiled = (m.chunks[0] for m in modules)
    assert compiled.layers[0].__class__.__name__ == "TransformerLayer"
    assert compiled.layers[0]._compiled_call_impl is not None  # compiled by nn.Module.compile
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compile_without_a_compiler_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ConfigError, match=r"^compile_layers=True on CPU needs a C\+\+ compiler"):
        check_compile(ParallelState.single())


def _compiled_layouts_worker(rank: int, world_size: int) -> None:
    """t=2 + SP with lean recomputation (collectives and fused recomputing linears inside
    the compiled layers) and p=2 with selective (the schedule's sends outside them). Compiled
    with ``aot_eager``: dynamo and AOTAutograd, which trace our Functions, collectives and RNG
    snapshots, without inductor's C++ code generation (covered at t=1 above), which would add
    half a minute of compiling to the suite."""
    tp = ParallelState.from_process_group(tensor_parallel_size=2)
    pp = ParallelState.from_process_group(pipeline_parallel_size=2)
    cases = {  # one layer per rank: each compiled layer instance is one more compilation
        "t=2 SP lean": (tp, "lean", True, 1),
        "p=2 selective": (pp, "selective", False, 2),
    }
    for name, (state, recompute, sp, layers) in cases.items():
        config = tiny_config(num_layers=layers, hidden_dropout=0.1, attention_dropout=0.1,
                             recompute=recompute, sequence_parallel=sp)  # fmt: skip
        ids, labels = batch(config, 4)
        results = []
        for compiled in (False, True):
            model = Pipeline(config, state, num_microbatches=2 if state is pp else 1)
            if compiled:
                for chunk in model.chunks:
                    for layer in chunk.layers:
                        layer.compile(backend="aot_eager")
            loss = model.train_step(ids, labels) if model.runs_backward else model(ids, labels)
            if not model.runs_backward:
                loss.backward()
            model.finalize_grads()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss.detach(), grads))
        (eager_loss, eager), (compiled_loss, grads) = results
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0, msg=name)
        assert grads.keys() == eager.keys() and grads, name
        for key, grad in grads.items():
            torch.testing.assert_close(grad, eager[key], rtol=1e-5, atol=1e-6,
                                       msg=f"{name} {key}")  # fmt: skip


@pytest.mark.slow
def test_compiled_layers_in_parallel_layouts_give_the_eager_loss_and_gradients() -> None:
    run_distributed(_compiled_layouts_worker, 2, held_groups=True)  # compiled code's (spawn.py)
