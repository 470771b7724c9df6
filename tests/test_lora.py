"""LoRA (lightning_sp.model.lora, parallel.lora) against ``peft`` on the transformers model with
the same base and adapter weights (adapters on every linear, B non-zero), float64:

* one process and t = 2 + SP, p = 2, c = 2: logits and loss of the stock models, and (with
  float64 norms on both sides, :func:`lora_models.wide_norms`) the loss and every adapter's
  gradient shard, relative error <= 1e-10;
* the base is frozen: no gradient, no optimizer state, bit-identical after AdamW steps, while
  the adapters move;
* bad settings fail in one line naming the field.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from lora_models import LORA, adapted_shard, full_adapters, llama_config, peft_reference, wide_norms

from lightning_sp.errors import ConfigError
from lightning_sp.model.gpt import GPT
from lightning_sp.model.lora import LoRAConfig, apply_lora, lora_parameters
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.parallel.init import local_slice
from lightning_sp.parallel.lora import LoRA
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.testing.spawn import run_distributed

from hf_models import TOLERANCE, full_logits, relative, save_random_llama, tokens
from models import context_shards


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A saved random Llama, adapter values, and peft's stock and float64-norm results."""
    directory = tmp_path_factory.mktemp("llama")
    save_random_llama(directory)
    config = llama_config()
    adapters = full_adapters(config, LORA)
    stock = peft_reference(directory, config, adapters, wide=False)
    wide = peft_reference(directory, config, adapters, wide=True)
    return {"directory": str(directory), "adapters": adapters, "stock": stock, "wide": wide}


def _check_grads(chunks: list[GPT], grads: dict[str, torch.Tensor], what: str) -> int:
    """Every adapter shard's gradient against its slice of peft's; base weights have none."""
    checked = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not getattr(param, "lora", False):
                assert param.grad is None and not param.requires_grad, f"{what}: {name} trains"
                continue
            ref = local_slice(param, grads[chunk.global_name(name)])
            err = relative(param.grad, ref)
            assert err <= TOLERANCE, f"{what}: {name} gradient relative error {err:.2e}"
            checked += 1
    return checked


def _run(case: tuple[int, int, int, str], reference: dict[str, Any]) -> None:
    """One layout ``(t, p, c, recompute)`` (SP with t > 1): stock logits and loss, then with
    float64 norms the loss and every adapter gradient, against peft's."""
    t, p, c, recompute = case
    what = f"llama lora t={t} p={p} c={c} recompute={recompute}"
    single = t * p * c == 1
    state = (
        ParallelState.single()
        if single
        else ParallelState.from_process_group(t, p, context_parallel_size=c)
    )
    config = llama_config(sequence_parallel=t > 1, recompute=recompute)
    for wide in (False, True):
        ref = reference["wide" if wide else "stock"]
        with wide_norms() if wide else nullcontext():
            pipeline = None
            if p > 1:
                pipeline = Pipeline(config, state, num_microbatches=2, dtype=torch.float64)
            directory, adapters = reference["directory"], reference["adapters"]
            chunks = adapted_shard(config, state, directory, adapters, pipeline)
            ids, labels = context_shards(state, ref["ids"], ref["labels"])
            if pipeline is not None:
                loss = pipeline.train_step(ids, labels)
                pipeline.finalize_grads()
            else:
                loss = chunks[0](ids, labels)
                loss.backward()
                finalize_grads(chunks[0], state)
            if pipeline is None or state.pipeline_parallel_rank == p - 1:
                err = relative(loss.detach(), ref["loss"])
                assert err <= TOLERANCE, f"{what} wide={wide}: loss relative error {err:.2e}"
            if wide:
                assert _check_grads(chunks, ref["grads"], what) > 0, f"{what}: no adapters"
            elif c == 1:
                with torch.no_grad():
                    logits = full_logits(chunks, state, ref["ids"])
                if logits is not None:
                    err = relative(logits, ref["logits"])
                    assert err <= TOLERANCE, f"{what}: logits relative error {err:.2e}"


