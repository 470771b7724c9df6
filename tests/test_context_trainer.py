"""Context parallelism under a real Lightning Trainer: the strategy's ``context_parallel_size``
trains exactly like one process (float64, gloo), its checkpoints load at ``c = 1``, and the
monitors count what a CP rank holds and does.

One Trainer run per layout (each a spawn of 4 ranks), against one-process runs on the same
global batches (dropout 0, so every layout computes the same function):

* GPT-2 block at ``c = 2 x d = 2`` with the distributed optimizer (ZeRO-1 over d) and gradient
  clipping: per-step loss and gradient norm, and the weights and Adam state of its step-3
  checkpoint, equal the one-process run's; that checkpoint, loaded at ``c = 1``, holds the same
  weights and continues with the one-process run's losses.
* Llama block (RoPE, GQA, SwiGLU) at ``c = 2 x t = 2`` with sequence parallelism: per-step loss
  and gradient norm and the step-3 weights; the activation monitor's formula is the ``c = 2``
  one and the MFU monitor counts the whole sequence's FLOPs over the ``t·c·p·d`` ranks; and at
  ``c = 2 x p = 2`` (1F1B over two micro-batches: the stages pass CP shards) the same losses,
  norms and weights.
"""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_sp import ConfigError, GPTModule, MegatronSPStrategy, OptimizerConfig
from lightning_sp.callbacks.memory import ActivationMemoryMonitor
from lightning_sp.callbacks.throughput import MFUMonitor
from lightning_sp.checkpoint import Meta, read_full
from lightning_sp.data import TextDataModule
from lightning_sp.memory.flops import model_flops_per_iteration
from lightning_sp.memory.formulas import activation_bytes_per_layer
from lightning_sp.parallel.config import ParallelConfig

from models import layout_at, relative_error, tiny_config
from process_state import process_restored

RTOL = 1e-9
"""Float64 over three AdamW steps: one process and the CP layouts differ by the order of
their sums only (measured below 1e-12 on the losses)."""
GLOBAL_BATCH, STEPS = 4, 3


def module(architecture: str, **overrides: Any) -> GPTModule:
    """A tiny GPT-2 or Llama (tests/models.py) on the byte vocabulary, without dropout; the
    learning-rate schedule is fixed (``decay_steps``), not stretched to each run's max_steps."""
    config = tiny_config(architecture, vocab_size=257, **overrides)
    return GPTModule(config, OptimizerConfig(lr=3e-3, warmup_steps=1, min_lr=3e-4, decay_steps=10))


