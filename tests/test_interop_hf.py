"""Hugging Face import (lightning_sp.interop.hf, interop.hf_config, interop.hf_types), for
GPT-2 and Llama.

Nothing is downloaded: each test builds a small random ``GPT2LMHeadModel`` or
``LlamaForCausalLM`` with transformers (every weight perturbed, so norm and bias mappings are
exercised) and saves it locally (``tests/hf_models.py``); the Llama has grouped-query attention
with 2 key/value groups, untied embeddings, rope_theta 500000, and is saved in shards with a
``model.safetensors.index.json``.

* Import: the saved model loaded at t = 1, at t = 2 and 4 with SP (the Llama's 2 KV groups
  fewer than t = 4: each held by 2 ranks), at p = 2 and at t = 2 x p = 2 gives transformers'
  float64 logits and loss (relative error <= 1e-10; transformers' Llama with sdpa attention),
  and three AdamW steps from it equal three steps of the one-process float64 model loaded the
  same way; each rank reads only its own slices. Llama 3.1's RoPE scaling read from
  ``config.json`` gives transformers' logits too.
* OpenAI's GPT-2 file names (no ``transformer.`` prefix) read as the prefixed ones, as
  transformers reads them.
* Files transformers loads without a word load here too: a tied model's ``lm_head.weight``, a
  rotary table ``rotary_emb.inv_freq``; a sharded directory is read from every file of its index.
* Generation with RoPE: the cached greedy decoding of the imported Llama equals transformers'
  greedy ``generate``.
* Bad input: not a supported model, a size or architecture mismatch, a missing or unreadable
  file -> one ConfigError line each; the fine-tuning config fits GPT-2 small.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sp import ConfigError, GPTConfig, GPTModule
from lightning_sp.interop.hf import check_hf_directory, load_hf_weights, read_hf_config
from lightning_sp.model.generate import GenerationConfig, generate
from lightning_sp.model.gpt import GPT
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.testing.spawn import run_distributed

from cli_runs import ROOT
from hf_models import (
    LLAMA_GROUPS,
    STEPS,
    TOLERANCE,
    full_logits,
    hf_logits_and_loss,
    llama_config,
    our_config,
    relative,
    save_gpt2_with_reference,
    save_llama_with_reference,
    save_random_gpt2,
    save_random_llama,
    tokens,
    transformers,
    unpadded_elements,
)

CONFIGS = {"gpt2": our_config, "llama": llama_config}
"""Our config of each saved model, by name."""


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A saved random GPT-2 and the float64 reference logits and loss on a fixed batch."""
    return save_gpt2_with_reference(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random Llama saved in shards and its float64 reference logits and loss."""
    return save_llama_with_reference(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def saved(gpt2: tuple[Path, Path], llama: tuple[Path, Path]) -> dict[str, tuple[str, str]]:
    """Both saved models, by name: ``(directory, reference)``."""
    return {"gpt2": (str(gpt2[0]), str(gpt2[1])), "llama": (str(llama[0]), str(llama[1]))}


def _train(model: torch.nn.Module, step: Any, ids: torch.Tensor, labels: torch.Tensor) -> list:
    optimizer = build_adamw(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses.append(step(ids, labels).item())
        optimizer.step()
    return losses


def _reference_losses(name: str, directory: str, ids: torch.Tensor, labels: torch.Tensor) -> list:
    """Training losses of the one-process float64 model loaded from ``directory``."""
    single = GPT(CONFIGS[name](), ParallelState.single(), dtype=torch.float64)
    load_hf_weights(single, directory)

    def single_step(i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = single(i, y)
        loss.backward()
        return loss.detach()

    return _train(single, single_step, ids, labels)


def _import_worker(rank: int, world_size: int, saved: dict, cases: list) -> None:
    """Each ``(model name, t, p)`` case: import, logits and loss against transformers, three
    training steps against the one-process model's."""
    for name, t, p in cases:
        directory, reference = saved[name]
        ref = torch.load(reference)
        ids, labels = ref["ids"], ref["labels"]
        ref_losses = _reference_losses(name, directory, ids, labels)
        what = f"{name} t={t} p={p}"
        state = ParallelState.single() if t * p == 1 else ParallelState.from_process_group(t, p)
        config = CONFIGS[name](sequence_parallel=t > 1)
        if p == 1:
            model: torch.nn.Module = GPT(config, state, dtype=torch.float64)
            chunks = [model]
        else:
            model = Pipeline(config, state, num_microbatches=2, dtype=torch.float64)
            chunks = list(model.chunks)
        read = sum(load_hf_weights(chunk, directory) for chunk in chunks)
        assert read == unpadded_elements(chunks), f"{what}: read {read} elements, not its slices"
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


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_import_one_process_equals_transformers(saved: dict, name: str) -> None:
    _import_worker(0, 1, saved, [(name, 1, 1)])


def test_import_gelu_new_gpt2(tmp_path: Path) -> None:
    """OpenAI's GPT-2 uses the tanh GeLU (``gelu_new``): activation=gelu_tanh computes it."""
    model = save_random_gpt2(tmp_path, activation_function="gelu_new")
    with pytest.raises(ConfigError, match="activation='gelu' does not match"):
        check_hf_directory(tmp_path, our_config())
    ours = GPT(our_config(activation="gelu_tanh"), ParallelState.single(), dtype=torch.float64)
    load_hf_weights(ours, tmp_path)
    ids, labels = tokens()
    logits, loss = hf_logits_and_loss(model, ids, labels)
    with torch.no_grad():
        assert relative(ours(ids, labels), loss) <= TOLERANCE
        err = relative(full_logits([ours], ours.state, ids), logits)
    assert err <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "cases"),
    [
        (2, [("gpt2", 2, 1), ("gpt2", 1, 2), ("llama", 2, 1), ("llama", 1, 2)]),
        (4, [("gpt2", 4, 1), ("gpt2", 2, 2), ("llama", 4, 1), ("llama", 2, 2)]),
    ],
    ids=["ws2", "ws4"],
)
def test_import_any_layout_equals_transformers(saved: dict, world_size: int, cases: list) -> None:
    """t = 2 and 4 with SP (the Llama's 2 KV groups < t = 4), p = 2, t = 2 x p = 2."""
    assert LLAMA_GROUPS < 4
    run_distributed(_import_worker, world_size, saved, cases)


