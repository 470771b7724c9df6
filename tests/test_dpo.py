"""DPO (lightning_sp.training.preference, training.dpo, model.sequence_logps) against TRL 1.16's
``DPOTrainer`` on the transformers models with the same weights, float64:

* one process: every sequence's answer log-probability (policy and the frozen reference copy),
  the loss, TRL's six metrics and every gradient, relative error <= 1e-10, for ``sigmoid``,
  ``ipo`` and ``robust`` (label smoothing), pairs packed several to a row as documents;
* t = 2 + SP, p = 2 (two micro-batches), c = 2, and d = 2 with two accumulated batches per
  step: the same loss, metrics and gradient shards as one process on the whole batch (rows
  holding 3, 1, 2, 2 pairs: a per-micro-batch or per-rank mean would differ);
* packed pairs give the log-probabilities each sequence gives alone;
* LoRA: the reference with adapters off is the base (``adapters_disabled``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lora_models import LORA, wide_norms
from preference_models import ROWS, make_pairs, pack_rows, trl_reference

from lightning_sp.errors import ConfigError
from lightning_sp.interop.hf import load_hf_weights
from lightning_sp.interop.hf_export import hf_tensors
from lightning_sp.interop.hf_types import model_type_for
from lightning_sp.model.documents import Packing
from lightning_sp.model.lora import adapters_disabled, apply_lora, lora_parameters
from lightning_sp.parallel.init import local_slice
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import Pipeline
from lightning_sp.pipeline.token_mean import TokenMean
from lightning_sp.testing.spawn import run_distributed
from lightning_sp.training.batches import labels_of
from lightning_sp.training.dpo import PreferenceSteps
from lightning_sp.training.preference import (
    DPOConfig,
    PairSums,
    SequenceLogps,
    preference_targets,
)

from hf_models import TOLERANCE, llama_config, relative, save_random_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

SETTINGS = [
    {"loss_type": "sigmoid", "beta": 0.1},
    {"loss_type": "ipo", "beta": 0.5},
    {"loss_type": "robust", "beta": 0.2, "label_smoothing": 0.1},
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A saved random Llama (the policy), a perturbed copy (the reference model), 8 pairs, and
    TRL's results for each of SETTINGS."""
    policy_dir = tmp_path_factory.mktemp("policy")
    reference_dir = tmp_path_factory.mktemp("reference")
    model = save_random_llama(policy_dir)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.02)
    model.float().save_pretrained(reference_dir)
    pairs = make_pairs(sum(ROWS))
    results = trl_reference(policy_dir, reference_dir, pairs, SETTINGS)
    return {"policy": str(policy_dir), "reference": str(reference_dir), "pairs": pairs,
            "trl": results}  # fmt: skip


def _pipeline(state: ParallelState, directory: str, microbatches: int = 1, **kw: Any) -> Pipeline:
    config = llama_config(**kw)
    pipeline = Pipeline(config, state, num_microbatches=microbatches, dtype=torch.float64)
    for chunk in pipeline.chunks:
        load_hf_weights(chunk, directory)
    return pipeline


def _packing(batch: dict[str, torch.Tensor]) -> Packing:
    return Packing.of_batch(batch, ParallelState.single())


