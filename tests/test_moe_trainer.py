"""A mixture-of-experts GPT under a real Lightning Trainer: the real ``MegatronSPStrategy`` at
d = 2 with e = 2 (2 gloo ranks, float64) trains six AdamW steps exactly like one process on
the same global batches, with gradient clipping that bites (the logged pre-clip norm exceeds
the clip value at every step) and DeepSeek-V3's auxiliary-loss-free router bias, moved after
each optimizer step from the loads counted over both ranks: the weights of the step-3 and
step-6 checkpoints and every layer's bias (each rank's, after step 3) equal the one-process
run's to 1e-10, and the logged ``train/moe/load_imbalance`` and ``z_loss`` (global: counted
over both replicas) its values.

The auxiliary-loss-free setting is what makes one process on the whole batch the reference:
with no load-balancing or z-loss term in the objective and no capacity, a token's routing and
gradient do not depend on which micro-batch holds it (the data-parallel sampler deals the
global batch's rows to the replicas interleaved, so the micro-batches differ from one
process's). The losses' micro-batch scale under data and pipeline parallelism is
``tests/test_moe_pipeline.py``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_context_trainer import (
    STEPS,
    assert_same_steps,
    assert_same_tensors,
    fit,
    metrics,
    module,
)

from lightning_sp import GPTModule
from lightning_sp.checkpoint import read_full
from lightning_sp.model.moe.config import MoEConfig

from corpora import python_files
from models import relative_error

RTOL = 1e-10
CLIP = 0.5
"""``test_context_trainer.fit``'s ``gradient_clip_val``."""


class SaveExpertBiases(Callback):
    """After optimizer step ``step`` (the biases it moved included), writes every MoE layer's
    router bias (by global name) to ``<directory>/rank<r>.pt`` (the run may be a spawned
    process): what each rank holds."""

    def __init__(self, directory: Path, step: int) -> None:
        self.directory, self.step = directory, step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: GPTModule, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        biases = {}
        for chunk in pl_module.chunks:
            for name, buffer in chunk.named_buffers():
                if name.endswith("expert_bias"):
                    biases[chunk.global_name(name)] = buffer.detach().clone()
        self.directory.mkdir(exist_ok=True)
        torch.save(biases, self.directory / f"rank{trainer.global_rank}.pt")


def moe_module() -> GPTModule:
    """A tiny Llama (test_context_trainer's module) whose feed-forward is 4 experts of width
    24, sigmoid scores, top-2, the choice bias moved by 0.05 per step; no auxiliary loss."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=24, score="sigmoid",
                    expert_bias=True, bias_update_rate=0.05, router_dtype="fp64")  # fmt: skip
    return module("llama", feed_forward="moe", moe=moe)


EP_STEPS = 2 * STEPS
"""The d = 2, e = 2 run's steps (a checkpoint every ``STEPS``): test_moe_state resumes it from
its step-``STEPS`` checkpoint."""


def ep_run(root: Path) -> Path:
    """:func:`moe_module` trained ``EP_STEPS`` steps at d = 2 with e = 2 on ``root/corpus``:
    its logs and checkpoints in ``root/ep``, each rank's router biases after step ``STEPS`` in
    ``root/ep_bias``; returns ``root``."""
    corpus = python_files(root / "corpus")
    fit(root, "ep", corpus, moe_module(), EP_STEPS, devices=2, tensor_parallel_size=1,
        expert_parallel_size=2, callbacks=[SaveExpertBiases(root / "ep_bias", STEPS)])  # fmt: skip
    return root


@pytest.mark.slow
def test_moe_expert_parallel_trainer_steps_equal_one_process(
    tmp_path: Path, moe_ep_run: Path
) -> None:
    single = fit(tmp_path, "single", moe_ep_run / "corpus", moe_module(), EP_STEPS,
                 callbacks=[SaveExpertBiases(tmp_path / "single_bias", STEPS)])  # fmt: skip
    ep = metrics(moe_ep_run, "ep")  # the shared run (conftest.moe_ep_run)
    assert sorted(ep["train/loss"]) == list(range(EP_STEPS))
    norms = single["train/grad_norm"]
    assert all(norm > CLIP for norm in norms.values()), f"clipping does not bite: {norms}"
    assert_same_steps(ep["train/grad_norm"], norms, "d=2 e=2 gradient norm")
    assert_same_steps(ep["train/loss"], single["train/loss"], "d=2 e=2 loss")
    for key in ("train/moe/load_imbalance", "train/moe/z_loss"):
        assert sorted(ep[key]) == list(range(EP_STEPS)), key
        for step, value in ep[key].items():
            err = abs(value - single[key][step]) / abs(single[key][step])
            assert err <= 1e-6, f"{key} at step {step}: {value} vs {single[key][step]}"  # float32
    worst = 0.0
    for step in (STEPS, EP_STEPS):
        saved = read_full(moe_ep_run / "ep" / f"step={step}.ckpt")
        reference = read_full(tmp_path / "single" / f"step={step}.ckpt")
        assert assert_same_tensors(saved, reference, "model.", RTOL) > 10
        worst = max(
            worst,
            *(relative_error(saved[k].double(), reference[k].double())
              for k in reference if k.startswith("model.") and torch.is_tensor(reference[k])),
        )  # fmt: skip
    print(f"pre-clip norms {norms}; largest weight relative error {worst:.1e}")
    want = torch.load(tmp_path / "single_bias" / "rank0.pt")
    assert len(want) == 2 and all(b.abs().min() > 0 for b in want.values()), want
    for rank in (0, 1):
        got = torch.load(moe_ep_run / "ep_bias" / f"rank{rank}.pt")
        assert got.keys() == want.keys()
        for name, bias in got.items():
            assert torch.equal(bias, want[name]), f"rank {rank} {name}: {bias} vs {want[name]}"
