"""LoRA on Qwen3 and Mixtral against ``peft`` on the transformers model with the same base and
adapter weights (``B`` non-zero), float64: logits and loss of the stock models, and with float64
norms on both sides (:func:`lora_models.wide_norms`: our RMSNorms and Qwen3's per-head
query/key norm; transformers' ``Qwen3RMSNorm`` / ``MixtralRMSNorm`` compute fp32 statistics
even in a float64 model) the loss and every adapter gradient shard, <= 1e-10.

* Qwen3 (per-head query/key norms, head dimension 12 != h/a): adapters on every linear, at
  t = 1, t = 2 + SP, p = 2 (lean) and c = 2 (selective);
* Mixtral: adapters on the attention's four linears (the experts take none: a target naming
  them is refused in one line), at t = 1, t = 2 + SP and e = 2. The router runs in fp32 on both
  sides for the stock comparison; for the gradients it is widened too (``router_dtype: fp64``
  here, transformers' gate softmax in float64), since fp32 softmax backward orders differ.
"""

from __future__ import annotations

import dataclasses
import types
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_families import save_random_family
from lora_models import adapted_shard, full_adapters, peft_reference, wide_norms

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import read_hf_config
from lightning_sp.model.gpt import GPT
from lightning_sp.model.lora import LoRAConfig, apply_lora
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.parallel.init import local_slice
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.testing.spawn import run_distributed

from hf_models import SEQ, TOLERANCE, full_logits, relative
from models import context_shards

transformers = pytest.importorskip("transformers")

QWEN3 = LoRAConfig(r=4, lora_alpha=8.0, target_modules=["all-linear"])
MIXTRAL = LoRAConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
SETTINGS = {"qwen3": (QWEN3, None), "mixtral": (MIXTRAL, MIXTRAL.target_modules)}


def _save_mixtral(directory: Path) -> None:
    """A small random Mixtral (2 layers, 4 experts, top-2, 4 heads in 2 groups), perturbed."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=64, num_experts_per_tok=2, intermediate_size=48,
        num_local_experts=4, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    model.save_pretrained(directory)


def _wide_router_forward(self: Any, hidden_states: torch.Tensor) -> tuple:
    """``MixtralTopKRouter.forward`` with its softmax in float64 (transformers casts to fp32)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dim=-1)
    top, indices = torch.topk(probs, self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), indices


def _wide_router(hf: Any) -> None:
    """Every Mixtral router of ``hf`` with float64 scores."""
    for layer in hf.model.layers:
        gate = layer.mlp.gate
        gate.forward = types.MethodType(_wide_router_forward, gate)


def _config(family: str, directory: str, **overrides: Any) -> Any:
    return read_hf_config(directory, seq_length=SEQ, **overrides)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = {}
    for family in SETTINGS:
        directory = tmp_path_factory.mktemp(family)
        if family == "qwen3":
            save_random_family(directory, "qwen3")
        else:
            _save_mixtral(directory)
        lora, targets = SETTINGS[family]
        config = _config(family, str(directory), recompute="none")
        adapters = full_adapters(config, lora)
        stock = peft_reference(directory, config, adapters, False, lora, targets)
        wide = peft_reference(directory, config, adapters, True, lora, targets,
                              prepare=_wide_router if family == "mixtral" else None)  # fmt: skip
        out[family] = {"directory": str(directory), "adapters": adapters, "stock": stock,
                       "wide": wide}  # fmt: skip
    return out


def _run(family: str, case: tuple[int, int, int, int, str], ref: dict[str, Any]) -> int:
    """One layout ``(t, p, c, e, recompute)`` (SP with t > 1): stock logits and loss, then
    with float64 norms (and router) the loss and every adapter gradient; returns the number of
    adapter shards checked."""
    t, p, c, e, recompute = case
    what = f"{family} lora t={t} p={p} c={c} e={e} recompute={recompute}"
    single = t * p * c * e == 1
    state = (
        ParallelState.single()
        if single
        else ParallelState.from_process_group(t, p, context_parallel_size=c, expert_parallel_size=e)
    )
    lora = SETTINGS[family][0]
    checked = 0
    for wide in (False, True):
        config = _config(family, ref["directory"], recompute=recompute,
                         sequence_parallel=t > 1)  # fmt: skip
        if wide and config.moe is not None:
            wider = dataclasses.replace(config.moe, router_dtype="fp64")
            config = dataclasses.replace(config, moe=wider)
        result = ref["wide" if wide else "stock"]
        with wide_norms() if wide else nullcontext():
            pipeline = None
            if p > 1:
                pipeline = Pipeline(config, state, num_microbatches=2, dtype=torch.float64)
            chunks = adapted_shard(config, state, ref["directory"], ref["adapters"], pipeline,
                                   lora)  # fmt: skip
            ids, labels = context_shards(state, result["ids"], result["labels"])
            if pipeline is not None:
                loss = pipeline.train_step(ids, labels)
                pipeline.finalize_grads()
            else:
                loss = chunks[0](ids, labels)
                loss.backward()
                finalize_grads(chunks[0], state)
            if pipeline is None or state.pipeline_parallel_rank == p - 1:
                err = relative(loss.detach(), result["loss"])
                assert err <= TOLERANCE, f"{what} wide={wide}: loss relative error {err:.2e}"
            if wide:
                for chunk in chunks:
                    for name, param in chunk.named_parameters():
                        if not getattr(param, "lora", False):
                            assert param.grad is None, f"{what}: frozen {name} has a gradient"
                            continue
                        expected = local_slice(param, result["grads"][chunk.global_name(name)])
                        err = relative(param.grad, expected)
                        assert err <= TOLERANCE, f"{what}: {name} gradient error {err:.2e}"
                        checked += 1
            elif c == 1:
                with torch.no_grad():
                    logits = full_logits(chunks, state, result["ids"])
                if logits is not None:
                    err = relative(logits, result["logits"])
                    assert err <= TOLERANCE, f"{what}: logits relative error {err:.2e}"
    assert checked > 0, f"{what}: no adapter gradient checked"
    return checked


def _worker(rank: int, world_size: int, cases: list, references: dict[str, Any]) -> None:
    for family, case in cases:
        _run(family, case, references[family])


@pytest.mark.parametrize("family", list(SETTINGS))
def test_one_process_matches_peft(family: str, references: dict[str, Any]) -> None:
    _run(family, (1, 1, 1, 1, "none"), references[family])


@pytest.mark.slow
def test_layouts_match_peft(references: dict[str, Any]) -> None:
    cases = [
        ("qwen3", (2, 1, 1, 1, "none")), ("qwen3", (1, 2, 1, 1, "lean")),
        ("qwen3", (1, 1, 2, 1, "selective")),
        ("mixtral", (2, 1, 1, 1, "none")), ("mixtral", (1, 1, 1, 2, "full")),
        ("mixtral", (1, 2, 1, 1, "selective")), ("mixtral", (1, 1, 2, 1, "lean")),
    ]  # fmt: skip
    run_distributed(_worker, 2, cases, references)


def test_mixtral_experts_refused_in_one_line(references: dict[str, Any]) -> None:
    config = _config("mixtral", references["mixtral"]["directory"], recompute="none")
    model = GPT(config, ParallelState.single(), device="meta")
    for target in ("experts", "w1", "gate_up_proj"):
        with pytest.raises(ConfigError) as error:
            apply_lora(model, LoRAConfig(target_modules=[target]))
        line = str(error.value)
        assert "the experts of an MoE layer take no adapters" in line and "\n" not in line, line
