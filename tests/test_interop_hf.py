"""Hugging Face GPT-2 import (lightning_sp.interop.hf, interop.hf_config).

Nothing is downloaded: each test builds a small random ``GPT2LMHeadModel`` with transformers
(every weight perturbed, so LayerNorm and bias mappings are exercised) and saves it locally
(``tests/hf_models.py``).

* Import: the saved model loaded at t = 1, 2, 4 with SP, at p = 2 and at t = 2 x p = 2 gives
  transformers' float64 logits and loss (relative error <= 1e-10), and three AdamW steps from
  it equal three steps of the one-process float64 model loaded the same way; each rank reads
  only its own slices.
* Bad input: not GPT-2, a size mismatch, a missing or unreadable file -> one ConfigError line
  each; the fine-tuning config fits GPT-2 small.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import (
    ROOT,
    STEPS,
    TOLERANCE,
    full_logits,
    hf_logits_and_loss,
    our_config,
    relative,
    save_gpt2_with_reference,
    save_random_gpt2,
    tokens,
    transformers,
)

from lightning_sp import ConfigError, GPTConfig, GPTModule
from lightning_sp.interop.hf import check_gpt2_directory, load_gpt2_weights
from lightning_sp.model.gpt import GPT
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.testing.spawn import run_distributed
from lightning_sp.training.optim import build_adamw


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


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A saved random GPT-2 and the float64 reference logits and loss on a fixed batch."""
    return save_gpt2_with_reference(tmp_path_factory.mktemp("gpt2"))


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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "cases"), [(2, [(2, 1), (1, 2)]), (4, [(4, 1), (2, 2)])], ids=["ws2", "ws4"]
)
def test_import_any_layout_equals_transformers(
    gpt2: tuple[Path, Path], world_size: int, cases: list
) -> None:
    run_distributed(_import_worker, world_size, str(gpt2[0]), str(gpt2[1]), cases)


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


@pytest.mark.slow
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
