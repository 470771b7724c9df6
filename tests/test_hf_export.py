"""Hugging Face export (lightning_sp.interop.hf_export.save_hf, lightning_sp.cli.export,
``cli.py export``), GPT-2 and Llama.

* Round trip: a random GPT-2 and a random Llama (GQA, untied; tied with Llama 3.1 RoPE
  scaling; with linear RoPE scaling) imported into our model and exported again load in
  transformers as their class with every tensor equal to the original's and the same config;
  the export reads back into ours exactly.
* A Trainer run (t = 2 + SP started from an imported random GPT-2 or Llama with a
  tokenizer.json; p = 2 from the seeded init) trains 3 steps and checkpoints; ``cli.py
  export`` writes a directory ``AutoModelForCausalLM`` loads, whose fp32 logits equal the
  run's own (gathered) logits within fp32 rounding (max |diff| <= 1e-5 · max |logit|), and
  ``model.generate`` runs. A bad checkpoint fails with one line. The p = 2 checkpoint also
  generates in one process: greedy tokens equal transformers' greedy tokens from the exported
  model.
* Token ids and dtype: a bf16 checkpoint of a run with a ``tokenizer.json`` exports its
  end-of-document id as ``eos_token_id`` and ``bos_token_id``, that token as the tokenizer's
  ``eos_token`` and ``bos_token``, and ``dtype: bfloat16`` (transformers loads it as bf16);
  another tokenizer than the run's is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_sp import ConfigError, GPTModule, MegatronSPStrategy, OptimizerConfig, ParallelState
from lightning_sp.cli.export import export_checkpoint
from lightning_sp.data import TextDataModule
from lightning_sp.interop.hf import load_hf_weights, read_hf_config
from lightning_sp.interop.hf_export import save_hf
from lightning_sp.model.generate import GenerationConfig
from lightning_sp.model.gpt import GPT

from cli_runs import ROOT
from hf_models import (
    SEQ,
    STEPS,
    VOCAB,
    full_logits,
    hf_logits_and_loss,
    llama_config,
    our_config,
    save_gpt2_with_reference,
    save_llama_with_reference,
    save_random_gpt2,
    save_random_llama,
    tokens,
    transformers,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A saved random GPT-2 and Llama, by name."""
    return {
        "gpt2": save_gpt2_with_reference(tmp_path_factory.mktemp("gpt2"))[0],
        "llama": save_llama_with_reference(tmp_path_factory.mktemp("llama"))[0],
    }


CONFIGS = {
    "gpt2": lambda: our_config(hidden_dropout=0.1, attention_dropout=0.1),
    "llama": llama_config,
}
"""Our config of each saved model, as trained."""
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
               "high_freq_factor": 32.0, "original_max_position_embeddings": 512}  # fmt: skip
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("gpt2", {}), ("llama", {}),
     ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE}),
     ("llama", {"rope_parameters": LINEAR_ROPE})],
    ids=["gpt2", "llama_untied", "llama_tied_llama3_rope", "llama_linear_rope"],
)  # fmt: skip
def test_round_trip_gives_back_every_tensor(tmp_path: Path, name: str, overrides: dict) -> None:
    """transformers -> ours (t = 1) -> save_hf -> transformers: the same class, every tensor
    equal, the same config; and the export reads back into ours exactly."""
    save = {"gpt2": save_random_gpt2, "llama": save_random_llama}[name]
    original = save(tmp_path / "original", **overrides).float()
    config = read_hf_config(tmp_path / "original")
    ours = GPT(config, ParallelState.single())
    load_hf_weights(ours, tmp_path / "original")
    named = [(ours.global_name(n), p) for n, p in ours.named_parameters()]
    out = save_hf(config, named, tmp_path / "exported", eos_token_id=0)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(exported).__name__ == HF_CLASSES[name]
    theirs, mine = original.state_dict(), exported.state_dict()
    assert sorted(theirs) == sorted(mine)
    unequal = [k for k in theirs if not torch.equal(theirs[k], mine[k])]
    assert not unequal, f"{len(unequal)} tensors changed, e.g. {unequal[0]}"
    if name == "llama":
        assert config.tie_embeddings == overrides.get("tie_word_embeddings", False)
        written = json.loads((out / "config.json").read_text())
        groups = original.config.num_key_value_heads
        for key, value in {"hidden_act": "silu", "num_key_value_heads": groups,
                           "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
                           "head_dim": 8}.items():  # fmt: skip
            assert written[key] == value, (key, written[key], value)
        for key in ("rope_parameters", "tie_word_embeddings", "num_attention_heads",
                    "intermediate_size", "vocab_size", "max_position_embeddings"):  # fmt: skip
            assert getattr(exported.config, key) == getattr(original.config, key), key
    again = GPT(config, ParallelState.single())
    load_hf_weights(again, out)
    for (param, a), b in zip(named, again.parameters(), strict=True):
        assert torch.equal(a, b), param
    ids, _ = tokens(batch=2)
    with torch.no_grad():
        assert torch.equal(original(ids).logits, exported(ids).logits)


