"""FP8 through the GPT's own linears (the run setting ``fp8``: :mod:`lightning_sp.model.fp8`,
:mod:`lightning_sp.parallel.fp8_linears`), with torchao's emulated GEMMs on CPU.

* One process: our Llama with ``fp8`` equals transformers' ``LlamaForCausalLM`` on the same
  weights converted by torchao (``convert_to_float8_training``, ``Float8Linear`` with
  ``emulate=True`` on every linear but ``lm_head``, as our setting leaves the head), in the
  loss and in every linear's and the embedding's gradient, to ``TOLERANCE`` relative (fp32,
  both recipes). The float8 operands are the same values wherever the two models' fp32 inputs
  agree; what may differ is the fp32 sums' order (transformers sums the three input gradients
  of q, k, v as autograd does, so do we), which in high precision moves these gradients by
  ~5e-7 (measured: 0 with FP8 on this shape: the casts absorb it). A flipped e4m3 rounding of
  one element would move a gradient by ~1e-4 of its norm, above the tolerance, and FP8 itself
  moves them by ~0.1 (the control: torchao's FP8 vs high precision must exceed 100x the
  tolerance).
* t = 2 + SP equals t = 1, both in FP8 (the scales agreed over the TP group where the unsharded
  tensor's amax spans the shards), loss and every gradient to ``TP_TOLERANCE``; without the
  agreement (each rank's own amax) the same comparison misses by far.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import load_hf_weights
from lightning_sp.model.config_checks import check_model_layout
from lightning_sp.model.fp8 import check_fp8_launch
from lightning_sp.model.fused import fused_column_linear
from lightning_sp.model.lora import LoRAConfig, check_lora
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.parallel import fp8
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.fp8 import FP8Config
from lightning_sp.parallel.layers import interleave
from lightning_sp.testing.spawn import run_distributed

from hf_models import llama_config, relative, save_random_llama, tokens
from models import batch, loss_and_grads, max_gradient_error, tiny_config

pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
TP_TOLERANCE = 1e-5
OURS_TO_HF = {
    "layers.{}.attention.query.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.key.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.value.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.proj.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.mlp.gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.mlp.up.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.mlp.fc2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.ln1.weight": "model.layers.{}.input_layernorm.weight",
}


def _ours(directory: Path, recipe: str | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    config = llama_config(fp8=FP8Config(recipe, emulate=True) if recipe else None)
    model = GPT(config, ParallelState.single(), dtype=torch.float32).train()
    load_hf_weights(model, directory)
    ids, labels = tokens(batch=2)
    loss = model(ids, labels)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads["word_embeddings.weight"] = grads["word_embeddings.weight"][: config.vocab_size]
    return loss.detach(), grads


def _torchao(directory: Path, recipe: str | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).train()
    if recipe is not None:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda module, fqn: fqn != "lm_head"
        )
        converted = type(model.model.layers[0].self_attn.q_proj).__name__
        assert converted == "Float8Linear", f"torchao did not convert the reference ({converted})"
        assert type(model.lm_head).__name__ == "Linear", "the reference's head was converted"
    ids, labels = tokens(batch=2)
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _errors(ours: tuple, theirs: tuple) -> dict[str, float]:
    (loss, grads), (ref_loss, ref_grads) = ours, theirs
    errors = {"loss": relative(loss, ref_loss)}
    errors["word_embeddings"] = relative(
        grads["word_embeddings.weight"], ref_grads["model.embed_tokens.weight"]
    )
    for layer in range(2):
        for name, hf in OURS_TO_HF.items():
            errors[name.format(layer)] = relative(
                grads[name.format(layer)], ref_grads[hf.format(layer)]
            )
    return errors


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fp8_llama")
    save_random_llama(directory)
    return directory


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_gpt_fp8_equals_torchao_float8_linear_on_transformers_llama(
    llama_dir: Path, recipe: str
) -> None:
    errors = _errors(_ours(llama_dir, recipe), _torchao(llama_dir, recipe))
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= TOLERANCE, (
        f"{recipe}: our FP8 GPT vs torchao's Float8Linear Llama: {worst} off by "
        f"{errors[worst]:.3g} > {TOLERANCE} (all: {errors})"
    )
    (_, high), (_, low) = _torchao(llama_dir, None), _torchao(llama_dir, recipe)
    linear = min(relative(low[n], high[n]) for n in high if n.endswith("proj.weight"))
    assert linear > 100 * TOLERANCE, (
        f"{recipe}: torchao's FP8 and high precision differ by only {linear:.3g}: the "
        "comparison cannot tell FP8 from high precision"
    )


def _tp_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Loss and worst gradient error of t=2 + SP against t=1, both FP8, per recipe; then
    tensorwise without agreed amaxes (the control)."""
    results: dict[str, Any] = {}
    tp = ParallelState.from_process_group(tensor_parallel_size=2)

    def run(recipe: str, state: ParallelState, sp: bool) -> tuple[GPT, torch.Tensor]:
        config = tiny_config(
            "llama", sequence_parallel=sp, recompute="none",
            fp8=FP8Config(recipe, emulate=True),
        )  # fmt: skip
        model = GPT(config, state, dtype=torch.float32).train()
        ids, labels = batch(config)
        return model, loss_and_grads(model, ids, labels)

    for recipe in fp8.RECIPES:
        reference, ref_loss = run(recipe, ParallelState.single(), False)
        model, loss = run(recipe, tp, True)
        error, name = max_gradient_error(model, reference)
        results[recipe] = (relative(loss, ref_loss), error, name)
    reference, ref_loss = run("tensorwise", ParallelState.single(), False)
    fp8.group_size = lambda group: 1  # type: ignore[assignment]  # every amax local
    model, loss = run("tensorwise", tp, True)
    results["control"] = max_gradient_error(model, reference)
    return results