def _pair_order(batch: dict[str, torch.Tensor], values: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` per-slot values as TRL orders them: every pair's chosen, then every
    rejected (pairs in row order)."""
    targets = preference_targets(labels_of(batch), batch["sequences"])
    valid = targets.pairs
    return torch.cat([values[:, 0::2][valid], values[:, 1::2][valid]])


def _one_process(reference: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any]:
    """Our one-process run of ``setting`` on the whole batch: loss, metrics, full gradients by
    our global names, the per-sequence log-probabilities (policy, reference)."""
    state = ParallelState.single()
    batch = pack_rows(reference["pairs"])
    with wide_norms():
        policy = _pipeline(state, reference["policy"])
        steps = PreferenceSteps(DPOConfig(**setting, reference="copy"), lora=False)
        steps.use_copy(_pipeline(state, reference["reference"]))
        sums = PairSums()
        loss, pairs = steps.run(policy, batch, sums)
        (loss / pairs).backward()
        targets = preference_targets(labels_of(batch), batch["sequences"])
        logps = [
            torch.cat(model.outputs(batch["input_ids"], targets.target, _packing(batch),
                                    SequenceLogps(targets.num_slots)))
            for model in (policy, steps.copy[0])
        ]  # fmt: skip
    grads = {policy.global_name(n): p.grad for n, p in policy.named_parameters()}
    return {"loss": loss.detach() / pairs, "metrics": sums.reduce(state), "grads": grads,
            "logps": [_pair_order(batch, x) for x in logps]}  # fmt: skip


@pytest.mark.parametrize("index", range(len(SETTINGS)), ids=[s["loss_type"] for s in SETTINGS])
def test_one_process_equals_trl(reference: dict[str, Any], index: int) -> None:
    setting, trl = SETTINGS[index], reference["trl"][index]
    ours = _one_process(reference, setting)
    what = f"dpo {setting['loss_type']}"
    for name, mine, theirs in (("policy", ours["logps"][0], trl["logps"]),
                               ("reference", ours["logps"][1], trl["ref_logps"])):  # fmt: skip
        err = relative(mine, theirs)
        assert err <= TOLERANCE, f"{what}: {name} sequence log-probs relative error {err:.2e}"
    err = relative(ours["loss"], trl["loss"])
    assert err <= TOLERANCE, f"{what}: loss {ours['loss'].item()} vs TRL {trl['loss'].item()}"
    for name, value in trl["metrics"].items():
        if name.startswith(("rewards/", "logps/")):
            mine = ours["metrics"][name]
            assert abs(mine - value) <= TOLERANCE * max(1.0, abs(value)), (
                f"{what}: {name} {mine} vs TRL {value}"
            )
    config = llama_config()
    theirs = hf_tensors(model_type_for(config), config, ours["grads"].items())
    checked = 0
    for hf_name, grad in theirs.items():
        err = relative(grad, trl["grads"][hf_name])
        assert err <= TOLERANCE, f"{what}: gradient of {hf_name} relative error {err:.2e}"
        checked += 1
    assert checked == len(trl["grads"]), f"{what}: {checked} of {len(trl['grads'])} compared"


def _layout(case: tuple[int, ...], reference: dict[str, Any], one: dict[str, Any]) -> None:
    """One layout ``(t, p, c, d)`` (SP with t > 1; d = 2: two accumulated batches per replica)
    against one process on the whole batch: loss, metrics, every gradient shard."""
    t, p, c, d = case
    what = f"dpo t={t} p={p} c={c} d={d}"
    state = ParallelState.from_process_group(t, p, context_parallel_size=c)
    batch = pack_rows(reference["pairs"])
    rows = batch["input_ids"].shape[0]
    replica = [
        {k: v[i : i + 1] for k, v in batch.items()}
        for i in range(rows)
        if i * d // rows == state.data_parallel_rank
    ]  # d = 2: this replica's two rows, one batch each
    batches = replica if d > 1 else [batch]
    with wide_norms():
        policy = _pipeline(state, reference["policy"], p, sequence_parallel=t > 1)
        steps = PreferenceSteps(DPOConfig(**SETTINGS[0], reference="copy"), lora=False)
        steps.use_copy(_pipeline(state, reference["reference"], p, sequence_parallel=t > 1))
        sums, mean = PairSums(), TokenMean(state)
        for part in batches:
            loss, pairs = steps.run(policy, part, sums)
            if not policy.runs_backward:
                loss.backward()
            mean.add_count(pairs, loss)
        policy.finalize_grads()
        step_loss = mean.finish(policy)
    err = relative(step_loss, one["loss"])
    assert err <= TOLERANCE, f"{what}: step loss relative error {err:.2e}"
    metrics = sums.reduce(state)
    for name, value in one["metrics"].items():
        assert abs(metrics[name] - value) <= TOLERANCE * max(1.0, abs(value)), (
            f"{what}: {name} {metrics[name]} vs one process {value}"
        )
    vocab = policy.config.vocab_size
    for name, param in policy.named_parameters():
        full = one["grads"][policy.global_name(name)][:vocab]  # padding depends on t
        rows = param.shape[0]
        if getattr(param, "padded_vocab", False):  # the shard's rows below vocab_size
            rows = max(0, min(rows, vocab - param.shard.start))
        grad, expected = param.grad[:rows], local_slice(param, full)[:rows]
        assert grad.shape == expected.shape, f"{what}: {name} shard outside the reference"
        if rows:
            err = relative(grad, expected)
            assert err <= TOLERANCE, f"{what}: gradient of {name} relative error {err:.2e}"


def _worker(rank: int, world_size: int, cases: list, reference: dict, one: dict) -> None:
    for case in cases:
        _layout(case, reference, one)


@pytest.mark.slow
def test_layouts_equal_one_process(reference: dict[str, Any]) -> None:
    one = _one_process(reference, SETTINGS[0])
    one["grads"] = {k: v.detach().clone() for k, v in one["grads"].items()}
    cases = [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)]
    run_distributed(_worker, 2, cases, reference, one)


def test_packed_pairs_equal_each_sequence_alone(reference: dict[str, Any]) -> None:
    """Three pairs in one row (six documents) give the log-probabilities each of the six
    sequences gives alone in its own row."""
    state = ParallelState.single()
    pairs = reference["pairs"][:3]
    policy = _pipeline(state, reference["policy"])
    packed = pack_rows(pairs, [3])
    targets = preference_targets(labels_of(packed), packed["sequences"])
    together = policy.outputs(packed["input_ids"], targets.target, _packing(packed),
                              SequenceLogps(targets.num_slots))[0]  # fmt: skip
    for j, pair in enumerate(pairs):
        alone = pack_rows([pair], [1])
        one = preference_targets(labels_of(alone), alone["sequences"])
        values = policy.outputs(alone["input_ids"], one.target, _packing(alone),
                                SequenceLogps(2))[0]  # fmt: skip
        for k in range(2):
            err = relative(together[0, 2 * j + k], values[0, k])
            assert err <= TOLERANCE, f"pair {j} sequence {k}: packed vs alone {err:.2e}"


def test_reference_with_adapters_off_is_the_base(reference: dict[str, Any]) -> None:
    """With adapters attached (B non-zero), ``adapters_disabled`` gives the base's
    log-probabilities exactly, and puts the adapters back."""
    state = ParallelState.single()
    batch = pack_rows(reference["pairs"])
    targets = preference_targets(labels_of(batch), batch["sequences"])
    objective = SequenceLogps(targets.num_slots)
    base = _pipeline(state, reference["policy"])
    expected = base.outputs(batch["input_ids"], targets.target, _packing(batch), objective)[0]
    for chunk in base.chunks:
        apply_lora(chunk, LORA)
        with torch.no_grad():
            for param in lora_parameters(chunk).values():
                param.normal_(0, 0.2)
    adapted = base.outputs(batch["input_ids"], targets.target, _packing(batch), objective)[0]
    assert relative(adapted, expected) > 1e-3, "the adapters change nothing: the test is void"
    with adapters_disabled(base):
        off = base.outputs(batch["input_ids"], targets.target, _packing(batch), objective)[0]
    assert torch.equal(off, expected), "adapters off differs from the base"
    again = base.outputs(batch["input_ids"], targets.target, _packing(batch), objective)[0]
    assert torch.equal(again, adapted), "the adapters were not put back"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"loss_type": "hinge"}, "dpo.loss_type='hinge' is invalid; valid: sigmoid, robust, ipo"),
        ({"beta": 0.0}, "dpo.beta=0.0 must be a positive finite number"),
        ({"beta": float("nan")}, "dpo.beta=nan must be a positive finite number"),
        ({"label_smoothing": 0.1}, "dpo.label_smoothing=0.1 applies to loss_type 'robust'"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, "dpo.label_smoothing=0.5 must be in"),
        ({"reference": "adapters"}, "dpo.reference='adapters' needs LoRA adapters"),
        ({"reference": "ref"}, "dpo.reference='ref' is invalid"),
    ],
)
def test_bad_settings_fail_in_one_line(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        DPOConfig(**fields).validate(lora=False)
    line = str(error.value)
    assert line.startswith(message) and "\n" not in line, line


def test_dpo_on_moe_is_refused_before_work() -> None:
    from lightning_sp import GPTModule
    from lightning_sp.model.config import GPTConfig
    from lightning_sp.model.moe.config import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=32, aux_loss_coef=0.01)
    config = GPTConfig.of("llama", vocab_size=64, seq_length=16, hidden_size=32, num_layers=1,
                          num_heads=4, feed_forward="moe", moe=moe)  # fmt: skip
    with pytest.raises(ConfigError) as error:
        GPTModule(config, dpo=DPOConfig())
    line = str(error.value)
    assert "dpo with a mixture-of-experts model is not supported" in line and "\n" not in line


def test_copy_reference_holds_init_from(tmp_path: Path) -> None:
    """``dpo.reference='copy'`` starting from a model directory: the frozen copy holds the
    directory's weights (not the seeded initialisation), every one equal to the policy's as
    loaded, in its dtype, with no gradient."""
    save_random_llama(tmp_path)
    policy = _pipeline(ParallelState.single(), str(tmp_path))
    steps = PreferenceSteps(DPOConfig(reference="copy"), lora=False)
    steps.configure(llama_config(), policy, str(tmp_path))
    (copy,) = steps.copy
    mine = dict(policy.named_parameters())
    for name, param in copy.named_parameters():
        assert not param.requires_grad, f"the reference copy's {name} trains"
        assert param.dtype == mine[name].dtype, f"{name}: {param.dtype}, policy {mine[name].dtype}"
        assert torch.equal(param, mine[name]), f"the reference copy's {name} is not init_from's"


def test_default_reference(tmp_path: Path) -> None:
    assert DPOConfig().resolved_reference(lora=True) == "adapters", "LoRA: adapters off"
    assert DPOConfig().resolved_reference(lora=False) == "copy", "no LoRA: a frozen copy"
