"""Adapters through the commands (lightning_sp.cli.export, lightning_sp.training.adapters): a
LoRA run from a saved Qwen3 directory, checkpointed by the strategy; ``export --adapter``
writes a PEFT directory that ``peft.PeftModel.from_pretrained`` loads to our logits, ``export
--output`` the merged model that transformers loads to them; ``model.adapter_from`` starts a
run from that directory (the same logits); one line each for an adapter directory on another
base, an adapter checkpoint resumed onto another base, ``adapter_from`` without a base, a
stated ``r`` the directory does not have, and ``--adapter`` of a full fine-tune."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from hf_families import save_random_family
from jsonargparse import Namespace
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_sp import GPTModule, MegatronSPStrategy, OptimizerConfig
from lightning_sp.checkpoint.verify import check_checkpoint, read_lightning
from lightning_sp.cli.checks import check_resume, checkpoint_adapters
from lightning_sp.cli.export import (
    CheckpointModel,
    export_adapter,
    export_checkpoint,
    open_checkpoint,
)
from lightning_sp.data import BYTE_EOS_ID
from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import read_hf_config
from lightning_sp.interop.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    base_fingerprint,
)
from lightning_sp.model.lora import LoRAConfig, lora_parameters

from hf_models import full_logits, relative, tokens
from test_trainer import data, logged, trainer

pytestmark = pytest.mark.slow  # Lightning runs (a fit, a resume on each base)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = LoRAConfig(r=4, lora_alpha=8.0, target_modules=["all-linear"])
FP32 = 2e-6
"""Relative error of fp32 logits between two implementations of the same model (measured
~3e-7 here)."""


def _module(base: Path, config_overrides: dict | None = None, **kwargs: object) -> GPTModule:
    config = read_hf_config(base, seq_length=64, hidden_dropout=0.0, attention_dropout=0.0,
                            **(config_overrides or {}))  # fmt: skip
    kwargs.setdefault("lora", LORA)
    return GPTModule(config, OptimizerConfig(lr=1e-2, warmup_steps=0), init_from=str(base),
                     **kwargs)  # type: ignore[arg-type]  # fmt: skip


def _logits(module: GPTModule, ids: torch.Tensor) -> torch.Tensor:
    (chunk,) = module.chunks
    with torch.no_grad():
        logits = full_logits([chunk], chunk.state, ids)
    assert logits is not None
    return logits


class Seen(Callback):
    """Saves the trained model's logits on ``ids`` and its adapters (full tensors, one
    process) to ``path`` (the strategy runs the fit in a spawned process)."""

    def __init__(self, ids: torch.Tensor, path: Path) -> None:
        self.ids, self.path = ids, path

    def on_train_end(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        (chunk,) = pl_module.chunks
        adapters = {
            chunk.global_name(n): p.detach().clone() for n, p in lora_parameters(chunk).items()
        }
        torch.save({"logits": _logits(pl_module, self.ids), "adapters": adapters}, self.path)

    def seen(self) -> dict[str, object]:
        return torch.load(self.path)

    def on_validation_end(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        self.on_train_end(trainer, pl_module)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> dict[str, object]:
    """A Qwen3 base, another base of the same architecture, a 4-step LoRA run on the first
    with its checkpoint, and our logits after it."""
    root = tmp_path_factory.mktemp("lora_export")
    base, other = root / "base", root / "other"
    save_random_family(base, "qwen3")
    shutil.copytree(base, other)  # the same architecture, other weights
    weights = load_file(str(other / "model.safetensors"))
    save_file({k: v * 1.01 for k, v in weights.items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    module = _module(base)
    saving = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=4)
    ids, _ = tokens(batch=2, vocab=module.config.vocab_size)
    seen = Seen(ids, root / "seen.pt")
    trainer(root, "run", "single", max_steps=4, callbacks=[saving, seen]).fit(
        module, data(corpus_dir)
    )
    return {"root": root, "base": base, "other": other, "ckpt": root / "ckpt" / "last.ckpt",
            "ids": ids, "corpus": corpus_dir, **seen.seen()}  # fmt: skip


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (folder / f"doc{i}.py").write_text("def add(a, b):\n    return a + b\n" * (40 + i))
    return folder


def test_export_adapter_loads_in_peft_with_our_logits(run: dict) -> None:
    out = export_adapter(open_checkpoint(run["ckpt"]), run["root"] / "adapter", overwrite=False)
    document = json.loads((out / ADAPTER_CONFIG).read_text())
    assert document["r"] == LORA.r and document["base_model_name_or_path"] == str(run["base"])
    saved = load_file(str(out / ADAPTER_WEIGHTS))
    ours = run["adapters"]
    assert len(saved) == len(ours) > 0, "the adapter file does not hold every adapter"
    query = saved[f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(query, ours["layers.0.attention.query.lora.B"]), "exported B differs"
    hf = transformers.AutoModelForCausalLM.from_pretrained(run["base"], attn_implementation="sdpa")
    model = peft.PeftModel.from_pretrained(hf, out).eval()
    with torch.no_grad():
        logits = model(run["ids"]).logits
    err = relative(run["logits"], logits)
    assert err <= FP32, f"peft with the exported adapter: logits relative error {err:.2e}"


def test_export_output_writes_the_merged_model(run: dict) -> None:
    out = export_checkpoint(run["ckpt"], run["root"] / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    with torch.no_grad():
        logits = hf.eval()(run["ids"]).logits
    err = relative(run["logits"], logits)
    assert err <= FP32, f"merged export in transformers: logits relative error {err:.2e}"


def test_adapter_from_continues_with_the_same_adapters(run: dict, tmp_path: Path) -> None:
    adapter = run["root"] / "adapter_from"
    export_adapter(open_checkpoint(run["ckpt"]), adapter, overwrite=False)
    module = _module(run["base"], lora=None, adapter_from=str(adapter))  # settings: the dir's
    assert module.lora is not None and module.lora.r == LORA.r
    seen = Seen(run["ids"], tmp_path / "seen.pt")
    L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=1, callbacks=[seen]).validate(
        module, data(run["corpus"]), verbose=False
    )  # fmt: skip
    started = seen.seen()
    assert started["adapters"].keys() == run["adapters"].keys()
    for name, tensor in started["adapters"].items():
        assert torch.equal(tensor, run["adapters"][name]), f"adapter_from: {name} differs"
    err = relative(started["logits"], run["logits"])
    assert err <= 1e-6, f"adapter_from: logits relative error {err:.2e}"


def test_adapter_mistakes_are_one_line(run: dict, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    export_adapter(open_checkpoint(run["ckpt"]), adapter, overwrite=False)
    cases = {
        "another base": (dict(adapter_from=str(adapter)), run["other"], "was trained on"),
        "no base": (dict(adapter_from=str(adapter)), None, "needs init_from"),
        "another r": (
            dict(adapter_from=str(adapter), lora=LoRAConfig(r=8, target_modules=["all-linear"])),
            run["base"], "lora.r=8 differs from adapter_from",
        ),
        "another lora_alpha": (
            dict(adapter_from=str(adapter),
                 lora=dataclasses.replace(LORA, lora_alpha=16.0)),
            run["base"], "lora.lora_alpha=16.0 differs from adapter_from",
        ),
        "another use_rslora": (
            dict(adapter_from=str(adapter), lora=dataclasses.replace(LORA, use_rslora=True)),
            run["base"], "lora.use_rslora=True differs from adapter_from",
        ),
    }  # fmt: skip
    for case, (kwargs, base, message) in cases.items():
        config = read_hf_config(run["base"], seq_length=64)
        try:
            GPTModule(config, init_from=None if base is None else str(base), **kwargs)  # type: ignore[arg-type]
        except ConfigError as error:
            line = str(error)
        else:
            raise AssertionError(f"{case}: accepted without a word (expected {message!r})")
        assert message in line and "\n" not in line, f"{case}: {line}"
    full = CheckpointModel(Path("ckpt"), read_hf_config(run["base"]), {}, {}, {})
    with pytest.raises(ConfigError, match=r"is a full fine-tune .* has no adapters"):
        export_adapter(full, tmp_path / "none", overwrite=False)


def test_adapter_checkpoint_holds_the_adapters_and_their_state_only(run: dict) -> None:
    """A LoRA run from init_from saves no frozen weight: its tensors are the adapters, their
    Adam moments and steps (and RNG state); it records its base (path and fingerprint)."""
    stored = FileSystemReader(str(Path(run["ckpt"]).resolve())).read_metadata()
    tensors = [
        k
        for k, v in stored.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.startswith(("model.", "optim."))
    ]
    assert tensors, "the checkpoint holds no tensor"
    base = [k for k in tensors if ".lora." not in k]
    assert not base, f"the adapter checkpoint holds frozen base tensors: {base[:3]}"
    adapters = {f"model.{name}" for name in run["adapters"]}
    assert adapters == {k for k in tensors if k.startswith("model.")}, "adapters missing"
    moments = {k for k in tensors if k.endswith(".exp_avg_sq")}
    assert len(moments) == len(adapters), "the adapters' optimizer state is not all saved"
    record = read_lightning(Path(run["ckpt"]))["lora_base"]
    assert record == {"init_from": str(run["base"]), "sha256": base_fingerprint(run["base"])}


class StartLogits(Seen):
    """Rank 0 saves the full logits on ``ids`` when a resumed fit starts (every rank
    computes them: the gather is collective)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        chunks = pl_module.chunks
        with torch.no_grad():
            logits = full_logits(chunks, chunks[0].state, self.ids)
        if trainer.global_rank == 0:
            torch.save({"logits": logits}, self.path)

    def on_train_end(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        pass


def test_adapter_checkpoint_resumes_in_another_layout(run: dict, tmp_path: Path) -> None:
    """The t = 1 adapter checkpoint resumed at t = 2 + SP: the base read again from
    init_from on each rank, the adapters resharded, the model the trained one (its logits),
    and the run steps on (the adapters' optimizer state loaded)."""
    module = _module(run["base"], config_overrides={"sequence_parallel": True})
    seen = StartLogits(run["ids"], tmp_path / "start.pt")
    trainer(tmp_path, "tp2", "tp2-sp", max_steps=5, callbacks=[seen]).fit(
        module, data(run["corpus"]), ckpt_path=str(run["ckpt"])
    )
    err = relative(seen.seen()["logits"], run["logits"])
    assert err <= FP32, f"resumed at t=2+SP from adapters only: logits relative error {err:.2e}"
    steps = logged(tmp_path, "tp2", "train/loss")
    assert len(steps) == 1, f"the resumed run did not take step 5 alone: {steps}"


def test_generate_on_an_adapter_checkpoint(run: dict, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``generate`` on the adapter checkpoint, its config naming no size and no adapters
    (the base's sizes from init_from, the adapters from the checkpoint): greedy text equal to
    peft's greedy generation with the exported adapter on the transformers base."""
    from lightning_sp.cli.fit import GPTCLI
    from lightning_sp.cli.generate import main as generate
    from lightning_sp.data.prompts import Codec

    prompt, new = "def add", 12
    argv = ["--ckpt_path", str(run["ckpt"]), "--prompt", prompt, "--max_new_tokens", str(new),
            "--temperature", "0", "--model.init_from", str(run["base"]),
            "--model.config.seq_length", "64", "--trainer.accelerator", "cpu",
            "--data.paths", str(run["corpus"])]  # fmt: skip
    assert generate(argv, GPTCLI) == 0
    printed = capsys.readouterr().out
    adapter = export_adapter(open_checkpoint(run["ckpt"]), tmp_path / "adapter", overwrite=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(run["base"], attn_implementation="sdpa")
    model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    codec = Codec(BYTE_EOS_ID)
    ids = torch.tensor([codec.encode(prompt)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False,
                             eos_token_id=BYTE_EOS_ID, pad_token_id=BYTE_EOS_ID)  # fmt: skip
    theirs = prompt + codec.decode(out[0, ids.shape[1] :].tolist())
    assert printed.endswith(theirs + "\n"), f"generate printed {printed[-200:]!r}, peft: {theirs!r}"


def test_validate_on_an_adapter_checkpoint(run: dict, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``cli.py validate`` of a LoRA checkpoint with the run's config as written, which names
    no adapters (the reported "checkpoint holds ...lora.A, which this model lacks"): the
    checkpoint's adapters are used, giving the validation loss of a module that states them,
    not the base's; a stated ``r`` other than the checkpoint's is one line."""
    from lightning_sp.cli.main import main

    argv = ["validate", "--model.init_from", str(run["base"]), "--model.config.seq_length", "64",
            "--model.config.hidden_dropout", "0", "--model.config.attention_dropout", "0",
            "--data.paths", str(run["corpus"]), "--data.batch_size", "4",
            "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--trainer.precision", "32-true", "--trainer.strategy", "megatron_sp",
            "--trainer.logger", "false",
            "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp_path),
            "--ckpt_path", str(run["ckpt"])]  # fmt: skip
    main(argv)
    table = capsys.readouterr().out
    found = re.search(r"val/loss\W+([0-9.]+)", table)
    assert found, table[-2000:]
    cli_loss = float(found.group(1))

    def validated(module: GPTModule, ckpt: str | None) -> float:
        (metrics,) = L.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=2, default_root_dir=tmp_path,
            strategy=MegatronSPStrategy(),
        ).validate(module, data(run["corpus"]), ckpt_path=ckpt, verbose=False)  # fmt: skip
        return float(metrics["val/loss"])

    stated = validated(_module(run["base"]), str(run["ckpt"]))
    base = validated(_module(run["base"]), None)  # B = 0: the base's loss
    assert abs(cli_loss - stated) <= 1e-5 * stated, f"validate: {cli_loss} vs stated {stated}"
    assert abs(cli_loss - base) > 1e-3, f"validate gave the base's loss {base}: no adapters"
    stated_r = r"model\.lora\.r=8 but ckpt_path=.* holds adapters with r=4"
    with pytest.raises(ConfigError, match=stated_r):
        main([*argv, "--model.lora", "{r: 8, target_modules: [all-linear]}"])


def test_adapter_checkpoint_resumes_only_onto_its_base(run: dict, tmp_path: Path) -> None:
    config = read_hf_config(run["base"], seq_length=64)
    check_checkpoint(str(run["ckpt"]), config, LORA, with_base=False)  # adapters only
    with pytest.raises(ConfigError, match=r"the checkpoint has no model\.\S+, which this model"):
        check_checkpoint(str(run["ckpt"]), config, LORA)  # the base is not in it
    model = Namespace(lora=None, adapter_from=None, init_from=str(run["other"]))
    checkpoint_adapters(model, str(run["ckpt"]))  # the config names none: the checkpoint's
    assert LoRAConfig(**vars(model.lora)) == LORA, model.lora
    with pytest.raises(ConfigError) as refused:  # before launch, in one line
        check_resume(str(run["ckpt"]), model, config)
    line = str(refused.value)
    assert "adapters were trained on the base" in line and "\n" not in line, line
    with pytest.raises(ConfigError, match=r"lora\.[AB], which this model lacks"):
        check_checkpoint(str(run["ckpt"]), config)  # a full fine-tune cannot resume it
    trainer(tmp_path, "same", "single", max_steps=6).fit(  # onto its own base: resumes
        _module(run["base"]), data(run["corpus"]), ckpt_path=str(run["ckpt"])
    )
    module = _module(run["other"])
    os.environ.pop("MASTER_PORT", None)  # the run above's port: a fresh rendezvous (EADDRINUSE)
    # raised in the spawned rank, re-raised in this process with its traceback
    with pytest.raises(Exception) as error:
        trainer(tmp_path, "resumed", "single", max_steps=6).fit(
            module, data(run["corpus"]), ckpt_path=str(run["ckpt"])
        )
    lines = [x for x in str(error.value).splitlines() if "ConfigError: " in x]
    assert lines, str(error.value)[-2000:]
    line = lines[-1].split("ConfigError: ", 1)[1]
    assert "adapters were trained on the base" in line and str(run["other"]) in line, line
