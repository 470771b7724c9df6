"""The callbacks in a real ``lightning.Trainer`` run on CPU.

A tiny bf16 GPT (2-byte activations, 1-byte dropout masks) trains for three steps; the
ActivationMemoryMonitor's measured bytes per layer must equal Table 2 within 1% (LayerNorm's
fp32 mean/rstd, 16·s·b bytes per layer, are what the paper leaves out), and the MFUMonitor
must log positive finite rates with hfu >= mfu. No wall-clock time is asserted.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.callbacks.memory import ActivationMemoryMonitor
from lightning_sp.callbacks.progress import ProgressBar, si_format
from lightning_sp.callbacks.throughput import MFUMonitor
from lightning_sp.memory.flops import (
    causal_half_model_flops_per_iteration,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
)
from lightning_sp.memory.formulas import activation_bytes_per_layer
from lightning_sp.model.shape import ActivationShape

S, B, H, A, LAYERS, VOCAB = 64, 2, 64, 4, 2, 256
STEPS = 3
PEAK = 1e12  # FLOP/s given to the MFUMonitor, so no measurement runs

MEMORY_METRICS = [
    "memory/activation_bytes_per_layer",
    "memory/activation_bytes_per_layer_formula",
    "memory/activation_bytes_ratio",
    "memory/activation_bytes_total",
]
THROUGHPUT_METRICS = [
    "throughput/tokens_per_sec",
    "throughput/model_tflops_per_sec",
    "throughput/hardware_tflops_per_sec",
    "throughput/mfu",
    "throughput/hfu",
    "throughput/model_tflops_per_sec_causal_half",
    "throughput/mfu_causal_half",
]


class RandomTokens(Dataset):
    """``length`` samples ``{"input_ids": [S], "labels": [S]}`` of seeded random tokens."""

    def __init__(self, length: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (length, S + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.tokens[index]
        return {"input_ids": row[:-1], "labels": row[1:]}


class TinyGPTModule(L.LightningModule):
    def __init__(self, recompute: str = "none", fail_at_step: int | None = None) -> None:
        super().__init__()
        self.config = GPTConfig(
            vocab_size=VOCAB, seq_length=S, hidden_size=H, num_layers=LAYERS, num_heads=A,
            hidden_dropout=0.1, attention_dropout=0.1, recompute=recompute,  # type: ignore[arg-type]
        )  # fmt: skip
        self.fail_at_step = fail_at_step

    def configure_model(self) -> None:
        if not hasattr(self, "gpt"):
            self.gpt = GPT(self.config, ParallelState.single(), dtype=torch.bfloat16)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise RuntimeError("boom")
        loss = self.gpt(batch["input_ids"], batch["labels"])
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(B * STEPS), batch_size=B)


class ReadCountingTrainer(L.Trainer):
    """Counts reads of ``progress_bar_metrics`` (each converts the logged tensors to Python
    numbers: a host-device synchronisation on CUDA)."""

    reads = 0

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        self.reads += 1
        return super().progress_bar_metrics


def _fit(
    module: L.LightningModule, tmp_path: Path, callbacks: list[L.Callback], **kwargs: object
) -> L.Trainer:
    options: dict[str, object] = dict(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=CSVLogger(tmp_path),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    options.update(kwargs)
    trainer = ReadCountingTrainer(**options)  # type: ignore[arg-type]
    trainer.fit(module)
    return trainer


def _csv_rows(trainer: L.Trainer) -> list[dict[str, str]]:
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


def _logged_values(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(row[name]) for row in rows if row.get(name)]


@pytest.mark.parametrize("recompute", ["none", "selective", "lean", "full"])
def test_monitors_in_a_real_trainer(recompute: str, tmp_path: Path) -> None:
    memory = ActivationMemoryMonitor()
    mfu = MFUMonitor(peak_flops_per_device=PEAK, window_size=2)
    module = TinyGPTModule(recompute)
    trainer = _fit(module, tmp_path, [memory, mfu])
    assert trainer.global_step == STEPS

    # activation memory: measured per layer == Table 2 within 1%
    expected = activation_bytes_per_layer(ActivationShape(S, B, H, A), recompute)
    assert memory.last_formula == expected
    assert len(memory.last_per_layer) == LAYERS
    for layer, got in enumerate(memory.last_per_layer):
        assert got == pytest.approx(expected, rel=0.01), (
            f"{recompute} layer {layer}: measured {got / (S * B * H):.4f} sbh, "
            f"Table 2 {expected / (S * B * H):.4f} sbh"
        )
    assert memory.last_total is not None and memory.last_total > sum(memory.last_per_layer)
    assert not memory.is_tracking  # the tracker was left before backward

    rows = _csv_rows(trainer)
    for name in MEMORY_METRICS:
        assert name in trainer.callback_metrics, name
        assert len(_logged_values(rows, name)) == STEPS, name
    ratio = float(trainer.callback_metrics["memory/activation_bytes_ratio"])
    assert ratio == pytest.approx(1.0, abs=0.01)
    assert "memory/peak_allocated_bytes" not in trainer.callback_metrics  # CUDA only

    # throughput: window 2 -> rates from the second step on
    for name in THROUGHPUT_METRICS:
        assert name in trainer.callback_metrics, name
        values = _logged_values(rows, name)
        assert len(values) == STEPS - 1, name
        assert all(math.isfinite(v) and v > 0 for v in values), (name, values)
    last = mfu.last_metrics
    model_flops = model_flops_per_iteration(module.config, B)
    hardware_flops = hardware_flops_per_iteration(module.config, B)
    assert last["hfu"] >= last["mfu"]
    assert last["hfu"] / last["mfu"] == pytest.approx(hardware_flops / model_flops, rel=1e-6)
    if recompute == "full":
        assert last["hfu"] > 1.2 * last["mfu"]
    elif recompute == "selective":
        assert last["hfu"] > last["mfu"]
    # mfu = per-device model FLOP/s / peak; tokens/s and FLOP/s describe the same steps
    assert last["mfu"] == pytest.approx(last["model_tflops_per_sec"] * 1e12 / PEAK, rel=1e-6)
    assert last["model_tflops_per_sec"] * 1e12 == pytest.approx(
        last["tokens_per_sec"] * model_flops / (B * S), rel=1e-6
    )
    # mfu counts attention whole; mfu_causal_half counts causal attention's cores at half
    half = causal_half_model_flops_per_iteration(module.config, B) / model_flops
    assert half < 1, "the tiny model is causal: halving its attention cores lowers the count"
    assert last["mfu_causal_half"] == pytest.approx(last["mfu"] * half, rel=1e-6), (
        "mfu_causal_half is not mfu in Megatron-LM's convention"
    )
    assert last["model_tflops_per_sec_causal_half"] == pytest.approx(
        last["model_tflops_per_sec"] * half, rel=1e-6
    )


def test_log_every_n_steps_and_measured_peak(tmp_path: Path) -> None:
    """Measure on steps 0 and 2 only; the CPU peak is measured once when training starts.

    (Lightning keeps an ``on_step`` value for the rest of the epoch, so the CSV repeats the
    step-0 measurement at step 1; which steps were measured is seen through the hook.)
    """
    measured_steps: list[int] = []

    class Spy(ActivationMemoryMonitor):
        def _record(self, pl_module, report, b, s):  # type: ignore[no-untyped-def]
            measured_steps.append(pl_module.global_step)
            return super()._record(pl_module, report, b, s)

    memory = Spy(log_every_n_steps=2, prog_bar=False)
    mfu = MFUMonitor(window_size=2, log_every_n_steps=2)
    trainer = _fit(TinyGPTModule("selective"), tmp_path, [memory, mfu])
    rows = _csv_rows(trainer)
    assert measured_steps == [0, 2]
    assert "memory/activation_bytes_per_layer" in trainer.callback_metrics
    assert [int(r["step"]) for r in rows if r.get("throughput/mfu")] == [2]
    assert mfu.peak_flops_per_device is not None
    assert math.isfinite(mfu.peak_flops_per_device) and mfu.peak_flops_per_device > 0
    assert mfu.last_metrics["hfu"] > mfu.last_metrics["mfu"] > 0


def test_tracker_is_left_when_training_step_raises(tmp_path: Path) -> None:
    memory = ActivationMemoryMonitor()
    hooks_before = torch._C._autograd._top_saved_tensors_default_hooks(False)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(TinyGPTModule("none", fail_at_step=1), tmp_path, [memory])
    assert not memory.is_tracking
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks_before
    assert len(memory.last_per_layer) == LAYERS  # step 0 was measured


def test_monitor_needs_a_gpt_attribute(tmp_path: Path) -> None:
    class NoGPT(TinyGPTModule):
        def configure_model(self) -> None:
            self.net = torch.nn.Linear(1, 1)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(torch.ones(1)).sum()

    with pytest.raises(AttributeError, match="gpt"):
        _fit(NoGPT(), tmp_path, [ActivationMemoryMonitor()])


@pytest.mark.parametrize("peak", [0.0, -1e12, float("nan"), float("inf")])
def test_mfu_peak_must_be_finite_and_positive(peak: float) -> None:
    try:
        MFUMonitor(peak_flops_per_device=peak)
    except ValueError as error:  # ConfigError: one line
        want = (
            f"peak_flops_per_device={peak!r} must be a finite number > 0 (FLOP/s of one device; "
            "null: measured)"
        )
        assert str(error) == want, f"peak_flops_per_device={peak!r}: {error} (expected: {want})"
    else:
        pytest.fail(f"peak_flops_per_device={peak!r} accepted: MFU would be logged as 0 or nan")


def test_progress_bar_shows_short_names_and_units_and_reads_on_logging_steps(
    tmp_path: Path,
) -> None:
    """6 steps, logging every 3: the bar reads the logged metrics twice (after steps 0 and 3),
    not once per step; it shows formatted items; the loggers keep the raw metrics."""
    bar = ProgressBar()
    memory = ActivationMemoryMonitor()
    mfu = MFUMonitor(peak_flops_per_device=PEAK, window_size=2)
    module = TinyGPTModule("selective")
    trainer = _fit(
        module, tmp_path, [bar, memory, mfu], max_steps=6, log_every_n_steps=3,
        enable_progress_bar=True,
    )  # fmt: skip
    assert isinstance(trainer, ReadCountingTrainer)
    assert trainer.reads == 2
    items = bar.get_metrics(trainer, module)  # after fit: off the hot path, read again
    assert re.fullmatch(r"\d+\.\d{3}", items["loss"]), items
    sbh = S * B * H
    paper = activation_bytes_per_layer(ActivationShape(S, B, H, A), "selective") / sbh
    assert items["act"].endswith(f"sbh (paper {paper:.1f})"), items
    assert re.fullmatch(r"\d+%", items["MFU"]), items
    assert re.fullmatch(r"\d+(\.\d+)?[kMG]?", items["tok/s"]), items
    assert not any(key.startswith(("memory/", "throughput/", "train/")) for key in items), items
    rows = _csv_rows(trainer)
    for name in ("memory/activation_bytes_per_layer", "throughput/mfu", "train/loss"):
        assert _logged_values(rows, name), name  # raw numbers reach the logger


def test_mfu_bar_items_are_percent_and_tokens_per_second() -> None:
    """The MFU monitor's bar items from its last metrics: MFU 0.384 shows as 38%, 12345
    tokens/s as 12.3k (not the TFLOP/s); nothing before the window is full or with prog_bar
    off."""
    mfu = MFUMonitor(peak_flops_per_device=PEAK)
    assert mfu.progress_bar_items() == {}, "items before the first measurement"
    mfu.last_metrics = {"mfu": 0.384, "tokens_per_sec": 12345.0, "model_tflops_per_sec": 7.5}
    items = mfu.progress_bar_items()
    assert items == {"MFU": "38%", "tok/s": "12.3k"}, f"bar items {items}, expected MFU 38%, 12.3k"
    quiet = MFUMonitor(peak_flops_per_device=PEAK, prog_bar=False)
    quiet.last_metrics = mfu.last_metrics
    assert quiet.progress_bar_items() == {}, "prog_bar=False still offers bar items"


def test_si_format() -> None:
    assert [si_format(v) for v in (12345.0, 999.0, 2.5e6, 0.5)] == ["12.3k", "999", "2.5M", "0.5"]