@pytest.mark.slow
def test_gpt_fp8_at_tp2_sp_equals_one_process() -> None:
    for rank, result in enumerate(run_distributed(_tp_worker, 2)):
        for recipe in fp8.RECIPES:
            loss_error, error, name = result[recipe]
            assert loss_error <= TP_TOLERANCE and error <= TP_TOLERANCE, (
                f"rank {rank} {recipe}: t=2 + SP vs t=1 in FP8: loss off by {loss_error:.3g}, "
                f"{name} gradient by {error:.3g} (tolerance {TP_TOLERANCE})"
            )
        error, name = result["control"]
        assert error > 100 * TP_TOLERANCE, (
            f"rank {rank}: with every amax local t=2 still equals t=1 ({name} {error:.3g}): "
            "the comparison cannot see a missing amax agreement"
        )


def _refusal(case: str) -> None:
    tensorwise = FP8Config("tensorwise", emulate=True)
    config = tiny_config("llama", fp8=tensorwise)
    if case == "moe":
        moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=32)
        moe_config = tiny_config(
            "llama", feed_forward="moe", moe=moe, fp8=tensorwise, sequence_parallel=True
        )
        check_model_layout(moe_config, ParallelConfig(tensor_parallel_size=2))
    elif case == "context":
        check_model_layout(config, ParallelConfig(context_parallel_size=2))
    elif case == "replicas":
        check_model_layout(config, ParallelConfig(tensor_parallel_size=4))
    elif case == "float64":
        GPT(config, ParallelState.single(), dtype=torch.float64)
    elif case == "cpu":
        GPT(tiny_config("llama", fp8=FP8Config("rowwise")), ParallelState.single())
    elif case == "lora":
        check_lora(LoRAConfig(), config)
    elif case == "launch_cpu":  # cli.py fit's check, before any process starts
        check_fp8_launch(tiny_config("llama", fp8=FP8Config("rowwise")), "cpu", "bf16-true", False)
    elif case == "launch_64":
        check_fp8_launch(config, "cpu", "64-true", False)
    elif case == "launch_lora":
        check_fp8_launch(config, "gpu", "bf16-true", True)
    elif case == "recipe":
        tiny_config("llama", fp8=FP8Config("mxfp8", emulate=True)).validate()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("moe", r"fp8.recipe='tensorwise' with feed_forward='moe', tensor_parallel_size=2 and "
                r"expert_tensor_parallel_size=1: an expert's FP8 scales would be one sequence "
                r"shard's \(docs/fp8.md\); set expert_tensor_parallel_size=2 or fp8: null"),
        ("context", r"fp8.recipe='tensorwise' with context_parallel_size=2: the FP8 scales are "
                    r"not agreed"),
        ("replicas", r"fp8.recipe='tensorwise' with num_query_groups=2 < tensor_parallel_size=4"),
        ("float64", r"fp8.recipe='tensorwise' with float64 parameters: float8 GEMMs take bf16, "
                    r"fp16 or fp32 inputs"),
        ("cpu", r"fp8.recipe='rowwise' on CPU: a CPU has no FP8 GEMMs; set fp8.emulate=true"),
        ("lora", r"lora with fp8.recipe='tensorwise': adapters on float8 linears are not "
                 r"supported"),
        ("recipe", r"fp8.recipe='mxfp8' is not a recipe; valid: tensorwise, rowwise"),
        ("launch_cpu", r"fp8.recipe='rowwise' on CPU: a CPU has no FP8 GEMMs"),
        ("launch_64", r"fp8.recipe='tensorwise' with float64 parameters"),
        ("launch_lora", r"lora with fp8.recipe='tensorwise'"),
    ],
)  # fmt: skip
def test_unsupported_fp8_runs_are_one_line(case: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}") as caught:
        _refusal(case)
    assert "\n" not in str(caught.value), f"{case}: more than one line: {caught.value}"