def _worker(rank: int, world_size: int, cases: list, reference: dict[str, Any]) -> None:
    for case in cases:
        _run(case, reference)


def test_one_process_matches_peft(reference: dict[str, Any]) -> None:
    _run((1, 1, 1, "none"), reference)


def test_layouts_match_peft(reference: dict[str, Any]) -> None:
    cases = [(2, 1, 1, "none"), (2, 1, 1, "full"), (1, 2, 1, "lean"), (1, 1, 2, "selective")]
    run_distributed(_worker, 2, cases, reference)


def test_base_frozen_bit_identical_adapters_train(reference: dict[str, Any]) -> None:
    config = llama_config()
    (model,) = adapted_shard(config, ParallelState.single(), reference["directory"],
                             reference["adapters"])  # fmt: skip
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in lora_parameters(model).items()}
    optimizer = build_adamw(model, 1e-2, 0.1, (0.9, 0.95), 1e-8)
    ids, labels = reference["stock"]["ids"], reference["stock"]["labels"]
    for _ in range(2):
        optimizer.zero_grad()
        model(ids, labels).backward()
        optimizer.step()
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, param in model.named_parameters():
        if name in base:
            assert torch.equal(param, base[name]), f"frozen {name} changed"
            assert id(param) not in held and param not in optimizer.state, f"{name} optimized"
        else:
            assert not torch.equal(param, adapters[name]), f"adapter {name} did not move"


def test_dropout_matches_peft_with_the_same_masks(reference: dict[str, Any]) -> None:
    """``lora_dropout`` > 0 in training, one process, float64 norms: every keep-mask our
    adapters draw (from the model's RNG streams) is handed to peft's model, whose dropout
    modules apply it in its own forward (x · mask / (1 - p), plain autograd); the loss and
    every adapter gradient (through our backward's dropped input and input gradient) <= 1e-10
    against peft's; the loss is not the undropped one."""
    lora = dataclasses.replace(LORA, lora_dropout=0.3)
    config = llama_config()
    drawn: dict[str, torch.Tensor] = {}
    draw = LoRA.mask

    def recorded(self: LoRA, like: torch.Tensor) -> torch.Tensor | None:
        mask = draw(self, like)
        assert mask is not None and self.name not in drawn, "one mask per adapter and step"
        drawn[self.name] = mask.transpose(0, 1)  # [s, b, k] -> transformers' [b, s, k]
        return mask

    with wide_norms():
        (model,) = adapted_shard(config, ParallelState.single(), reference["directory"],
                                 reference["adapters"], lora=lora)  # fmt: skip
        for name, module in model.named_modules():
            if isinstance(module, LoRA):
                module.name = model.global_name(name.removesuffix(".lora"))  # type: ignore[assignment]
        ids, labels = reference["wide"]["ids"], reference["wide"]["labels"]
        LoRA.mask = recorded  # type: ignore[method-assign]
        try:
            loss = model.train()(ids, labels)
        finally:
            LoRA.mask = draw  # type: ignore[method-assign]
        loss.backward()
    assert len(drawn) == 7 * config.num_layers, f"masks drawn: {sorted(drawn)}"
    ref = peft_reference(reference["directory"], config, reference["adapters"], wide=True,
                         lora=lora, masks=drawn)  # fmt: skip
    err = relative(loss.detach(), ref["loss"])
    assert err <= TOLERANCE, f"lora_dropout=0.3: loss relative error {err:.2e}"
    assert relative(loss.detach(), reference["wide"]["loss"]) > 1e-4, "dropout changed nothing"
    assert _check_grads([model], ref["grads"], "lora_dropout=0.3") == 14 * config.num_layers