class SaveLogits(Callback):
    """At the end of training, the run's own logits on ``ids`` (eval mode), saved by the
    rank that holds them (last stage, first TP rank)."""

    def __init__(self, path: Path, ids: torch.Tensor) -> None:
        self.path, self.ids = path, ids

    def on_train_end(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        state = trainer.strategy.parallel_state
        pl_module.eval()
        with torch.no_grad():
            logits = full_logits(pl_module.chunks, state, self.ids)
        if logits is not None and state.tensor_parallel_rank == 0:
            torch.save(logits, self.path)


def _train_tokenizer(corpus: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    files = [str(p) for p in corpus.iterdir()]
    tok.train(files, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "<|endoftext|>"]))
    tok.save(str(out))
    return out


class SaveHeldOutLoss(Callback):
    """At the end of training, the run's own loss (eval mode) on the first validation batch,
    which training never read; saved with the batch by global rank 0 (``p = 1``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        batch = next(iter(trainer.datamodule.val_dataloader()))  # type: ignore[attr-defined]
        pl_module.eval()
        with torch.no_grad():
            loss = pl_module.chunks[0](batch["input_ids"], batch["labels"])
        if trainer.is_global_zero:
            torch.save({**batch, "loss": loss}, self.path)


def _fit(
    tmp_path: Path,
    module: GPTModule,
    data: TextDataModule,
    strategy: dict,
    steps: int = STEPS,
    callbacks: tuple[Callback, ...] = (),
) -> Path:
    """Train ``steps`` under ``megatron_sp`` on 2 spawned ranks; the run's logits on a fixed
    batch go to ``logits.pt``; returns the checkpoint."""
    ids, _ = tokens(batch=2, vocab=module.config.vocab_size)
    L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MegatronSPStrategy(**strategy, start_method="spawn"),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[
            ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="final", every_n_train_steps=steps),
            SaveLogits(tmp_path / "logits.pt", ids),
            *callbacks,
        ],
    ).fit(module, data)
    return tmp_path / "ckpt" / "final.ckpt"


def fit_and_export(
    tmp_path: Path, corpus: Path, module: GPTModule, strategy: dict
) -> tuple[Path, Path, dict[str, Any]]:
    """Train ``module`` 10 steps on ``corpus`` under ``strategy`` (:func:`_fit`) and export
    it: the checkpoint, the Hugging Face directory, and the run's held-out batch with its own
    loss."""
    data = TextDataModule(paths=str(corpus), seq_length=SEQ, batch_size=4, val_fraction=0.1)
    held_out = tmp_path / "held_out.pt"
    ckpt = _fit(tmp_path, module, data, strategy, steps=10,
                callbacks=(SaveHeldOutLoss(held_out),))  # fmt: skip
    return ckpt, export_checkpoint(ckpt, tmp_path / "hf"), torch.load(held_out)


def assert_held_out_loss(model: Any, saved: dict[str, Any]) -> None:
    """The run trained (below ln 257) and ``model`` (transformers, float64) gives its own
    held-out loss to :data:`LOSS_RTOL`."""
    _, hf_loss = hf_logits_and_loss(model, saved["input_ids"], saved["labels"])
    error = abs(hf_loss.item() - saved["loss"].item()) / hf_loss.item()
    print(f"held-out loss: run {saved['loss'].item():.8f}, transformers {hf_loss.item():.8f}, "
          f"relative {error:.1e}")  # fmt: skip
    assert saved["loss"].item() < 5.0, "10 steps did not train (ln 257 = 5.55)"
    assert error <= LOSS_RTOL, f"held-out loss {saved['loss']} vs transformers' {hf_loss}"


def _check_exported(directory: Path, run_logits: Path, vocab: int, hf_class: str) -> Any:
    """The exported directory loads in transformers as ``hf_class`` and gives the run's
    logits; returns it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(model).__name__ == hf_class
    ids, _ = tokens(batch=2, vocab=vocab)
    expected = torch.load(run_logits)
    with torch.no_grad():
        logits = model(ids).logits
    error = (logits - expected).abs().max() / expected.abs().max()
    assert error <= 1e-5, f"exported logits differ from the run's by {error:.2e} (relative max)"
    print(f"{directory.name}: exported logits, max |diff| / max |logit| = {error:.2e}")
    generated = model.generate(ids[:, :8], max_new_tokens=8, do_sample=False)
    assert generated.shape == (2, 16) and torch.equal(generated[:, :8], ids[:, :8])
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_export_round_trip_tp2_sp_with_tokenizer(
    tmp_path: Path, corpus: Path, saved: dict[str, Path], name: str
) -> None:
    """t=2 + SP, started from the imported model, a tokenizer.json; exported by the CLI."""
    tokenizer = _train_tokenizer(corpus, tmp_path / "tokenizer.json")
    config = dataclasses.replace(CONFIGS[name](), sequence_parallel=True)
    module = GPTModule(config, OptimizerConfig(lr=1e-3, warmup_steps=1),
                       init_from=str(saved[name]))  # fmt: skip
    data = TextDataModule(paths=str(corpus), tokenizer=str(tokenizer), seq_length=SEQ,
                          batch_size=4, val_fraction=0.1)  # fmt: skip
    ckpt = _fit(tmp_path, module, data, {"tensor_parallel_size": 2})
    out = tmp_path / "hf"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "export", "--ckpt_path", str(ckpt),
         "--output", str(out)],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    model = _check_exported(out, tmp_path / "logits.pt", VOCAB, HF_CLASSES[name])
    start = transformers.AutoModelForCausalLM.from_pretrained(saved[name]).state_dict()
    trained = model.state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start), "the untrained weights"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    assert hf_tokenizer.eos_token == "<|endoftext|>" and hf_tokenizer.eos_token_id == eos
    assert hf_tokenizer("def add")["input_ids"] == data_tokenizer_ids(tokenizer, "def add")