def fit(
    tmp_path: Path,
    name: str,
    corpus: Path,
    net: GPTModule,
    max_steps: int,
    devices: int = 1,
    callbacks: list[Callback] | None = None,
    ckpt_path: str | None = None,
    **strategy: Any,
) -> dict[str, dict[int, float]]:
    """Train ``net`` in float64 on ``devices`` ranks; ``{metric: {step: value}}`` as logged.
    The per-rank batch is the global batch over the data-parallel ranks. One rank runs in this
    process (the launcher starts no process for it: a spawned one costs seconds of imports),
    inside ``process_state.process_restored``; more are spawned."""
    d = devices // (
        strategy.get("tensor_parallel_size", 1) * strategy.get("context_parallel_size", 1)
        * strategy.get("pipeline_parallel_size", 1)
    )  # fmt: skip
    every_3 = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=3, save_top_k=-1,
                              filename="{step}")  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, precision="64-true", max_steps=max_steps,
        strategy=MegatronSPStrategy(start_method="spawn" if devices > 1 else "popen", **strategy),
        logger=CSVLogger(tmp_path, name=name, version=0), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, gradient_clip_val=0.5, callbacks=[every_3, *(callbacks or [])],
    )  # fmt: skip
    data = TextDataModule(paths=str(corpus), seq_length=net.config.seq_length,
                          batch_size=GLOBAL_BATCH // d, val_fraction=0.1)  # fmt: skip
    with contextlib.ExitStack() as stack:
        if devices == 1:
            stack.enter_context(process_restored())
        trainer.fit(net, data, ckpt_path=ckpt_path)
    return metrics(tmp_path, name)


def metrics(tmp_path: Path, name: str) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` as :func:`fit`'s run ``name`` logged them."""
    with open(tmp_path / name / "version_0" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    return {
        key: {int(r["step"]): float(r[key]) for r in rows if r.get(key)}
        for key in rows[0]
        if key != "step"
    }


def assert_same_steps(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert set(got) <= set(want) and got, f"{what}: steps {sorted(got)} vs {sorted(want)}"
    for step, value in got.items():
        err = abs(value - want[step]) / abs(want[step])
        assert err <= RTOL, f"{what} at step {step}: {value!r} vs {want[step]!r} ({err:.1e})"


def assert_same_tensors(
    got: dict[str, Any], want: dict[str, Any], prefix: str, rtol: float = RTOL
) -> int:
    """Every ``prefix`` tensor of two checkpoints' full states agrees to ``rtol``; returns how
    many."""
    keys = {k for k in want if k.startswith(prefix) and torch.is_tensor(want[k])}
    assert keys and keys == {k for k in got if k.startswith(prefix) and torch.is_tensor(got[k])}
    errors = {key: relative_error(got[key].double(), want[key].double()) for key in keys}
    wrong = {k: f"{e:.1e}" for k, e in sorted(errors.items()) if not e <= rtol}
    assert not wrong, f"{len(wrong)} of {len(keys)} tensors differ (relative error): {wrong}"
    return len(keys)


class HoldsCheckpointWeights(Callback):
    """At the start of training every weight equals the checkpoint's (loaded, not re-made);
    writes how many it compared to ``report`` (the run is a spawned process)."""

    def __init__(self, full: dict[str, Any], report: Path) -> None:
        self.full, self.report = full, report

    def on_train_start(self, trainer: L.Trainer, pl_module: GPTModule) -> None:
        checked = 0
        for chunk in pl_module.chunks:
            for name, param in chunk.named_parameters():
                want = self.full[f"model.{chunk.global_name(name)}"]
                assert torch.equal(param.detach()[: want.shape[0]], want), name
                checked += 1
        self.report.write_text(str(checked))


@pytest.mark.slow
def test_gpt2_context_and_data_parallel_with_zero1_equals_one_process_and_reshards(
    tmp_path: Path, corpus: Path
) -> None:
    single = fit(tmp_path, "single", corpus, module("gpt2"), STEPS + 2)
    cp = fit(tmp_path, "cp", corpus, module("gpt2"), STEPS, devices=4, tensor_parallel_size=1,
             context_parallel_size=2, distributed_optimizer=True, bucket_size=3000)  # fmt: skip
    assert sorted(cp["train/loss"]) == list(range(STEPS))
    assert_same_steps(cp["train/loss"], single["train/loss"], "c=2 x d=2 loss")
    assert_same_steps(cp["train/grad_norm"], single["train/grad_norm"], "c=2 x d=2 grad norm")
    assert max(single["train/grad_norm"].values()) > 0.5, "clipping never acted"
    saved = read_full(tmp_path / "cp" / f"step={STEPS}.ckpt")
    reference = read_full(tmp_path / "single" / f"step={STEPS}.ckpt")
    assert Meta.read(tmp_path / "cp" / f"step={STEPS}.ckpt").layout.context_parallel_size == 2
    assert assert_same_tensors(saved, reference, "model.") > 10
    assert assert_same_tensors(saved, reference, "optim.") > 10

    # the c = 2 x d = 2 checkpoint (ZeRO-1 shards) loaded by one process: the same weights,
    # and training continues as the one-process run did
    holds = HoldsCheckpointWeights(saved, tmp_path / "checked.txt")
    resumed = fit(tmp_path, "resumed", corpus, module("gpt2"), STEPS + 2, callbacks=[holds],
                  ckpt_path=str(tmp_path / "cp" / f"step={STEPS}.ckpt"))  # fmt: skip
    assert int((tmp_path / "checked.txt").read_text()) > 10
    assert sorted(resumed["train/loss"]) == [STEPS, STEPS + 1]
    assert_same_steps(resumed["train/loss"], single["train/loss"], "resumed at c=1")


@pytest.mark.slow
def test_llama_context_with_tensor_or_pipeline_parallel_equals_one_process_and_monitors(
    tmp_path: Path, corpus: Path
) -> None:
    single = fit(tmp_path, "single", corpus, module("llama", sequence_parallel=True), STEPS)
    monitors = [ActivationMemoryMonitor(), MFUMonitor(peak_flops_per_device=1e12, window_size=2)]
    net = module("llama", sequence_parallel=True)
    cp = fit(tmp_path, "cp", corpus, net, STEPS, devices=4, callbacks=monitors,
             tensor_parallel_size=2, context_parallel_size=2)  # fmt: skip
    assert sorted(cp["train/loss"]) == list(range(STEPS))
    assert_same_steps(cp["train/loss"], single["train/loss"], "c=2 x t=2 loss")
    assert_same_steps(cp["train/grad_norm"], single["train/grad_norm"], "c=2 x t=2 grad norm")
    saved = read_full(tmp_path / "cp" / f"step={STEPS}.ckpt")
    reference = read_full(tmp_path / "single" / f"step={STEPS}.ckpt")
    assert assert_same_tensors(saved, reference, "model.") > 10

    # rank 0's monitors: the formula of a c = 2, t = 2 rank holding s/c of the batch's s tokens
    config = net.config
    shape = config.activation_shape(layout_at(2, c=2), GLOBAL_BATCH, activation_bytes=8)
    formula = activation_bytes_per_layer(shape, config.layer_recompute(0))
    assert set(cp["memory/activation_bytes_per_layer_formula"].values()) == {formula}
    ratios = cp["memory/activation_bytes_ratio"].values()
    assert all(r == pytest.approx(1.0, abs=0.1) for r in ratios), ratios
    # model FLOPs per device per token: the whole sequence's FLOPs over all 4 ranks
    per_token = (
        model_flops_per_iteration(config, GLOBAL_BATCH) / 4 / (GLOBAL_BATCH * config.seq_length)
    )
    rates = zip(
        cp["throughput/model_tflops_per_sec"].items(),
        cp["throughput/tokens_per_sec"].items(),
        strict=True,
    )
    assert cp["throughput/model_tflops_per_sec"], "MFUMonitor logged nothing"
    for (step, tflops), (_, tokens) in rates:
        assert tflops * 1e12 / tokens == pytest.approx(per_token, rel=1e-6), step

    # the pipeline passes CP shards: c = 2 x p = 2 (1F1B, two micro-batches) is the same run
    pp = fit(tmp_path, "pp", corpus, module("llama", sequence_parallel=True), STEPS, devices=4,
             pipeline_parallel_size=2, context_parallel_size=2, num_microbatches=2)  # fmt: skip
    assert sorted(pp["train/loss"]) == list(range(STEPS))
    assert_same_steps(pp["train/loss"], single["train/loss"], "c=2 x p=2 loss")
    assert_same_steps(pp["train/grad_norm"], single["train/grad_norm"], "c=2 x p=2 grad norm")
    saved = read_full(tmp_path / "pp" / f"step={STEPS}.ckpt")
    assert assert_same_tensors(saved, reference, "model.") > 10


def test_sequence_must_split_into_2c_chunks() -> None:
    with pytest.raises(ConfigError, match=r"^model.config.seq_length=18 is not a multiple of 4 "
                       r"\(context_parallel_size=2 cuts each sequence into 4 chunks\); "
                       r"use e.g. 16 or 20$"):  # fmt: skip
        ParallelConfig(context_parallel_size=2).check_sequence_length(18, False)
    with pytest.raises(ConfigError, match=r"seq_length=20 is not a multiple of 8 .* over "
                       r"tensor_parallel_size=4\); use e.g. 16 or 24$"):  # fmt: skip
        ParallelConfig(tensor_parallel_size=4, context_parallel_size=2).check_sequence_length(
            20, True
        )
    ParallelConfig(tensor_parallel_size=4, context_parallel_size=2).check_sequence_length(
        20, False
    )  # without SP: 2c = 4 divides
    with pytest.raises(ConfigError, match=r"^context_parallel_size=0 must be a positive integer"):
        MegatronSPStrategy(context_parallel_size=0)


def test_context_parallel_needs_a_module_that_shards_its_batches() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_sp.training.protocol import check_module

    with pytest.raises(ConfigError, match=r"^context_parallel_size=2 needs a module that builds"):
        check_module(BoringModel(), ParallelConfig(context_parallel_size=2))
    custom = module("gpt2")
    custom.supports_context_parallel = False  # e.g. examples/custom_mlp.py: it does not shard
    with pytest.raises(ConfigError, match=r"^context_parallel_size=2 but GPTModule does not"):
        check_module(custom, ParallelConfig(context_parallel_size=2))
    check_module(module("gpt2"), ParallelConfig(context_parallel_size=2))