def test_gpt2_without_the_transformer_prefix_equals_transformers(
    tmp_path: Path, gpt2: tuple[Path, Path]
) -> None:
    """OpenAI's GPT-2 upload names its tensors without ``transformer.`` (``h.0.attn.c_attn``):
    transformers reads such a file as the prefixed one, and so do we (the float64 loss and
    logits of the reference)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    unprefixed = tmp_path / "openai"
    unprefixed.mkdir()
    (unprefixed / "config.json").write_text((gpt2[0] / "config.json").read_text())
    with safe_open(str(gpt2[0] / "model.safetensors"), "pt") as f:
        tensors = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert all(not k.startswith("transformer.") for k in tensors) and "h.0.ln_1.weight" in tensors
    save_file(tensors, str(unprefixed / "model.safetensors"), metadata={"format": "pt"})
    theirs = transformers.GPT2LMHeadModel.from_pretrained(unprefixed).double().eval()
    ref = torch.load(gpt2[1])
    _, loss = hf_logits_and_loss(theirs, ref["ids"], ref["labels"])
    assert relative(loss, ref["loss"]) <= TOLERANCE  # transformers: the same model
    ours = GPT(our_config(), ParallelState.single(), dtype=torch.float64)
    try:
        load_hf_weights(ours, unprefixed)
    except ConfigError as error:
        raise AssertionError(
            f"a GPT-2 file without the 'transformer.' prefix (OpenAI's) is not read: {error}"
        ) from None
    with torch.no_grad():
        assert relative(ours(ref["ids"], ref["labels"]), ref["loss"]) <= TOLERANCE
        err = relative(full_logits([ours], ours.state, ref["ids"]), ref["logits"])
    assert err <= TOLERANCE, f"GPT-2 without the prefix: logits relative error {err:.2e}"


def test_llama3_rope_scaling_equals_transformers(tmp_path: Path) -> None:
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3``) is read from config.json
    and gives transformers' logits; the wavelengths chosen put some frequencies in each of
    the three bands (kept, interpolated, divided by ``factor``)."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=32.0,
                   original_max_position_embeddings=512)  # fmt: skip
    model = save_random_llama(tmp_path, rope_scaling=scaling)
    read = read_hf_config(tmp_path)
    assert read.rope_scaling is not None and read.rope_theta == 500000.0
    with pytest.raises(ConfigError, match="rope_scaling=None does not match rope_scaling="):
        check_hf_directory(tmp_path, llama_config())
    ours = GPT(llama_config(rope_scaling=read.rope_scaling), ParallelState.single(),
               dtype=torch.float64)  # fmt: skip
    load_hf_weights(ours, tmp_path)
    ids, labels = tokens()
    logits, loss = hf_logits_and_loss(model, ids, labels)
    unscaled, _ = hf_logits_and_loss(save_random_llama(tmp_path / "plain"), ids, labels)
    assert relative(unscaled, logits) > 1e-3, "the scaling changes nothing at these positions"
    with torch.no_grad():
        assert relative(ours(ids, labels), loss) <= TOLERANCE
        err = relative(full_logits([ours], ours.state, ids), logits)
    assert err <= TOLERANCE, f"logits relative error {err:.2e}"


def test_llama_cached_generation_equals_transformers_greedy(llama: tuple[Path, Path]) -> None:
    """RoPE under the key/value cache (rotated keys cached at their positions): our greedy
    decoding of the imported Llama gives transformers' greedy tokens."""
    hf = transformers.LlamaForCausalLM.from_pretrained(
        llama[0], dtype=torch.float64, attn_implementation="sdpa"
    ).eval()
    ours = GPT(llama_config(), ParallelState.single(), dtype=torch.float64)
    load_hf_weights(ours, llama[0])
    prompt = tokens(batch=1, seed=3)[0][0, :7].tolist()
    steps = 20
    greedy = GenerationConfig(max_new_tokens=steps, temperature=0.0)
    cached = generate(ours, prompt, greedy)
    full = generate(ours, prompt, GenerationConfig(max_new_tokens=steps, temperature=0.0,
                                                   use_cache=False))  # fmt: skip
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=steps, do_sample=False, eos_token_id=None,
                          pad_token_id=0)  # fmt: skip
    theirs = out[0, len(prompt) :].tolist()
    assert len(cached) == steps and len(set(cached)) > 3, cached  # not one repeated token
    assert cached == full, "the cache changes the tokens"
    assert cached == theirs, f"ours {cached}, transformers {theirs}"


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
    message = "is not a supported model: config.json has model_type='bert'; valid: 'gpt2', 'llama'"
    assert message in _one_line(error)

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
    assert "the weights have no tensor 'transformer.h.1.ln_1.weight'" in _one_line(error)
    save_random_gpt2(tmp_path / "wide", n_inner=128)
    (tmp_path / "wide" / "config.json").write_text((gpt2[0] / "config.json").read_text())
    with pytest.raises(ConfigError) as error:
        GPTModule(our_config(), init_from=str(tmp_path / "wide"))
    assert "has shape [64, 128] but config.json needs [64, 256]" in _one_line(error)