def data_tokenizer_ids(path: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).encode(text).ids


def _predict(module: GPTModule, data: TextDataModule, ckpt: Path) -> list[int]:
    """The token ids ``Trainer.predict`` generates (one process) for ``data``'s one prompt."""
    predicted = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MegatronSPStrategy(),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).predict(module, data, ckpt_path=str(ckpt))
    assert predicted is not None and len(predicted) == 1
    return predicted[0]["token_ids"]  # type: ignore[index]


@pytest.mark.slow
def test_export_round_trip_pp2(tmp_path: Path, corpus: Path) -> None:
    """p=2 (1F1B, two micro-batches), seeded init, byte-level data (no tokenizer files)."""
    module = GPTModule(our_config(vocab_size=257, hidden_dropout=0.1, attention_dropout=0.1,
                                  sequence_parallel=True),
                       OptimizerConfig(lr=1e-3, warmup_steps=1))  # fmt: skip
    data = TextDataModule(paths=str(corpus), seq_length=SEQ, batch_size=4, val_fraction=0.1)
    ckpt = _fit(tmp_path, module, data, {"pipeline_parallel_size": 2, "num_microbatches": 2})
    out = export_checkpoint(ckpt, tmp_path / "hf")
    model = _check_exported(out, tmp_path / "logits.pt", 257, "GPT2LMHeadModel")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256

    # the p=2 checkpoint generates in one process (resharded on load): greedy decoding gives
    # transformers' greedy tokens from the exported model
    prompt = "def add"
    greedy = GenerationConfig(max_new_tokens=8, temperature=0.0)
    generator = GPTModule(our_config(vocab_size=257), generation=greedy)
    prompts = TextDataModule(paths=str(corpus), seq_length=SEQ, prompts=[prompt])
    ours = _predict(generator, prompts, ckpt)
    ids = torch.tensor([list(prompt.encode())])
    theirs = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert ours and ours == theirs[: len(ours)], f"generated {ours}, transformers {theirs}"


