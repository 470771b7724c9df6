"""A tiny chat SFT run as a user does it: an imported Llama (a local Hugging Face directory),
chat rows rendered with a local tokenizer's template, assistant-only loss, packed documents;
the held-out assistant-token loss falls, and the exported model, with the tokenizer's chat
template, loads in transformers and answers through ``apply_chat_template`` + ``generate``."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_sp import GPTModule, OptimizerConfig
from lightning_sp.data import TextDataModule
from lightning_sp.interop.hf_export import save_hf

from corpora import chat_tokenizer, conversations, jsonl
from hf_models import llama_config, save_random_llama

SEQ = 64


def _trainer(**kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


@pytest.mark.slow
def test_sft_from_imported_llama_lowers_held_out_loss_and_exports(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir = chat_tokenizer(tmp_path)
    save_random_llama(tmp_path / "llama", max_position_embeddings=SEQ)
    rows = jsonl(tmp_path / "chat.jsonl", conversations(48))
    data = TextDataModule(
        paths=str(rows), chat_template_dir=str(tokenizer_dir), prepared_dir=str(tmp_path / "p"),
        seq_length=SEQ, batch_size=2, val_fraction=0.25,
    )  # fmt: skip
    config = llama_config(seq_length=SEQ)
    module = GPTModule(
        config, OptimizerConfig(lr=3e-3, warmup_steps=0), init_from=str(tmp_path / "llama")
    )
    before = _trainer().validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    _trainer(max_steps=40, limit_val_batches=0).fit(module, datamodule=data)
    after = _trainer().validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    assert after < 0.7 * before, (before, after)

    chunk = module.chunks[0]
    tensors = (
        (
            chunk.global_name(name),
            p.detach()[: config.vocab_size] if getattr(p, "padded_vocab", False) else p.detach(),
        )
        for name, p in chunk.named_parameters()
    )
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tokenizer_file = tokenizer_dir / "tokenizer.json"
    out = save_hf(config, tensors, tmp_path / "export", eos_token_id=hf.eos_token_id,
                  tokenizer_file=tokenizer_file, eos_token=hf.eos_token)  # fmt: skip
    assert (
        json.loads((out / "tokenizer_config.json").read_text()).get("chat_template")
        or (out / "chat_template.jinja").is_file()
    )
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the quick brown"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )  # fmt: skip
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    print(f"held-out assistant-token loss {before:.4f} -> {after:.4f}")
    print("answer:", tokenizer.decode(generated[0, prompt["input_ids"].shape[1] :]))


def test_the_sft_demo_setup_writes_the_same_bytes_twice(tmp_path: Path) -> None:
    """Issue 40: ``examples/sft_tiny_setup.py`` drew a different random base model on every
    run, so the demo's figures could not be reproduced and two runs meant to compare layouts
    started from different models. Two runs now write the same bytes, file for file."""
    import hashlib
    import importlib.util

    from cli_runs import ROOT

    spec = importlib.util.spec_from_file_location(
        "sft_tiny_setup", ROOT / "examples" / "sft_tiny_setup.py"
    )
    assert spec is not None and spec.loader is not None
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    digests = []
    for run in ("a", "b"):
        torch.manual_seed(hash(run) % 1000)  # whatever the caller's global RNG holds
        setup.main(tmp_path / run)
        files = sorted(p for p in (tmp_path / run).rglob("*") if p.is_file())
        digests.append({str(p.relative_to(tmp_path / run)): hashlib.sha256(p.read_bytes())
                        .hexdigest() for p in files})  # fmt: skip
    assert "base/model.safetensors" in digests[0]
    differ = [name for name in digests[0] if digests[0][name] != digests[1].get(name)]
    assert digests[0].keys() == digests[1].keys() and not differ, f"differ: {differ}"
