"""The strategy with modules other than GPTModule: Lightning's BoringModel as plain data
parallelism (weights broadcast, replicas equal at every step) or refused in one line, and
the custom tensor/sequence-parallel model of ``examples/custom_mlp.py`` against one float64
process."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

import lightning_sp  # noqa: F401  (registers megatron_sp)
from examples.custom_mlp import CustomMLPModule, ParallelMLP, regression_data
from lightning_sp import ConfigError, MegatronSPStrategy, ParallelState
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.testing.spawn import run_distributed
from lightning_sp.training.strategy import check_module

from models import relative_error

RTOL = 1e-10


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, t.detach().contiguous())
    return copies


class UnseededBoring(BoringModel):
    """BoringModel whose replicas start from different weights and buffers, as processes
    started without ``seed_everything`` do (spawn would otherwise pickle one init to all)."""

    def __init__(self) -> None:
        super().__init__()
        self.initial_differs: bool | None = None
        self.steps_checked = 0

    def configure_model(self) -> None:
        generator = torch.Generator().manual_seed(1000 + dist.get_rank())
        with torch.no_grad():
            self.layer.weight.copy_(torch.randn(self.layer.weight.shape, generator=generator))
        self.register_buffer("noise", torch.randn(3, generator=generator))
        self.initial_differs = not torch.equal(*_gather(self.layer.weight))

    def _assert_replicas_equal(self) -> None:
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            first, second = _gather(tensor)
            assert torch.equal(first, second), f"{name} differs across replicas"

    def on_train_start(self) -> None:
        assert self.initial_differs, "the replicas started equal: the test would prove nothing"
        self._assert_replicas_equal()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._assert_replicas_equal()
        self.steps_checked += 1

    def on_train_end(self) -> None:
        assert self.steps_checked == 5


def _trainer(devices: int, strategy: Any, tmp_path: Path | None = None, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=5,
        logger=CSVLogger(tmp_path, name="run", version=0) if tmp_path else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


@pytest.mark.slow
def test_boring_model_is_data_parallel_with_broadcast_weights() -> None:
    _trainer(2, "megatron_sp_spawn").fit(UnseededBoring())


@pytest.mark.slow
def test_boring_model_with_tensor_parallelism_is_refused_before_training() -> None:
    strategy = MegatronSPStrategy(tensor_parallel_size=2, start_method="spawn")
    with pytest.raises(Exception) as info:
        _trainer(2, strategy).fit(BoringModel())
    message = str(info.value)
    assert "tensor_parallel_size=2 needs a module that builds its own model-parallel shard" in (
        message
    )
    assert "BoringModel is a plain LightningModule" in message


def test_refusals_are_one_line_naming_the_class() -> None:
    for t, p, module, expected in (
        (2, 1, BoringModel(), r"^tensor_parallel_size=2 .* BoringModel is a plain"),
        (1, 2, BoringModel(), r"^pipeline_parallel_size=2 .* BoringModel is a plain"),
        (2, 2, CustomMLPModule(), r"^pipeline_parallel_size=2 but CustomMLPModule does not"),
    ):
        with pytest.raises(ConfigError, match=expected) as info:
            check_module(module, ParallelConfig(tensor_parallel_size=t, pipeline_parallel_size=p))
        assert "\n" not in str(info.value)
    check_module(BoringModel(), ParallelConfig())  # data parallelism: anything goes
    check_module(CustomMLPModule(), ParallelConfig(tensor_parallel_size=2))


# -- the custom model against one float64 process ------------------------------------------------


def _custom_parity_worker(rank: int, world_size: int) -> None:
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    x, y = (t[:4] for t in regression_data(samples=4, seq=8, hidden=32).tensors)
    reference = ParallelMLP(ParallelState.single(), sequence_parallel=False, dtype=torch.float64)
    ref_loss = reference(x.double(), y.double())
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    for sp in (True, False):
        model = ParallelMLP(state, sequence_parallel=sp, dtype=torch.float64)
        loss = model(x.double(), y.double())
        loss.backward()
        model.finalize_grads()
        assert relative_error(loss.detach(), ref_loss.detach()) <= RTOL, (sp, loss, ref_loss)
        for name, param in model.named_parameters():
            ref = ref_params[name]
            assert torch.equal(param.detach(), param.shard.full_slice(ref.detach(), param.shape))
            err = relative_error(param.grad, param.shard.full_slice(ref.grad, param.shape))
            assert err <= RTOL, f"t={world_size} sp={sp} {name}: gradient error {err:.3e}"


def test_custom_mlp_matches_one_float64_process() -> None:
    run_distributed(_custom_parity_worker, 2)


def _losses(tmp_path: Path) -> dict[int, float]:
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as fh:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(fh)}


@pytest.mark.slow
def test_custom_mlp_trains_at_t2_with_sp_like_one_process(tmp_path: Path) -> None:
    strategy = MegatronSPStrategy(tensor_parallel_size=2, start_method="spawn")
    _trainer(2, strategy, tmp_path / "tp").fit(CustomMLPModule())
    _trainer(1, "auto", tmp_path / "one").fit(CustomMLPModule())
    parallel, single = _losses(tmp_path / "tp"), _losses(tmp_path / "one")
    assert sorted(parallel) == sorted(single) == list(range(5))
    for step, loss in single.items():
        assert parallel[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    assert single[4] < single[0]