LOSS_RTOL = 1e-6
"""The run's loss is fp32 at t = 2 + SP; transformers' is float64 from the same fp32 weights:
they differ by fp32 rounding of the forward (measured 3e-8 relative)."""


@pytest.mark.slow
def test_trained_llama_exported_gives_its_own_loss_and_greedy_tokens(
    tmp_path: Path, corpus: Path
) -> None:
    """llama_tiny's recipe in small: seeded init, t = 2 + SP, byte-level data; exported by
    ``export_checkpoint``; loss on a held-out batch and greedy generation agree."""
    config = llama_config(vocab_size=257, sequence_parallel=True)
    module = GPTModule(config, OptimizerConfig(lr=1e-2, warmup_steps=1))
    ckpt, out, saved = fit_and_export(tmp_path, corpus, module, {"tensor_parallel_size": 2})
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float64).eval()
    assert_held_out_loss(model, saved)

    # greedy (12 spaces after 10 steps: the corpus is mostly indentation) against
    # transformers; sampled with a seed, cached against the full forward every token
    prompt, n = "def add", 12
    prompts = TextDataModule(paths=str(corpus), seq_length=SEQ, prompts=[prompt])
    runs = {
        name: GenerationConfig(max_new_tokens=n, temperature=temperature, top_k=None, seed=3,
                               use_cache=cache)
        for name, temperature, cache in [("greedy", 0.0, True), ("sampled", 1.0, True),
                                         ("sampled_full", 1.0, False)]
    }  # fmt: skip
    ours = {
        name: _predict(GPTModule(llama_config(vocab_size=257), generation=g), prompts, ckpt)
        for name, g in runs.items()
    }
    ids = torch.tensor([list(prompt.encode())])
    theirs = model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1] :].tolist()
    for name, got in [*ours.items(), ("transformers", theirs)]:
        print(f"{name} after {prompt!r}: {got} {bytes(t for t in got if t < 256)!r}")
    assert ours["greedy"] and ours["greedy"] == theirs[: len(ours["greedy"])], (ours, theirs)
    assert len(set(ours["sampled"])) > 3, f"sampling drew few tokens: {ours['sampled']}"
    assert ours["sampled"] == ours["sampled_full"], ours


@pytest.mark.slow
def test_export_bad_checkpoint_fails_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "export", "--ckpt_path", str(tmp_path / "nope"),
         "--output", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: ckpt_path={str(tmp_path / 'nope')!r} does not exist"
    ]


def _one_process_ckpt(path: Path) -> Path:
    """A one-process Lightning ``.ckpt`` of a seeded byte-level GPT (what export reads)."""
    config = our_config(vocab_size=257)
    model = GPT(config, ParallelState.single(torch.device("cpu")))
    weights = {f"gpt.{name}": p.detach() for name, p in model.named_parameters()}
    torch.save({"hyper_parameters": {"config": dataclasses.asdict(config)},
                "state_dict": weights, "vocabulary": {"tokenizer": "bytes"}}, path)  # fmt: skip
    return path


def test_export_refuses_a_used_directory_and_overwrites_only_model_files(tmp_path: Path) -> None:
    ckpt = _one_process_ckpt(tmp_path / "model.ckpt")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "tokenizer.json").write_text("{}")  # a previous model's 1000-token tokenizer
    (out / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as refused:
        export_checkpoint(ckpt, out)
    message = str(refused.value)
    assert "\n" not in message and repr(str(out)) in message and "--overwrite true" in message
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt", "tokenizer.json"]
    assert (out / "config.json").read_text() == "{}"

    lines: list[str] = []
    old = os.umask(0o027)
    try:
        export_checkpoint(ckpt, out, overwrite=True, log=lines.append)
    finally:
        os.umask(old)
    assert len(lines) == 1 and str(out) in lines[0], lines
    assert "config.json, tokenizer.json" in lines[0] and "notes.txt" not in lines[0], lines
    # the byte-level model writes no tokenizer: the stale one is gone, the user's file stays
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "notes.txt",
    ]
    assert (out / "notes.txt").read_text() == "mine"
    for name in ("config.json", "model.safetensors"):
        mode = (out / name).stat().st_mode & 0o777
        assert mode == 0o640, f"{name}: mode {oct(mode)} under umask 0o027"
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 257
    with pytest.raises(ConfigError, match="is a file"):
        export_checkpoint(ckpt, out / "notes.txt", overwrite=True)


