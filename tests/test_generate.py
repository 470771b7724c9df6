"""Generation: the key/value-cached decoding equals a full forward every step (t = 1, and t = 2
with sequence parallelism on real gloo ranks; GPT-2 and Llama, whose cache holds keys rotated
at their true positions), seeds, EOS, one-line errors, ``predict`` through a Trainer and
``cli.py generate`` from a checkpoint. (A trained Llama's ``predict`` through a Trainer, cached
and not, against transformers' greedy tokens: ``test_hf_export.py``.)"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sp import GPT, ConfigError, GPTConfig, GPTModule, MegatronSPStrategy, ParallelState
from lightning_sp.callbacks.predictions import TextPredictionWriter
from lightning_sp.cli.generate import at_context_length, context_notice
from lightning_sp.data import TextDataModule
from lightning_sp.model.generate import (
    GenerationConfig,
    KVCache,
    forward_cached,
    forward_full,
    generate,
    sample,
    sequence_parallel_off,
)
from lightning_sp.testing.spawn import run_distributed

from cli_runs import ROOT, error_lines, run_many
from models import relative_error, tiny_config

PROMPT = [5, 17, 99, 3, 250]
GREEDY = GenerationConfig(max_new_tokens=20, temperature=0.0)


ARCHITECTURES = ("gpt2", "llama")


def _model(state: ParallelState, sequence_parallel: bool, architecture: str = "gpt2") -> GPT:
    # a large init spread: an untrained model whose greedy choices vary from token to token
    config = tiny_config(
        architecture, seq_length=32, init_std=0.5, sequence_parallel=sequence_parallel
    )
    return GPT(config, state, dtype=torch.float64)


def _check_cache_equals_full_forward(model: GPT) -> list[int]:
    """Logits of the prompt and of a few single-token steps, cached vs full forward, then
    greedy generation both ways; returns the greedy tokens."""
    view = sequence_parallel_off(model)
    cache = KVCache.for_model(view, batch=1)
    ids = torch.tensor([PROMPT])
    for step in range(4):
        cached = forward_cached(view, ids[:, cache.length :], cache)
        full = forward_full(model, ids)
        assert relative_error(cached, full) <= 1e-10, f"step {step}"
        ids = torch.cat([ids, cached.argmax(-1, keepdim=True)], dim=1)
    with_cache = generate(model, PROMPT, GREEDY)
    without = generate(model, PROMPT, GenerationConfig(max_new_tokens=20, temperature=0.0,
                                                       use_cache=False))  # fmt: skip
    assert with_cache == without
    assert len(with_cache) == 20 and len(set(with_cache)) > 3, with_cache  # not one token
    return with_cache


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_cache_equals_full_forward_one_process(architecture: str) -> None:
    _check_cache_equals_full_forward(_model(ParallelState.single(), False, architecture))


def _tp_worker(rank: int, world_size: int) -> None:
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    for architecture in ARCHITECTURES:  # Llama: 2 key/value groups, one per rank
        model = _model(state, True, architecture)
        tokens = _check_cache_equals_full_forward(model)
        reference = generate(_model(ParallelState.single(), False, architecture), PROMPT, GREEDY)
        assert tokens == reference, f"{architecture}: t=2 with SP generates other tokens"
        sampled = generate(model, PROMPT, GenerationConfig(max_new_tokens=12, seed=5))
        both = [torch.zeros(12, dtype=torch.long) for _ in range(world_size)]
        dist.all_gather(both, torch.tensor(sampled))
        assert all(torch.equal(b, both[0]) for b in both), f"{architecture}: ranks sampled apart"


@pytest.mark.slow
def test_cache_equals_full_forward_tp2_with_sequence_parallelism() -> None:
    run_distributed(_tp_worker, 2)


def test_same_seed_same_text_and_eos_stops() -> None:
    model = _model(ParallelState.single(), sequence_parallel=False)
    config = GenerationConfig(max_new_tokens=16, temperature=1.0, top_k=20, seed=3)
    first = generate(model, PROMPT, config)
    assert generate(model, PROMPT, config) == first
    assert generate(model, PROMPT, GenerationConfig(max_new_tokens=16, temperature=1.0,
                                                    top_k=20, seed=4)) != first  # fmt: skip
    greedy = generate(model, PROMPT, GREEDY)
    stop = next(i for i, token in enumerate(greedy) if i > 0 and token not in greedy[:i])
    assert generate(model, PROMPT, GREEDY, eos_id=greedy[stop]) == greedy[:stop]
    # the model reads at most seq_length = 32 positions: the last token read is the 32nd and
    # the token it predicts the 33rd, so 33 - 5 prompt tokens
    assert len(generate(model, PROMPT, GenerationConfig(max_new_tokens=100, temperature=0))) == 28


def test_generate_says_when_it_stopped_at_the_context_length() -> None:
    """``cli.py generate``'s notice (cli/generate.py) is printed exactly when
    generation stopped at seq_length, not at max_new_tokens or an end-of-document token."""
    model = _model(ParallelState.single(), sequence_parallel=False)
    config = model.config
    many = GenerationConfig(max_new_tokens=100, temperature=0.0)
    full = generate(model, PROMPT, many)
    assert at_context_length(len(PROMPT), len(full), many, config)
    few = generate(model, PROMPT, GREEDY)
    assert len(few) == GREEDY.max_new_tokens
    assert not at_context_length(len(PROMPT), len(few), GREEDY, config)
    exactly = GenerationConfig(max_new_tokens=len(full), temperature=0.0)
    assert not at_context_length(len(PROMPT), len(generate(model, PROMPT, exactly)), exactly,
                                 config)  # fmt: skip
    ended = generate(model, PROMPT, many, eos_id=full[10])
    assert len(ended) <= 10 and not at_context_length(len(PROMPT), len(ended), many, config)
    notice = context_notice(config.seq_length)
    assert "\n" not in notice and f"seq_length={config.seq_length}" in notice


def test_prompt_longer_than_seq_length_is_one_line() -> None:
    model = _model(ParallelState.single(), sequence_parallel=False)
    with pytest.raises(ConfigError, match=r"^prompt is 33 tokens, longer than .*seq_length=32;"):
        generate(model, [1] * 33, GREEDY)


# -- sampling ---------------------------------------------------------------------------------

LOGITS = torch.tensor([0.0, 3.0, 1.0, 2.0])  # the argmax is token 1; token 3 the second


def _frequencies(config: GenerationConfig, draws: int = 4000) -> list[float]:
    generator = torch.Generator().manual_seed(0)
    counts = [0] * LOGITS.numel()
    for _ in range(draws):
        counts[sample(LOGITS, config, generator)] += 1
    return [count / draws for count in counts]


def test_temperature_zero_is_greedy() -> None:
    drawn = {sample(LOGITS, GenerationConfig(temperature=0.0), torch.Generator().manual_seed(s))
             for s in range(20)}  # fmt: skip
    assert drawn == {1}, f"temperature 0 drew tokens {sorted(drawn)}, not only the argmax 1"


def test_sampling_follows_temperature_and_top_k() -> None:
    """Frequencies of 4000 draws against softmax(logits / T) by hand (4000 draws: one standard
    deviation <= 0.008, tolerance 0.03). T = 2, whole vocabulary: exp([0, 1.5, 0.5, 1]) =
    [1, 4.481689, 1.648721, 2.718282], sum 9.848692. T = 1, top_k = 2: tokens 1 and 3 only,
    e³ : e² = e : 1, so token 1 at e / (1 + e) = 0.731059."""
    got = _frequencies(GenerationConfig(temperature=2.0, top_k=None))
    want = [0.101536, 0.455050, 0.167405, 0.276004]
    assert got == pytest.approx(want, abs=0.03), (
        f"temperature 2: token frequencies {got}, expected softmax(logits / 2) = {want}"
    )
    got = _frequencies(GenerationConfig(temperature=1.0, top_k=2))
    want = [0.0, 0.731059, 0.0, 0.268941]
    assert got == pytest.approx(want, abs=0.03), (
        f"top_k=2: token frequencies {got}, expected {want} (only the 2 most likely tokens, "
        "renormalised)"
    )
    got = _frequencies(GenerationConfig(temperature=1.0, top_k=4))  # k = vocabulary: no cut
    assert got[0] > 0.01, f"top_k=4 of 4 tokens never drew token 0: {got}"


@pytest.mark.parametrize("temperature", [-0.5, float("nan"), float("inf")])
def test_temperature_must_be_finite_and_not_negative(temperature: float) -> None:
    try:
        GenerationConfig(temperature=temperature).validate()
    except ConfigError as error:
        want = f"temperature={temperature!r} must be a finite number >= 0 (0 is greedy)"
        assert str(error) == want, f"temperature={temperature!r}: {error} (expected: {want})"
    else:
        pytest.fail(
            f"temperature={temperature!r} accepted: the check must refuse it before the "
            "checkpoint is loaded (a nan fails in the sampler, inf samples uniformly)"
        )


# -- predict and cli.py generate --------------------------------------------------------------


def _corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        (folder / f"doc{i}.py").write_text("def add(a, b):\n    return a + b\n\n" * (20 + i))
    return folder


CONFIG = dict(vocab_size=257, seq_length=32, hidden_size=32, num_layers=2, num_heads=4,
              hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip


def _trainer(**kwargs: object) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)  # type: ignore[arg-type]  # fmt: skip


@pytest.fixture
def restored_environment() -> Iterator[None]:
    """Lightning's launcher leaves WORLD_SIZE, LOCAL_RANK, MASTER_PORT, ... in this process's
    environment after an in-process run; later Trainers would take them for an external
    launcher. Put the environment back as it was."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.mark.slow