def test_llama_mismatches_fail_with_one_line(tmp_path: Path, llama: tuple[Path, Path]) -> None:
    """Each architecture field of ours is checked against the Llama's config.json."""
    directory = llama[0]
    read = read_hf_config(directory, recompute="none")
    assert read == llama_config(seq_length=64)  # config.json read into ours
    where = f"of the Llama model in {str(directory)!r}"
    for overrides, message in [
        ({"num_query_groups": 4}, "num_query_groups=4 does not match num_key_value_heads=2 "
         f"{where}; set num_query_groups: 2"),
        ({"tie_embeddings": True}, "tie_embeddings=True does not match tie_word_embeddings="
         f"False {where}; set tie_embeddings: false"),
        ({"rope_theta": 10000.0}, "rope_theta=10000.0 does not match rope_theta=500000.0"),
        ({"normalization": "layernorm"}, "normalization='layernorm' does not match its "
         f"normalization='rmsnorm' {where}; set normalization: rmsnorm"),
        ({"activation": "gelu"}, "activation='gelu' does not match hidden_act='silu'"),
        ({"bias": True}, "bias=True does not match attention_bias=False"),
        ({"seq_length": 128}, "seq_length=128 exceeds max_position_embeddings=64"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as error:
            GPTModule(llama_config(**overrides), init_from=str(directory))
        assert message in _one_line(error), overrides
    hf = json.loads((directory / "config.json").read_text())
    for edit, message in [
        ({"head_dim": 16}, "sets head_dim=16; this GPT computes head_dim=8"),
        ({"hidden_act": "gelu"}, "uses hidden_act='gelu', which this GPT does not compute; "
         "valid: 'silu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0}},
         "rope_type='yarn' (rope scaling) is not computed by this GPT; valid: 'default', "
         "'llama3'"),
    ]:  # fmt: skip
        edited = tmp_path / next(iter(edit))
        edited.mkdir()
        for file in directory.iterdir():
            (edited / file.name).symlink_to(file)
        (edited / "config.json").unlink()
        (edited / "config.json").write_text(json.dumps({**hf, **edit}))
        with pytest.raises(ConfigError) as error:
            check_hf_directory(edited, llama_config())
        assert message in _one_line(error), edit


def _with_tensors(directory: Path, out: Path, extra: dict[str, torch.Tensor]) -> Path:
    """``directory``'s model (sharded or not) as one ``model.safetensors`` in ``out``, plus
    the ``extra`` tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    out.mkdir()
    (out / "config.json").write_text((directory / "config.json").read_text())
    save_file({**tensors, **extra}, str(out / "model.safetensors"))
    return out


def test_directories_transformers_reads_otherwise_fail_with_one_line(
    tmp_path: Path, gpt2: tuple[Path, Path], llama: tuple[Path, Path]
) -> None:
    """Issue 40: a tensor the config has no place for (an extra layer, an unused bias) was
    dropped without a word, where transformers warns; a config.json with both
    ``rope_parameters`` and a legacy ``rope_scaling`` was read as no scaling, where
    transformers applies the legacy one. Each is refused in one line naming the tensor or the
    keys; the buffers transformers drops silently (GPT-2's ``attn.bias`` mask) still load."""
    extra_layer = _with_tensors(gpt2[0], tmp_path / "extra_layer",
                                {"h.2.ln_1.weight": torch.ones(64)})  # fmt: skip
    try:
        GPTModule(our_config(), init_from=str(extra_layer))
    except ConfigError:
        pass
    else:
        raise AssertionError("the extra tensor 'h.2.ln_1.weight' was dropped without a word")
    with pytest.raises(ConfigError) as error:
        GPTModule(our_config(), init_from=str(extra_layer))
    assert (
        f"init_from={str(extra_layer)!r}: the weights hold tensor 'h.2.ln_1.weight', which "
        "config.json has no place for (transformers would drop it with a warning)"
    ) in _one_line(error)
    bias = _with_tensors(llama[0], tmp_path / "bias",
                         {"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})  # fmt: skip
    with pytest.raises(ConfigError) as error:
        GPTModule(llama_config(), init_from=str(bias))
    assert "tensor 'model.layers.0.self_attn.q_proj.bias', which config.json has no place" in (
        _one_line(error)
    )
    single = GPT(our_config(), ParallelState.single())
    with pytest.raises(ConfigError) as error:  # the loader itself, not only the module's check
        load_hf_weights(single, extra_layer)
    assert "tensor 'h.2.ln_1.weight'" in _one_line(error)
    mask = _with_tensors(gpt2[0], tmp_path / "mask", {"h.0.attn.bias": torch.ones(1, 1, 4, 4)})
    GPTModule(our_config(), init_from=str(mask))  # transformers drops it without a word
    assert load_hf_weights(single, mask) == load_hf_weights(single, gpt2[0])

    hf = json.loads((llama[0] / "config.json").read_text())
    both = _with_tensors(llama[0], tmp_path / "both", {})
    (both / "config.json").write_text(json.dumps({
        **hf, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }))  # fmt: skip
    try:
        read_hf_config(both)
    except ConfigError:
        pass
    else:
        raise AssertionError(
            "a config.json with both rope_parameters and a legacy rope_scaling was read (as no "
            "scaling, where transformers applies rope_scaling)"
        )
    with pytest.raises(ConfigError) as error:
        read_hf_config(both)
    assert _one_line(error).startswith(
        f"init_from={str(both)!r}: config.json has both rope_parameters={{'rope_type': "
        "'default', 'rope_theta': 500000.0} and the legacy rope_scaling={'rope_type': "
        "'linear', 'factor': 2.0}; transformers applies rope_scaling and drops "
        "rope_parameters: keep one of the two keys"
    )


def test_tensors_transformers_loads_without_a_word_load(tmp_path: Path) -> None:
    """A tied Llama's file holding ``lm_head.weight`` (the embedding again, as tools other than
    ``save_pretrained`` write it) and an older file's rotary table ``rotary_emb.inv_freq``:
    transformers loads each without a word (no unexpected or missing key); so do we, to the
    weights of the file without it."""
    from safetensors import safe_open

    save_random_llama(tmp_path / "tied", tie_word_embeddings=True)
    config = read_hf_config(tmp_path / "tied", recompute="none")
    assert config.tie_embeddings
    clean = GPT(config, ParallelState.single(), dtype=torch.float64)
    load_hf_weights(clean, tmp_path / "tied")
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    for key, tensor in {
        "lm_head.weight": embedding.clone(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
    }.items():
        extra = _with_tensors(tmp_path / "tied", tmp_path / key, {key: tensor})
        _, info = transformers.AutoModelForCausalLM.from_pretrained(extra, output_loading_info=True)
        assert not info["unexpected_keys"] and not info["missing_keys"], (key, info)
        ours = GPT(config, ParallelState.single(), dtype=torch.float64)
        try:
            load_hf_weights(ours, extra)
        except ConfigError as error:
            raise AssertionError(
                f"{key}: transformers loads the file without a word; we refuse it: {error}"
            ) from None
        for (name, a), b in zip(clean.named_parameters(), ours.parameters(), strict=True):
            assert torch.equal(a, b), f"{key} in the file: {name} read otherwise"


def test_sharded_directory_reads_every_file_of_its_index(llama: tuple[Path, Path]) -> None:
    """The Llama saved in shards: every file its ``model.safetensors.index.json`` names is
    read, each tensor once (the elements read are all the files hold)."""
    from safetensors import safe_open

    index = json.loads((llama[0] / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1, files
    total = 0
    for file in files:
        with safe_open(str(llama[0] / file), "pt") as f:
            total += sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())  # noqa: SIM118
    model = GPT(llama_config(), ParallelState.single(), dtype=torch.float64)
    try:
        read = load_hf_weights(model, llama[0])
    except (ConfigError, AssertionError) as error:
        raise AssertionError(
            f"a directory sharded in {len(files)} files is not read whole: {error!r}"
        ) from None
    assert read == total, f"read {read} of the {total} elements its {len(files)} files hold"


def test_export_picks_the_model_type_that_holds_the_config() -> None:
    from lightning_sp.interop.hf_types import GPT2, LLAMA, model_type_for

    assert model_type_for(our_config()) is GPT2
    assert model_type_for(our_config(activation="gelu_tanh")) is GPT2
    assert model_type_for(llama_config()) is LLAMA
    assert model_type_for(llama_config(tie_embeddings=True, bias=True)) is LLAMA
    with pytest.raises(ConfigError) as error:  # RMSNorm with GeLU: neither family
        model_type_for(our_config(normalization="rmsnorm"))
    message = _one_line(error)
    assert message.startswith("no Hugging Face model type holds this config (gpt2: ")
    assert "normalization='rmsnorm' does not match its normalization='layernorm'" in message
    assert "llama: activation='gelu' has no hidden_act value; valid: 'swiglu'" in message
    with pytest.raises(ConfigError, match="num_query_groups=2 does not match n_head=4"):
        model_type_for(our_config(num_query_groups=2))  # GPT-2 with GQA: not expressible


@pytest.mark.slow
def test_finetune_config_matches_gpt2_small() -> None:
    """configs/gpt2_finetune.yaml fits OpenAI's GPT-2 (transformers' GPT2Config defaults are
    GPT-2 small), and the CLI parses it."""
    import yaml

    from lightning_sp.interop.hf_config import check_config
    from lightning_sp.interop.hf_types import GPT2

    raw = yaml.safe_load((ROOT / "configs" / "gpt2_finetune.yaml").read_text())
    assert raw["model"]["init_from"] == "gpt2"
    hf = transformers.GPT2Config().to_dict()
    check_config(GPT2.config, hf, GPTConfig(**raw["model"]["config"]), "gpt2")
    result = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "fit", "--config",
         str(ROOT / "configs" / "gpt2_finetune.yaml"), "--print_config"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "init_from: gpt2" in result.stdout


def test_loading_files_that_lack_a_tensor_is_one_line(tmp_path: Path) -> None:
    """``load_hf_weights`` itself (the Python API; export's LoRA base) names a tensor the
    files lack in one line, before any read (it was a bare ``AssertionError``)."""
    from safetensors.torch import load_file, save_file

    save_random_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    missing = "model.layers.0.mlp.up_proj.weight"
    del tensors[missing]
    save_file(tensors, str(path), metadata={"format": "pt"})
    model = GPT(read_hf_config(tmp_path), ParallelState.single())
    try:
        load_hf_weights(model, tmp_path)
    except ConfigError as error:
        line = str(error)
    except Exception as error:
        raise AssertionError(
            f"files lacking {missing}: {type(error).__name__}({error}), not one ConfigError line"
        ) from error
    else:
        raise AssertionError(f"files lacking {missing} loaded without a word")
    assert missing in line and "\n" not in line, f"files lacking {missing}: {line!r}"