def _word_tokenizer(path: Path, vocab: dict[str, int]) -> tuple[Path, str]:
    """A word-level ``tokenizer.json`` of ``vocab`` at ``path`` and the digest a run records."""
    import hashlib

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path, f"tokenizers:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"


def _tokenizer_ckpt(tmp_path: Path, record_path: bool = True) -> Path:
    """A one-process bf16 ``.ckpt`` of a run with a word-level ``tokenizer.json`` (in
    ``tmp_path``) whose ``<|endoftext|>`` is id 3; ``record_path``: the checkpoint records
    where the tokenizer is (else only its digest)."""
    vocab = {"[UNK]": 0, "def": 1, "add": 2, "<|endoftext|>": 3, "x": 4}
    path, digest = _word_tokenizer(tmp_path / "tokenizer.json", vocab)
    config = our_config(vocab_size=len(vocab))
    model = GPT(config, ParallelState.single(torch.device("cpu")), dtype=torch.bfloat16)
    weights = {f"gpt.{name}": p.detach() for name, p in model.named_parameters()}
    vocabulary = {"tokenizer": digest, **({"tokenizer_path": str(path)} if record_path else {})}
    torch.save({"hyper_parameters": {"config": dataclasses.asdict(config)},
                "state_dict": weights, "vocabulary": vocabulary},
               tmp_path / "model.ckpt")  # fmt: skip
    return tmp_path / "model.ckpt"


def test_export_writes_the_runs_token_ids_tokenizer_and_dtype(tmp_path: Path) -> None:
    """A one-process bf16 checkpoint of a run with a ``tokenizer.json`` (its end-of-document
    token ``<|endoftext|>`` at id 3, not the byte-level 256): the export's ``config.json``
    names that id as ``eos_token_id`` and ``bos_token_id`` (the end-of-document token also
    begins documents), its ``tokenizer_config.json`` that token as ``eos_token`` and
    ``bos_token``, and its ``dtype`` the tensors' bfloat16, which transformers loads as is."""
    out = export_checkpoint(_tokenizer_ckpt(tmp_path), tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    for key in ("eos_token_id", "bos_token_id"):
        assert written[key] == 3, f"config.json {key}={written[key]!r}, not <|endoftext|>'s id 3"
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    for key in ("eos_token", "bos_token"):
        assert tokenizer[key] == "<|endoftext|>", f"tokenizer_config.json {key}={tokenizer[key]!r}"
    assert written["dtype"] == "bfloat16", f"config.json dtype={written['dtype']!r} of bf16 tensors"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.bos_token_id == loaded.config.eos_token_id == 3
    dtypes = {p.dtype for p in loaded.parameters()}
    assert dtypes == {torch.bfloat16}, f"the bf16 export loads as {dtypes}"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.bos_token_id == hf_tokenizer.eos_token_id == 3


def test_export_refuses_another_tokenizer_with_one_line(tmp_path: Path) -> None:
    """``--tokenizer`` of another vocabulary than the run's (its digest differs from the one
    the checkpoint records), or none for a checkpoint that records no path: one line each,
    before anything is written."""
    ckpt = _tokenizer_ckpt(tmp_path)
    other, _ = _word_tokenizer(tmp_path / "other.json", {"[UNK]": 0, "<|endoftext|>": 1})
    try:
        export_checkpoint(ckpt, tmp_path / "hf", tokenizer=str(other))
    except ConfigError as error:
        message = str(error)
    else:
        raise AssertionError("export took another tokenizer.json than the run's")
    assert "\n" not in message and message.startswith(
        f"tokenizer={str(other)!r} is not the tokenizer 'tokenizers:"
    ), message
    assert not (tmp_path / "hf").exists(), "the refused export wrote files"
    unrecorded = tmp_path / "unrecorded"
    unrecorded.mkdir()
    with pytest.raises(ConfigError, match="does not record its path; give it with --tokenizer"):
        export_checkpoint(_tokenizer_ckpt(unrecorded, record_path=False), tmp_path / "hf")
