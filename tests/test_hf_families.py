"""Hugging Face families beyond GPT-2 and Llama: Mistral, Qwen2, Qwen3 and OLMo 2 in
(``init_from``: :func:`read_hf_config`, :func:`load_hf_weights`) and out (:func:`save_hf`,
what ``cli.py export`` writes), and the Llama options that used to be refused.

Nothing is downloaded: a small random model of each family (``tests/hf_families.py``: 8 query
heads in 2 key/value groups, a head dimension of 12 != h/a for Mistral and Qwen3, every weight
perturbed) is saved locally.

* Import: each family read at t = 1, at t = 2 and 4 with SP (2 KV groups fewer than t = 4), at
  p = 2 and at c = 2 gives transformers' float64 loss (and logits where one rank holds them
  all) to a relative 1e-10, three AdamW steps equal the one-process model's, and each rank
  reads only its own slices.
* Export: the model written back loads in ``AutoModelForCausalLM`` as that family's class
  and gives back every tensor of the original exactly.
* Llama variants: ``attention_bias``, ``head_dim`` != h/a, RoPE scaling ``linear`` and
  ``dynamic`` (and ``linear`` in transformers 4's ``rope_scaling: {type: ...}``) equal
  transformers; ``dynamic`` also where it acts, beyond
  ``max_position_embeddings``.
* Names: the tensors our parts name are those transformers builds, for every dense family.
* Generation: cached greedy decoding of Qwen3 and OLMo 2 equals transformers' greedy tokens.
* Absent keys: a ``config.json`` of sizes only is read, in every family, with the norm epsilon,
  RoPE base, tied embeddings, biases and top-k renormalisation transformers' config class of
  that family takes.
* Bad input: a family we do not read (Gemma, GPT-NeoX), a real sliding window, Qwen's
  ``use_sliding_window`` -> one ConfigError line naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_families import FAMILIES, GROUPS, save_family_with_reference, save_random_family

from lightning_sp import ConfigError
from lightning_sp.interop.hf import check_hf_directory, load_hf_weights, read_hf_config
from lightning_sp.interop.hf_export import save_hf
from lightning_sp.model.gpt import GPT
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.parallel.context import shard_for_context_parallel
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.testing.spawn import run_distributed

from hf_models import (
    STEPS,
    TOLERANCE,
    full_logits,
    hf_logits_and_loss,
    relative,
    tokens,
    transformers,
    unpadded_elements,
)

NAMES = tuple(FAMILIES)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Every family saved with its reference, by name: ``(directory, reference)``."""
    out = {}
    for name in NAMES:
        directory, reference = save_family_with_reference(tmp_path_factory.mktemp(name), name)
        out[name] = (str(directory), str(reference))
    return out