def test_the_fp8_setting_round_trips_through_the_config_record() -> None:
    """What hparams.yaml and a checkpoint's record write (``values``) reads back whole."""
    config = tiny_config("llama", fp8=FP8Config("rowwise", emulate=True))
    again = GPTConfig.from_values(config.values())
    assert again.fp8 == FP8Config("rowwise", emulate=True) and again == config, again.fp8
    assert config.architecture == tiny_config("llama").architecture, "fp8 is no architecture"


def test_eager_fp8_gemms_are_warned_once_and_compiled_or_emulated_ones_are_not() -> None:
    """An H200 measured an eager FP8 step 2.7-3.4x slower than BF16: a run with FP8 GEMMs and
    eager layers is told so in one line naming the setting; compiled layers, emulation (the
    numerics only) and BF16 are not."""
    from lightning_sp.training.checks import eager_fp8_warning

    real = tiny_config("llama", fp8=FP8Config("rowwise"))
    line = eager_fp8_warning(real, compile_layers=False)
    assert line is not None and "fp8.recipe='rowwise'" in line and "compile_layers" in line, line
    assert "\n" not in line, f"more than one line: {line}"
    assert eager_fp8_warning(real, compile_layers=True) is None, "compiled layers warned"
    emulated = tiny_config("llama", fp8=FP8Config("rowwise", emulate=True))
    assert eager_fp8_warning(emulated, compile_layers=False) is None, "emulation warned"
    assert eager_fp8_warning(tiny_config("llama"), compile_layers=False) is None, "bf16 warned"


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fused_fp8_column_linear_equals_its_linears_one_by_one(recipe: str) -> None:
    """GPT-2's fused QKV (biases, 4 groups) in float8: the output and every gradient equal
    each linear's own float8 forward (one weight), outputs interleaved per group."""
    config = tiny_config("gpt2", fp8=FP8Config(recipe, emulate=True), recompute="none")
    attention = GPT(config, ParallelState.single()).layers[0].attention
    linears = (attention.query, attention.key, attention.value)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    target = torch.randn(16, 2, 96, generator=torch.Generator().manual_seed(1))

    def run(fused: bool) -> list[torch.Tensor]:
        given = x.clone().requires_grad_(True)
        if fused:
            out = fused_column_linear(given, linears, attention.local_groups)
        else:
            outs = [linear(given).reshape(32, -1).t() for linear in linears]
            out = interleave(outs, attention.local_groups).t().reshape(16, 2, -1)
        (out * target).sum().backward()
        params = [p for linear in linears for p in (linear.weight, linear.bias)]
        grads = [given.grad, *(p.grad for p in params)]
        for p in params:
            p.grad = None
        return [out.detach(), *grads]

    for i, (a, b) in enumerate(zip(run(True), run(False), strict=True)):
        assert a is not None and b is not None
        assert relative(a, b) <= 1e-6, f"{recipe}: tensor {i} of (out, x, W/b...) differs"
