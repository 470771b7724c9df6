"""Hugging Face GPT-2 interop (lightning_sp.interop.hf, training.hf_export, cli.py export).

Nothing is downloaded: each test builds a small random ``GPT2LMHeadModel`` with transformers
(every weight perturbed, so LayerNorm and bias mappings are exercised) and saves it locally.

* Import: the saved model loaded at t = 1, 2, 4 with SP, at p = 2 and at t = 2 x p = 2 gives
  transformers' float64 logits and loss (relative error <= 1e-10), and three AdamW steps from
  it equal three steps of the one-process float64 model loaded the same way.
* Export round trip: a Trainer run (t = 2 + SP started from the imported GPT-2 with a
  tokenizer.json; p = 2 from the seeded init) trains 3 steps and checkpoints; ``cli.py export``
  writes a directory transformers loads, whose fp32 logits equal the run's own (gathered)
  logits within fp32 rounding (max |diff| <= 1e-5 · max |logit|); ``model.generate`` runs.
* Bad input: not GPT-2, a size mismatch, a missing file -> one ConfigError line each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_sp import ConfigError, GPTConfig, GPTModule, MegatronSPStrategy, OptimizerConfig
from lightning_sp.interop.hf import check_gpt2_directory, load_gpt2_weights
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.parallel.layers import column_parallel_linear
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.training.data import TextDataModule
from lightning_sp.training.hf_export import export_checkpoint
from lightning_sp.training.optim import build_adamw

from spawn import run_distributed

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
VOCAB, SEQ, HIDDEN, LAYERS, HEADS = 300, 32, 64, 2, 4
TOLERANCE = 1e-10
STEPS = 3


def hf_config(**overrides: Any) -> Any:
    fields = dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
                  activation_function="gelu", bos_token_id=0, eos_token_id=0)  # fmt: skip
    fields.update(overrides)
    return transformers.GPT2Config(**fields)


def save_random_gpt2(directory: Path, **overrides: Any) -> Any:
    """A random GPT2LMHeadModel, every parameter perturbed, saved in ``directory``; returned
    in float64 eval mode."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_config(**overrides))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    model.save_pretrained(directory)
    return model.double().eval()


def our_config(**overrides: Any) -> GPTConfig:
    fields = dict(vocab_size=VOCAB, seq_length=SEQ, hidden_size=HIDDEN, num_layers=LAYERS,
                  num_heads=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                  recompute="none")  # fmt: skip
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


