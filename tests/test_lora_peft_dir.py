"""PEFT adapter directories (lightning_sp.interop.peft): our adapters written as
``adapter_config.json`` + ``adapter_model.safetensors`` load with
``peft.PeftModel.from_pretrained`` and give our logits (float64, relative error <= 1e-10); the
merged model written as a plain Hugging Face directory gives them in transformers alone; the
directory read back into a fresh model (and at t = 2 + SP) gives the same logits; a directory
trained on another base is refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from lora_models import LORA, adapted_shard, full_adapters, llama_config

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import load_hf_weights
from lightning_sp.interop.hf_export import save_hf
from lightning_sp.interop.peft import (
    ADAPTER_CONFIG,
    check_adapter_base,
    load_adapter,
    merged_tensors,
    read_adapter_config,
    save_adapter,
)
from lightning_sp.model.gpt import GPT
from lightning_sp.model.lora import apply_lora, lora_parameters
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing.spawn import run_distributed

from hf_models import TOLERANCE, full_logits, relative, save_random_llama, tokens, transformers

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A saved random Llama, our adapted one-process model's adapter directory and merged
    directory, and our logits."""
    root = tmp_path_factory.mktemp("peftdir")
    base = root / "base"
    save_random_llama(base)
    config = llama_config()
    adapters = full_adapters(config, LORA)
    (model,) = adapted_shard(config, ParallelState.single(), str(base), adapters)
    ids, _ = tokens()
    with torch.no_grad():
        logits = full_logits([model], model.state, ids)
    torch.save({"logits": logits, "ids": ids}, root / "ours.pt")
    names = {model.global_name(n): p for n, p in lora_parameters(model).items()}
    save_adapter(config, LORA, names.items(), root / "adapter", base=str(base))
    plain = {n: p for n, p in model.named_parameters() if not getattr(p, "lora", False)}
    save_hf(config, merged_tensors(plain, names, LORA).items(), root / "merged")
    return {"root": str(root), "base": str(base)}


def _ours(root: str) -> dict:
    return torch.load(Path(root) / "ours.pt")


def test_peft_loads_our_adapter_and_gives_our_logits(saved: dict[str, str]) -> None:
    root = Path(saved["root"])
    document = json.loads((root / "adapter" / ADAPTER_CONFIG).read_text())
    assert document["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ), document
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        saved["base"], attn_implementation="sdpa", dtype=torch.float64
    )
    model = peft.PeftModel.from_pretrained(hf, root / "adapter").eval()
    assert all(p.dtype == torch.float64 for p in model.parameters()), "not a float64 reference"
    ours = _ours(saved["root"])
    with torch.no_grad():
        logits = model(ours["ids"]).logits
    err = relative(ours["logits"], logits)
    assert err <= TOLERANCE, f"peft with our adapter: logits relative error {err:.2e}"


def test_merged_export_gives_our_logits_in_transformers(saved: dict[str, str]) -> None:
    root = Path(saved["root"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        root / "merged", attn_implementation="sdpa", dtype=torch.float64
    )
    ours = _ours(saved["root"])
    with torch.no_grad():
        logits = hf.eval()(ours["ids"]).logits
    err = relative(ours["logits"], logits)
    assert err <= TOLERANCE, f"merged export: logits relative error {err:.2e}"


def test_rslora_adapter_and_merge_give_our_logits(saved: dict[str, str], tmp_path: Path) -> None:
    """``use_rslora``: the directory says so, and peft (from the directory) and transformers
    (from the merged export, ``lora_alpha / √r`` folded into the weights) give our logits."""
    lora = dataclasses.replace(LORA, use_rslora=True)
    config = llama_config()
    adapters = full_adapters(config, lora)
    (model,) = adapted_shard(config, ParallelState.single(), saved["base"], adapters, lora=lora)
    ids, _ = tokens()
    with torch.no_grad():
        ours = full_logits([model], model.state, ids)
    names = {model.global_name(n): p for n, p in lora_parameters(model).items()}
    save_adapter(config, lora, names.items(), tmp_path / "adapter", base=saved["base"])
    plain = {n: p for n, p in model.named_parameters() if not getattr(p, "lora", False)}
    save_hf(config, merged_tensors(plain, names, lora).items(), tmp_path / "merged")
    document = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert document["use_rslora"] is True, f"adapter_config.json: {document}"
    back = read_adapter_config(tmp_path / "adapter")
    assert back.use_rslora and back.scaling == lora.scaling, f"read back as {back}"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        saved["base"], attn_implementation="sdpa", dtype=torch.float64
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", attn_implementation="sdpa", dtype=torch.float64
    )
    for what, reference in (
        ("peft with our rslora adapter", peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")),
        ("merged rslora export", merged),
    ):
        with torch.no_grad():
            logits = reference.eval()(ids).logits
        err = relative(ours, logits)
        assert err <= TOLERANCE, f"{what}: logits relative error {err:.2e}"


def _read_back(rank: int, world_size: int, saved: dict[str, str], t: int) -> None:
    state = ParallelState.single() if t == 1 else ParallelState.from_process_group(t)
    config = llama_config(sequence_parallel=t > 1)
    model = GPT(config, state, dtype=torch.float64)
    load_hf_weights(model, saved["base"])
    apply_lora(model, LORA)
    assert load_adapter(model, Path(saved["root"]) / "adapter", config) > 0
    ours = _ours(saved["root"])
    with torch.no_grad():
        logits = full_logits([model], state, ours["ids"])
    err = relative(logits, ours["logits"])
    assert err <= TOLERANCE, f"adapter read back at t={t}: logits relative error {err:.2e}"


def test_adapter_read_back_gives_the_same_logits(saved: dict[str, str]) -> None:
    _read_back(0, 1, saved, 1)
    run_distributed(_read_back, 2, saved, 2)


def test_adapter_of_another_base_is_refused(saved: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        check_adapter_base(Path(saved["root"]) / "adapter", tmp_path)
    line = str(error.value)
    assert "was trained on" in line and "not on init_from" in line and "\n" not in line, line
    check_adapter_base(Path(saved["root"]) / "adapter", saved["base"])  # its own base: fine