def _train(model: torch.nn.Module, step: Any, ids: torch.Tensor, labels: torch.Tensor) -> list:
    optimizer = build_adamw(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses.append(step(ids, labels).item())
        optimizer.step()
    return losses


def _model_step(model: Any, state: ParallelState) -> Any:
    def step(i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if isinstance(model, Pipeline):
            loss = model.train_step(i, y)
            model.finalize_grads()
            return loss
        loss = model(i, y)
        loss.backward()
        finalize_grads(model, state)
        return loss.detach()

    return step


def _import_worker(rank: int, world_size: int, saved: dict, cases: list) -> None:
    """Each ``(family, t, p, c)`` case: import, loss (and logits) against transformers, three
    training steps against the one-process float64 model's."""
    for name, t, p, c in cases:
        directory, reference = saved[name]
        ref = torch.load(reference)
        ids, labels = ref["ids"], ref["labels"]
        what = f"{name} t={t} p={p} c={c}"
        config = read_hf_config(directory, recompute="none", seq_length=ids.shape[1])
        single = GPT(config, ParallelState.single(), dtype=torch.float64)
        load_hf_weights(single, directory)
        ref_losses = _train(single, _model_step(single, single.state), ids, labels)
        if t * p * c == 1:
            state = ParallelState.single()
        else:
            state = ParallelState.from_process_group(t, p, context_parallel_size=c)
        config = read_hf_config(
            directory, recompute="none", seq_length=ids.shape[1], sequence_parallel=t > 1
        )
        if p == 1:
            model: torch.nn.Module = GPT(config, state, dtype=torch.float64)
            chunks = [model]
        else:
            model = Pipeline(config, state, num_microbatches=2, dtype=torch.float64)
            chunks = list(model.chunks)
        read = sum(load_hf_weights(chunk, directory) for chunk in chunks)
        assert read == unpadded_elements(chunks), f"{what}: read {read} elements, not its slices"
        if c > 1:  # each CP rank feeds its two chunks of every sequence
            cp_rank = state.context_parallel_rank
            ids, labels = (shard_for_context_parallel(x, 1, c, cp_rank) for x in (ids, labels))
        with torch.no_grad():
            loss = model(ids, labels) if p == 1 else model.eval_step(ids, labels)
            logits = full_logits(chunks, state, ids) if c == 1 else None
        assert relative(loss, ref["loss"]) <= TOLERANCE, f"{what}: loss {loss} vs {ref['loss']}"
        err = 0.0
        if logits is not None:
            err = relative(logits, ref["logits"])
            assert err <= TOLERANCE, f"{what}: logits relative error {err:.2e}"
        losses = _train(model, _model_step(model, state), ids, labels)
        errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
        if rank == world_size - 1:
            print(f"{what}: loss {relative(loss, ref['loss']):.1e}, logits {err:.1e}, "
                  f"training losses {max(errors):.1e} (relative errors)")  # fmt: skip
        assert max(errors) <= TOLERANCE, f"{what}: training diverged {losses} vs {ref_losses}"
        assert losses[-1] < losses[0], f"{what}: loss did not fall {losses}"


@pytest.mark.parametrize("name", NAMES)
def test_import_one_process_equals_transformers(saved: dict, name: str) -> None:
    _import_worker(0, 1, saved, [(name, 1, 1, 1)])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "cases"),
    [
        (2, [(n, 2, 1, 1) for n in NAMES] + [(n, 1, 2, 1) for n in NAMES]
         + [(n, 1, 1, 2) for n in NAMES]),
        (4, [(n, 4, 1, 1) for n in NAMES] + [(n, 2, 1, 2) for n in NAMES]),
    ],
    ids=["ws2", "ws4"],
)  # fmt: skip
def test_import_any_layout_equals_transformers(saved: dict, world_size: int, cases: list) -> None:
    """t = 2 and 4 with SP (2 KV groups < t = 4), p = 2, c = 2 and t = 2 x c = 2."""
    assert GROUPS < 4
    run_distributed(_import_worker, world_size, saved, cases)


@pytest.mark.parametrize("name", NAMES)
def test_export_round_trip_gives_back_every_tensor(saved: dict, tmp_path: Path, name: str) -> None:
    directory = saved[name][0]
    config = read_hf_config(directory, recompute="none")
    model = GPT(config, ParallelState.single(), dtype=torch.float64)
    load_hf_weights(model, directory)
    out = save_hf(config, ((n, p.detach()) for n, p in model.named_parameters()), tmp_path / "x")
    original = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    assert type(back).__name__ == FAMILIES[name][1]
    assert json.loads((out / "config.json").read_text())["model_type"] == name
    theirs, ours = original.state_dict(), back.state_dict()
    assert set(theirs) == set(ours)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


@pytest.mark.parametrize(
    "overrides",
    [
        {"attention_bias": True, "head_dim": 12},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
    ],
    ids=["bias_head_dim", "rope_linear", "rope_dynamic"],
)
def test_llama_variants_equal_transformers(tmp_path: Path, overrides: dict) -> None:
    """The Llama options once refused: biases on every attention projection, a head dimension
    that is not h/a, linear and dynamic RoPE scaling (dynamic is unscaled up to
    max_position_embeddings, which bounds seq_length)."""
    from hf_models import save_random_llama

    reference = save_random_llama(tmp_path, **overrides)
    config = read_hf_config(tmp_path, recompute="none", seq_length=32)
    model = GPT(config, ParallelState.single(), dtype=torch.float64)
    load_hf_weights(model, tmp_path)
    ids, labels = tokens()
    logits, loss = hf_logits_and_loss(reference, ids, labels)
    with torch.no_grad():
        assert relative(model(ids, labels), loss) <= TOLERANCE
        assert relative(full_logits([model], model.state, ids), logits) <= TOLERANCE