def test_rslora_scaling_matches_peft(reference: dict[str, Any]) -> None:
    """``use_rslora``: the update scaled by ``lora_alpha / √r`` (8 / 2 = 4 here, where
    ``lora_alpha / r`` is 2), one process, float64 norms: the loss and every adapter gradient
    <= 1e-10 against peft's with ``use_rslora=True``; the loss is not the plain scaling's."""
    lora = dataclasses.replace(LORA, use_rslora=True)
    config = llama_config()
    with wide_norms():
        (model,) = adapted_shard(config, ParallelState.single(), reference["directory"],
                                 reference["adapters"], lora=lora)  # fmt: skip
        loss = model(reference["wide"]["ids"], reference["wide"]["labels"])
        loss.backward()
    ref = peft_reference(reference["directory"], config, reference["adapters"], wide=True,
                         lora=lora)  # fmt: skip
    err = relative(loss.detach(), ref["loss"])
    assert err <= TOLERANCE, f"use_rslora: loss relative error {err:.2e} against peft's"
    assert relative(loss.detach(), reference["wide"]["loss"]) > 1e-4, "use_rslora changed nothing"
    assert _check_grads([model], ref["grads"], "use_rslora") == 14 * config.num_layers


def test_bf16_base_stays_bf16_adapters_train_on_fp32_masters() -> None:
    """A bf16 model with adapters: the frozen base stays bf16, bit-identical, with no master,
    gradient or optimizer state; the optimizer holds fp32 masters of the adapters only, with
    fp32 moments, and writes them back rounded to the bf16 adapters."""
    config = llama_config(num_layers=1)
    model = GPT(config, ParallelState.single(), dtype=torch.bfloat16)
    apply_lora(model, LORA)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = lora_parameters(model)
    optimizer = build_adamw(model, 1e-2, 0.1, (0.9, 0.95), 1e-8)
    ids, labels = tokens(batch=2)
    for _ in range(2):
        optimizer.zero_grad()
        model(ids, labels).backward()  # into fp32 main_grad, the adapters' only
        optimizer.step()
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(masters) == len(adapters) > 0, "the optimizer holds more than the adapters"
    for master, param in zip(masters, optimizer.model_params, strict=True):  # type: ignore[attr-defined]
        assert any(param is p for p in adapters.values()), "a base weight is optimized"
        assert master.dtype == torch.float32 and param.dtype == torch.bfloat16, "master dtype"
        assert param.main_grad.dtype == torch.float32, "adapter gradient not fp32"  # type: ignore[attr-defined]
        state = optimizer.state[master]
        for field in ("exp_avg", "exp_avg_sq"):
            assert state[field].dtype == torch.float32, f"adapter {field} is {state[field].dtype}"
        assert torch.equal(param, master.to(torch.bfloat16)), "adapter is not its master rounded"
    for name, param in model.named_parameters():
        if name in base:
            assert param.dtype == torch.bfloat16, f"frozen {name} is {param.dtype}"
            assert torch.equal(param, base[name]) and param.grad is None, f"frozen {name} moved"
            assert not hasattr(param, "main_grad"), f"frozen {name} has a gradient buffer"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("r", 0, "lora.r=0 must be a positive integer"),
        ("lora_alpha", 0.0, "lora.lora_alpha=0.0 must be a positive finite number"),
        ("lora_alpha", float("nan"), "lora.lora_alpha=nan must be a positive finite number"),
        ("lora_dropout", 1.0, "lora.lora_dropout=1.0 must be a finite number in [0, 1)"),
        ("lora_dropout", -0.1, "lora.lora_dropout=-0.1 must be a finite number in [0, 1)"),
        ("target_modules", [], "lora.target_modules=[] must be a non-empty list"),
    ],
)
def test_bad_settings_fail_in_one_line(field: str, value: object, message: str) -> None:
    lora = LoRAConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as error:
        lora.validate()
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_unknown_target_names_the_valid_ones() -> None:
    model = GPT(llama_config(), ParallelState.single(), device="meta")
    with pytest.raises(ConfigError) as error:
        apply_lora(model, LoRAConfig(target_modules=["q_proj", "qkv"]))
    line = str(error.value)
    assert "'qkv' matches no linear" in line and "q_proj" in line and "down_proj" in line, line
    assert "\n" not in line