def tokens(batch: int = 4, seed: int = 1, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def hf_logits_and_loss(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    with torch.no_grad():
        logits = model(ids).logits  # [b, s, v]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return logits, loss


def full_logits(chunks: list[GPT], state: ParallelState, ids: torch.Tensor) -> torch.Tensor | None:
    """``[b, s, v]`` logits of a model split over t and p (one chunk per stage), gathered
    over the vocabulary; returned on the last stage, ``None`` elsewhere."""
    chunk = chunks[0]
    if chunk.has_embedding:
        x = chunk.forward_layers(chunk.embed(ids))  # [s/t or s, b, h]
    else:
        x = torch.empty(_hidden(chunk, ids), dtype=_dtype(chunk))
        dist.recv(x, group=state.pp_group, group_src=state.pipeline_parallel_rank - 1)
        x = chunk.forward_layers(x)
    if not chunk.has_head:
        dist.send(x.contiguous(), group=state.pp_group, group_dst=state.pipeline_parallel_rank + 1)
        return None
    x = chunk.final_norm(x)
    local = column_parallel_linear(  # [s, b, v/t]
        x, chunk.word_embeddings.weight, None, state.tp_group, chunk.sequence_parallel
    )
    if state.tensor_parallel_size > 1:
        parts = [torch.empty_like(local) for _ in range(state.tensor_parallel_size)]
        dist.all_gather(parts, local.contiguous(), group=state.tp_group)
        local = torch.cat(parts, dim=-1)
    return local[..., : chunk.config.vocab_size].transpose(0, 1)  # [b, s, v]


def _hidden(chunk: GPT, ids: torch.Tensor) -> tuple[int, int, int]:
    t = chunk.state.tensor_parallel_size
    s = ids.shape[1] // t if chunk.sequence_parallel else ids.shape[1]
    return (s, ids.shape[0], chunk.config.hidden_size)


def _dtype(chunk: GPT) -> torch.dtype:
    return next(chunk.parameters()).dtype


def _unpadded_elements(chunks: list[GPT]) -> int:
    """Elements of these shards' parameters, less the vocabulary padding rows: what the import
    must read from the file (and no more)."""
    total = 0
    for chunk in chunks:
        total += sum(p.numel() for p in chunk.parameters())
        if hasattr(chunk, "word_embeddings"):
            embedding = chunk.word_embeddings
            start, stop = embedding.vocab_start, embedding.vocab_end
            padding = stop - max(start, min(stop, chunk.config.vocab_size))
            total -= padding * chunk.config.hidden_size
    return total


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# -- import ---------------------------------------------------------------------------------------


def _train(model: torch.nn.Module, step: Any, ids: torch.Tensor, labels: torch.Tensor) -> list:
    optimizer = build_adamw(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses.append(step(ids, labels).item())
        optimizer.step()
    return losses


def _import_worker(rank: int, world_size: int, directory: str, reference: str, cases: list) -> None:
    ref = torch.load(reference)
    ids, labels = ref["ids"], ref["labels"]
    single = GPT(our_config(), ParallelState.single(), dtype=torch.float64)
    load_gpt2_weights(single, directory)

    def single_step(i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = single(i, y)
        loss.backward()
        return loss.detach()

    ref_losses = _train(single, single_step, ids, labels)
    for t, p in cases:
        what = f"t={t} p={p}"
        state = ParallelState.single() if t * p == 1 else ParallelState.from_process_group(t, p)
        config = our_config(sequence_parallel=t > 1)
        if p == 1:
            model: torch.nn.Module = GPT(config, state, dtype=torch.float64)
            chunks = [model]
        else:
            model = Pipeline(config, state, num_microbatches=2, dtype=torch.float64)
            chunks = list(model.chunks)
        read = sum(load_gpt2_weights(chunk, directory) for chunk in chunks)
        assert read == _unpadded_elements(chunks), f"{what}: read {read} elements, not its slices"
        with torch.no_grad():
            loss = model(ids, labels) if p == 1 else model.eval_step(ids, labels)
            logits = full_logits(chunks, state, ids)
        assert relative(loss, ref["loss"]) <= TOLERANCE, f"{what}: loss {loss} vs {ref['loss']}"
        if logits is not None:
            err = relative(logits, ref["logits"])
            assert err <= TOLERANCE, f"{what}: logits relative error {err:.2e}"

        def step(i: torch.Tensor, y: torch.Tensor, model: Any = model, state: Any = state) -> Any:
            if isinstance(model, Pipeline):
                loss = model.train_step(i, y)
                model.finalize_grads()
                return loss
            loss = model(i, y)
            loss.backward()
            finalize_grads(model, state)
            return loss.detach()

        losses = _train(model, step, ids, labels)
        errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
        if logits is not None and state.tensor_parallel_rank == 0:
            print(f"{what}: loss {relative(loss, ref['loss']):.1e}, logits {err:.1e}, "
                  f"training losses {max(errors):.1e} (relative errors)")  # fmt: skip
        assert max(errors) <= TOLERANCE, f"{what}: training diverged {losses} vs {ref_losses}"
        assert losses[-1] < losses[0], f"{what}: loss did not fall {losses}"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A saved random GPT-2 and the float64 reference logits and loss on a fixed batch."""
    directory = tmp_path_factory.mktemp("gpt2")
    model = save_random_gpt2(directory)
    ids, labels = tokens()
    logits, loss = hf_logits_and_loss(model, ids, labels)
    reference = directory.parent / "reference.pt"
    torch.save({"ids": ids, "labels": labels, "logits": logits, "loss": loss}, reference)
    return directory, reference


def test_import_one_process_equals_transformers(gpt2: tuple[Path, Path]) -> None:
    _import_worker(0, 1, str(gpt2[0]), str(gpt2[1]), [(1, 1)])


def test_import_gelu_new_gpt2(tmp_path: Path) -> None:
    """OpenAI's GPT-2 uses the tanh GeLU (``gelu_new``): activation=gelu_tanh computes it."""
    model = save_random_gpt2(tmp_path, activation_function="gelu_new")
    with pytest.raises(ConfigError, match="activation='gelu' does not match"):
        check_gpt2_directory(tmp_path, our_config())
    ours = GPT(our_config(activation="gelu_tanh"), ParallelState.single(), dtype=torch.float64)
    load_gpt2_weights(ours, tmp_path)
    ids, labels = tokens()
    logits, loss = hf_logits_and_loss(model, ids, labels)
    with torch.no_grad():
        assert relative(ours(ids, labels), loss) <= TOLERANCE
        err = relative(full_logits([ours], ours.state, ids), logits)
    assert err <= TOLERANCE


@pytest.mark.parametrize(
    ("world_size", "cases"), [(2, [(2, 1), (1, 2)]), (4, [(4, 1), (2, 2)])], ids=["ws2", "ws4"]
)
def test_import_any_layout_equals_transformers(
    gpt2: tuple[Path, Path], world_size: int, cases: list
) -> None:
    run_distributed(_import_worker, world_size, str(gpt2[0]), str(gpt2[1]), cases)


# -- export round trip ----------------------------------------------------------------------------


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


def _fit(tmp_path: Path, module: GPTModule, data: TextDataModule, strategy: dict) -> Path:
    """Train 3 steps under ``megatron_sp`` on 2 spawned ranks; the run's logits on a fixed
    batch go to ``logits.pt``; returns the checkpoint."""
    ids, _ = tokens(batch=2, vocab=module.config.vocab_size)
    L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MegatronSPStrategy(**strategy, start_method="spawn"),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[
            ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="final", every_n_train_steps=STEPS),
            SaveLogits(tmp_path / "logits.pt", ids),
        ],
    ).fit(module, data)
    return tmp_path / "ckpt" / "final.ckpt"


def _check_exported(directory: Path, run_logits: Path, vocab: int) -> Any:
    """The exported directory loads in transformers and gives the run's logits; returns it."""
    model = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
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


def test_export_round_trip_tp2_sp_from_gpt2_with_tokenizer(
    tmp_path: Path, corpus: Path, gpt2: tuple[Path, Path]
) -> None:
    """t=2 + SP, started from the imported GPT-2, a tokenizer.json; exported by the CLI."""
    tokenizer = _train_tokenizer(corpus, tmp_path / "tokenizer.json")
    module = GPTModule(our_config(hidden_dropout=0.1, attention_dropout=0.1),
                       OptimizerConfig(lr=1e-3, warmup_steps=1),
                       init_from=str(gpt2[0]))  # fmt: skip
    data = TextDataModule(paths=str(corpus), tokenizer=str(tokenizer), seq_length=SEQ,
                          batch_size=4, val_fraction=0.1)  # fmt: skip
    ckpt = _fit(tmp_path, module, data, {"tensor_parallel_size": 2, "sequence_parallel": True})
    out = tmp_path / "hf"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "export", "--ckpt_path", str(ckpt),
         "--output", str(out)],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    model = _check_exported(out, tmp_path / "logits.pt", VOCAB)
    trained = model.transformer.h[0].attn.c_attn.weight
    start = (
        transformers.GPT2LMHeadModel.from_pretrained(gpt2[0]).transformer.h[0].attn.c_attn.weight
    )
    assert not torch.equal(trained, start), "the export holds the untrained weights"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    assert hf_tokenizer.eos_token == "<|endoftext|>" and hf_tokenizer.eos_token_id == eos
    assert hf_tokenizer("def add")["input_ids"] == data_tokenizer_ids(tokenizer, "def add")


def data_tokenizer_ids(path: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).encode(text).ids


def test_export_round_trip_pp2(tmp_path: Path, corpus: Path) -> None:
    """p=2 (1F1B, two micro-batches), seeded init, byte-level data (no tokenizer files)."""
    module = GPTModule(our_config(vocab_size=257, hidden_dropout=0.1, attention_dropout=0.1),
                       OptimizerConfig(lr=1e-3, warmup_steps=1))  # fmt: skip
    data = TextDataModule(paths=str(corpus), seq_length=SEQ, batch_size=4, val_fraction=0.1)
    ckpt = _fit(tmp_path, module, data, {"pipeline_parallel_size": 2, "num_microbatches": 2})
    out = export_checkpoint(ckpt, tmp_path / "hf")
    _check_exported(out, tmp_path / "logits.pt", 257)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256


# -- bad input ------------------------------------------------------------------------------------


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_bad_directories_fail_with_one_line(tmp_path: Path, gpt2: tuple[Path, Path]) -> None:
    not_gpt2 = tmp_path / "bert"
    not_gpt2.mkdir()
    (not_gpt2 / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError) as error:
        GPTModule(our_config(), init_from=str(not_gpt2))
    assert "is not a GPT-2 model: config.json has model_type='bert'" in _one_line(error)

    with pytest.raises(ConfigError) as error:  # size mismatch names our field
        GPTModule(our_config(hidden_size=32), init_from=str(gpt2[0]))
    assert "hidden_size=32 does not match n_embd=64" in _one_line(error)
    with pytest.raises(ConfigError) as error:
        GPTModule(our_config(seq_length=128), init_from=str(gpt2[0]))
    assert "seq_length=128 exceeds n_positions=64" in _one_line(error)

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((gpt2[0] / "config.json").read_text())
    with pytest.raises(ConfigError) as error:  # no weights file
        GPTModule(our_config(), init_from=str(missing))
    assert "has no model.safetensors" in _one_line(error)
    with pytest.raises(ConfigError) as error:
        GPTModule(our_config(), init_from=str(tmp_path / "nowhere"))
    assert "is not a directory" in _one_line(error)
    (missing / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConfigError) as error:
        GPTModule(our_config(), init_from=str(missing))
    assert "model.safetensors is not a readable safetensors file" in _one_line(error)

    # weights that do not belong to the config.json: one layer fewer, a different width
    save_random_gpt2(tmp_path / "one_layer", n_layer=1)
    (tmp_path / "one_layer" / "config.json").write_text((gpt2[0] / "config.json").read_text())
    with pytest.raises(ConfigError) as error:
        GPTModule(our_config(), init_from=str(tmp_path / "one_layer"))
    assert "the weights have no tensor 'h.1.ln_1.weight'" in _one_line(error)
    save_random_gpt2(tmp_path / "wide", n_inner=128)
    (tmp_path / "wide" / "config.json").write_text((gpt2[0] / "config.json").read_text())
    with pytest.raises(ConfigError) as error:
        GPTModule(our_config(), init_from=str(tmp_path / "wide"))
    assert "has shape [64, 128] but config.json needs [64, 256]" in _one_line(error)


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


def test_finetune_config_matches_gpt2_small() -> None:
    """configs/gpt2_finetune.yaml fits OpenAI's GPT-2 (transformers' GPT2Config defaults are
    GPT-2 small), and the CLI parses it."""
    import yaml

    from lightning_sp.interop.hf_config import check_gpt2_config

    raw = yaml.safe_load((ROOT / "configs" / "gpt2_finetune.yaml").read_text())
    assert raw["model"]["init_from"] == "gpt2"
    check_gpt2_config(
        transformers.GPT2Config().to_dict(), GPTConfig(**raw["model"]["config"]), "gpt2"
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "fit", "--config",
         str(ROOT / "configs" / "gpt2_finetune.yaml"), "--print_config"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "init_from: gpt2" in result.stdout