def test_legacy_rope_scaling_type_key_equals_transformers(tmp_path: Path) -> None:
    """An older Llama ``config.json`` (transformers 4) spells the scaling
    ``rope_scaling: {"type": "linear", "factor": 2.0}`` beside a top-level ``rope_theta``:
    transformers applies linear scaling from it, and so do we (float64 loss and logits)."""
    from hf_models import save_random_llama

    save_random_llama(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    theta = hf.pop("rope_parameters")["rope_theta"]
    legacy = {**hf, "rope_theta": theta, "rope_scaling": {"type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert reference.config.rope_parameters["rope_type"] == "linear"  # transformers' reading
    config = read_hf_config(tmp_path, recompute="none", seq_length=32)
    scaling = config.rope_scaling
    assert scaling is not None and (scaling.rope_type, scaling.factor) == ("linear", 2.0), (
        f"rope_scaling {{'type': 'linear', 'factor': 2.0}} read as rope_scaling={scaling}; "
        "transformers applies linear scaling"
    )
    model = GPT(config, ParallelState.single(), dtype=torch.float64)
    load_hf_weights(model, tmp_path)
    ids, labels = tokens()
    logits, loss = hf_logits_and_loss(reference.eval(), ids, labels)
    with torch.no_grad():
        assert relative(model(ids, labels), loss) <= TOLERANCE
        assert relative(full_logits([model], model.state, ids), logits) <= TOLERANCE


def test_dynamic_rope_above_max_position_embeddings_equals_transformers(tmp_path: Path) -> None:
    """Dynamic NTK RoPE where it acts: a Llama whose position table is 16 read with seq_length
    32, so the 32-token batch rescales RoPE's base from that length (transformers recomputes
    its inverse frequencies from the current length, ``max(position_ids) + 1``, on a fresh
    model): float64 loss and logits equal transformers'; the export writes the same
    ``config.json`` keys back (its table length, not our seq_length)."""
    from hf_models import SEQ, save_random_llama

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    table = SEQ // 2
    reference = save_random_llama(tmp_path, max_position_embeddings=table, rope_parameters=rope)
    config = read_hf_config(tmp_path, recompute="none", seq_length=SEQ)
    assert config.seq_length == 2 * table and config.rope_scaling is not None
    assert config.rope_scaling.original_max_position_embeddings == table
    check_hf_directory(tmp_path, config)
    model = GPT(config, ParallelState.single(), dtype=torch.float64)
    load_hf_weights(model, tmp_path)
    ids, labels = tokens()
    assert ids.shape[1] == SEQ > table  # the scaled regime
    logits, loss = hf_logits_and_loss(reference, ids, labels)
    with torch.no_grad():
        assert relative(model(ids, labels), loss) <= TOLERANCE
        assert relative(full_logits([model], model.state, ids), logits) <= TOLERANCE
    out = save_hf(config, model.state_dict().items(), tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert written["max_position_embeddings"] == table
    assert written["rope_scaling"] == {"rope_type": "dynamic", "factor": 2.0}


@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_cached_generation_equals_transformers_greedy(saved: dict, name: str) -> None:
    """Query/key norms and post-norms under the key/value cache: our greedy decoding of the
    imported model gives transformers' greedy tokens (OLMo 2's reference with float64 query/key
    norm statistics, as ours)."""
    from hf_families import wide_olmo2_norms

    from lightning_sp.model.generate import GenerationConfig, generate

    directory = saved[name][0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    if name == "olmo2":
        wide_olmo2_norms(hf)
    ours = GPT(read_hf_config(directory, recompute="none"), ParallelState.single(),
               dtype=torch.float64)  # fmt: skip
    load_hf_weights(ours, directory)
    prompt = tokens(batch=1, seed=3)[0][0, :7].tolist()
    steps = 20
    cached = generate(ours, prompt, GenerationConfig(max_new_tokens=steps, temperature=0.0))
    full = generate(ours, prompt, GenerationConfig(max_new_tokens=steps, temperature=0.0,
                                                   use_cache=False))  # fmt: skip
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    theirs = out[0, len(prompt) :].tolist()
    assert len(set(cached)) > 3, cached
    assert cached == full, "the cache changes the tokens"
    assert cached == theirs, f"ours {cached}, transformers {theirs}"


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_unsupported_families_and_options_fail_with_one_line(tmp_path: Path) -> None:
    for model_type, config_class in (("gemma", "GemmaConfig"), ("gpt_neox", "GPTNeoXConfig")):
        directory = tmp_path / model_type
        getattr(transformers, config_class)().save_pretrained(directory)
        with pytest.raises(ConfigError) as error:
            read_hf_config(directory)
        assert f"config.json has model_type={model_type!r}; valid: 'gpt2', 'llama', " \
               "'mistral', 'qwen2', 'qwen3', 'olmo2'" in _one_line(error)  # fmt: skip
    window = tmp_path / "window"
    save_random_family(window, "mistral", sliding_window=16)
    with pytest.raises(ConfigError) as error:
        check_hf_directory(window, read_hf_config(window, seq_length=32))
    assert "sets sliding_window=16, shorter than seq_length=32; this GPT computes full " \
           "causal attention only" in _one_line(error)  # fmt: skip
    check_hf_directory(window, read_hf_config(window, seq_length=16))  # the window is whole
    qwen = tmp_path / "qwen"
    save_random_family(qwen, "qwen2")
    hf = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**hf, "use_sliding_window": True}))
    with pytest.raises(ConfigError) as error:
        check_hf_directory(qwen, read_hf_config(qwen, seq_length=32))
    assert "sets use_sliding_window=True; this GPT computes use_sliding_window=False" in \
        _one_line(error)  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "fields"),
    [
        ("gpt2", {}),
        ("llama", {"bias": True}),  # attention_bias and mlp_bias
        ("llama", {"bias": ["qkv", "proj"], "tie_embeddings": True}),
        ("mistral", {"kv_channels": 12}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("olmo2", {}),
    ],
    ids=["gpt2", "llama_biases", "llama_tied", "mistral", "qwen2", "qwen3", "olmo2"],
)
def test_parts_name_every_tensor_of_the_family(model_type: str, fields: dict) -> None:
    """The tensors our parts name for a config (each part's rows in the family's naming
    scheme, plus the model's own) are exactly those transformers builds from the config.json
    we write for it: no missing tensor, none named that the family lacks (biases as chosen,
    Qwen3's and OLMo 2's query/key norms, OLMo 2's post-norms)."""
    from lightning_sp.interop.hf import hf_layout
    from lightning_sp.interop.hf_types import HF_MODEL_TYPES
    from lightning_sp.model.config import GPTConfig

    family = HF_MODEL_TYPES[model_type]
    groups = {} if model_type == "gpt2" else {"num_query_groups": GROUPS}
    config = GPTConfig.of(family.architecture, vocab_size=100, hidden_size=32, num_layers=2,
                          num_heads=4, seq_length=16, hf_model_type=model_type,
                          **groups, **fields)  # fmt: skip
    hf = transformers.AutoConfig.for_model(**family.config_json(config, eos_token_id=0))
    with torch.device("meta"):
        theirs = set(transformers.AutoModelForCausalLM.from_config(hf).state_dict())
    if config.tie_embeddings:
        theirs.discard("lm_head.weight")  # the embedding's; save_pretrained writes it once
    assert set(hf_layout(family, config)) == theirs


def test_absent_keys_read_as_transformers_reads_them() -> None:
    """A ``config.json`` that gives only the sizes (older or hand-written files lack the keys
    at their defaults): every family reads the norm epsilon, RoPE's base, the tied embeddings,
    the biases and the top-k renormalisation as transformers' config class of that family
    does (OLMo 2's and OLMoE's epsilon is 1e-5, Mixtral's base 1e6): the model then computes
    what transformers computes."""
    from lightning_sp.interop.hf_config import config_fields
    from lightning_sp.interop.hf_types import HF_MODEL_TYPES

    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 100,
             "max_position_embeddings": 16, "num_experts_per_tok": 2,
             "moe_intermediate_size": 16, "num_local_experts": 4, "num_experts": 4,
             "hidden_act": "silu"}  # fmt: skip
    gpt2 = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 16,
            "activation_function": "gelu_new"}  # fmt: skip
    for model_type, family in HF_MODEL_TYPES.items():
        given = {"model_type": model_type, **(gpt2 if model_type == "gpt2" else sizes)}
        theirs = transformers.AutoConfig.for_model(**given)
        ours = config_fields(family.config, given, f"a {model_type} config.json of sizes only")
        expected = {
            "layernorm_eps": getattr(theirs, "rms_norm_eps", None)
            or getattr(theirs, "layer_norm_epsilon", None),
            "tie_embeddings": theirs.tie_word_embeddings,
        }
        if model_type != "gpt2":
            expected["rope_theta"] = theirs.rope_parameters["rope_theta"]
            bias = bool(getattr(theirs, "attention_bias", model_type == "qwen2"))
            expected["bias"] = ["qkv"] if model_type == "qwen2" and bias else bias
        if ours.get("moe") is not None:  # Mixtral has no key: it always renormalises
            ours["moe.normalize_top_k"] = ours["moe"].normalize_top_k
            expected["moe.normalize_top_k"] = getattr(theirs, "norm_topk_prob", True)
        for field, value in expected.items():
            assert ours[field] == value, (
                f"{model_type}: a config.json without the key of {field} is read as "
                f"{field}={ours[field]!r}; transformers reads {value!r}"
            )