@pytest.mark.usefixtures("restored_environment")
def test_predict_and_cli_generate_from_a_checkpoint(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path)
    data = TextDataModule(paths=str(corpus), seq_length=32, batch_size=2, val_fraction=0.2)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit = _trainer(strategy=MegatronSPStrategy(), max_steps=3, callbacks=[checkpoints],
                   limit_val_batches=0)  # fmt: skip
    fit.fit(GPTModule(GPTConfig(**CONFIG, sequence_parallel=True)), data)  # type: ignore[arg-type]
    ckpt = tmp_path / "ckpt" / "last.ckpt"

    generation = GenerationConfig(max_new_tokens=10, temperature=1.0, seed=11)
    module = GPTModule(GPTConfig(**CONFIG), generation=generation)  # type: ignore[arg-type]
    prompts = TextDataModule(paths=str(corpus), seq_length=32, prompts=["def ", "return"])
    writer = TextPredictionWriter(str(tmp_path / "out"))
    predictor = _trainer(strategy=MegatronSPStrategy(), callbacks=[writer],
                         enable_checkpointing=False)  # fmt: skip
    predicted = predictor.predict(module, prompts, ckpt_path=str(ckpt))
    assert predicted is not None and [p["prompt"] for p in predicted] == ["def ", "return"]
    lines = (tmp_path / "out" / "predictions_dp0.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == predicted
    for p in predicted:
        assert p["completion"] == bytes(p["token_ids"]).decode("utf-8", errors="replace")
        assert 0 < len(p["token_ids"]) <= 10

    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  strategy: megatron_sp\n"
        f"model:\n  config: {json.dumps(CONFIG)}\n"
        f"data:\n  paths: {json.dumps(str(corpus))}\n"
    )
    cli = [str(ROOT / "cli.py"), "generate", "--config", str(config)]
    options = ["--prompt", "def ", "--max_new_tokens", "10", "--temperature", "1.0",
               "--seed", "11"]  # fmt: skip
    # a fresh rendezvous: this process's finished runs left MASTER_PORT etc. in its environment
    # (the test's environment is restored after it: tests/conftest.py)
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        os.environ.pop(name, None)
    # the three runs at once (independent: they read the checkpoint), as cli_runs.run runs each
    result, resharded, missing = run_many(
        [
            [*cli, "--ckpt_path", str(ckpt), *options],
            # the same checkpoint (saved at t=1) resharded into t=2 on load: the same text
            [*cli, "--ckpt_path", str(ckpt), *options, "--tensor_parallel_size", "2"],
            [*cli, "--ckpt_path", "nowhere.ckpt", *options],
        ],
        tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "def " + predicted[0]["completion"] + "\n"

    assert resharded.returncode == 0, resharded.stderr[-3000:]
    assert resharded.stdout == result.stdout

    errors = error_lines(missing.stderr)
    assert missing.returncode != 0 and len(errors) == 1, missing.stderr[-2000:]
    assert "ckpt_path='nowhere.ckpt' does not exist" in errors[0]


@pytest.mark.slow
def test_benchmark_smoke_reports_a_ratio() -> None:
    """``benchmarks/generate.py`` runs (its timings are not asserted; it checks itself that
    both modes generate the same tokens)."""
    from benchmarks.generate import main

    result = main(["--smoke"])
    assert set(result["tokens_per_sec"]) == {"cache", "no_cache"}
    speedup = result["cache_speedup"]
    assert speedup["low"] <= speedup["ratio"] <= speedup["high"]


def test_prompts_use_the_runs_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = _corpus(tmp_path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    data = TextDataModule(paths=str(corpus), tokenizer=str(path), prompts=["def add(a, b):"])
    codec = data.codec
    assert codec.eos_id == tok.token_to_id("<|endoftext|>") == data.eos_token_id
    ids = codec.encode("def add(a, b):")
    assert ids == tok.encode("def add(a, b):").ids and len(ids) < len("def add(a, b):")
    assert codec.decode(ids) == "def add(a, b):"
    batch = next(iter(data.predict_dataloader()))
    assert batch["input_ids"].tolist() == [ids] and batch["prompt"] == ["def add(a, b):"]
