"""(4) Training throughput, MFU and peak memory: ``MegatronSPStrategy`` + ``GPTModule`` vs
Lightning's ``ModelParallelStrategy`` with the DTensor GPT, same model, layout and data.

Each strategy trains in its own fresh pair of processes (so peak RSS is its own), started the
same way for both: as externally launched ranks (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` set, as torchrun does), and each strategy initialises its own
process group with a timeout. ``ModelParallelStrategy`` has only the re-run-the-script launcher
(``_SubprocessScriptLauncher``), which from inside ``python -m benchmarks.run`` would make
rank 1 run the whole benchmark; external launch avoids that and treats both strategies alike.

Both runs: 2 CPU ranks (one intra-op thread each), tensor parallel t=2 with sequence
parallelism, the same recompute policy, fp32, the same weights (the DTensor model loads our
seeded initialisation), the same batches (:class:`lightning_sp.data.TextDataModule` over a
fixed sample of the standard library, byte-level), the same AdamW and learning-rate schedule.
A callback times every training step (``on_train_batch_start`` -> ``on_train_batch_end``:
forward, backward, gradient reductions, optimizer step, the slower rank's time) and what
other processes used of the machine meanwhile (:mod:`benchmarks._cpu`); a run stops once
``steps`` clean steps follow the warm-up, or after ``max_tries * steps``. Each strategy runs
twice, in the order of :data:`ORDER` (ABBA), since the machine's speed drifts over tens of
seconds even when it is idle; tokens/s is the global batch's tokens over the median of both
runs' least disturbed steps; the ratio of the two has a 95% bootstrap confidence interval.
MFU is the paper's model FLOPs per step
(:func:`lightning_sp.memory.flops.model_flops_per_iteration`) per second over the machine's
peak: the sum over ranks of :func:`lightning_sp.memory.flops.measure_peak_flops` (the best of
a few rounds before and after the
training runs), measured in the same run with both ranks multiplying at once, one thread each,
as in training.

Memory: peak RSS per rank (``ru_maxrss``) and its growth from the ``setup`` hook (before the
model exists) to the peak, in the timed runs (glibc's default malloc, what a user gets on
CPU), and again in short runs in which every allocation of 128 KiB or more is ``mmap``ed and
returned when freed (``mallopt(M_MMAP_THRESHOLD)``), so that RSS follows the live tensors
rather than the heap's high-water mark.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import resource
import socket
import statistics
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from benchmarks import _cpu
from benchmarks._fit import gpt_config
from benchmarks._format import fixed, pct, table
from benchmarks._stats import ratio_of_medians_ci
from lightning_sp import GPT, GPTConfig, GPTModule, MegatronSPStrategy, OptimizerConfig
from lightning_sp.data import TextDataModule
from lightning_sp.memory.flops import (
    hardware_flops_per_iteration,
    measure_peak_flops,
    model_flops_per_iteration,
)
from lightning_sp.optim.adamw import configure_adamw
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing import dtensor_gpt
from lightning_sp.testing.spawn import run_distributed

TIMEOUT_SECONDS = 300.0
STRATEGIES = ("ours", "lightning_model_parallel")


@dataclasses.dataclass(frozen=True)
class ThroughputShape:
    """The model and run measured."""

    s: int = 512
    b: int = 4
    h: int = 768
    a: int = 12
    layers: int = 4
    vocab: int = 512
    recompute: str = "selective"
    sequence_parallel: bool = True
    t: int = 2
    warmup_steps: int = 2
    steps: int = 5
    """Clean steps wanted after the warm-up, per run (each strategy runs twice; the median is
    over both runs' steps)."""
    max_tries: float = 1.6
    """At most ``warmup_steps + max_tries * steps`` steps per run, clean or not (bounds the
    time on a busy machine)."""
    max_documents: int = 60


FULL = ThroughputShape()
SMOKE = ThroughputShape(
    s=64, b=2, h=64, a=4, layers=2, warmup_steps=1, steps=1, max_tries=1, max_documents=4
)


def model_config(shape: ThroughputShape) -> GPTConfig:
    return gpt_config(shape.vocab, shape.s, shape.h, shape.layers, shape.a, shape.recompute,
                      sequence_parallel=shape.sequence_parallel)  # fmt: skip


OPTIMIZER = OptimizerConfig(lr=3e-4, warmup_steps=2, min_lr=3e-5)


class DTensorGPTModule(L.LightningModule):
    """The DTensor GPT under ``ModelParallelStrategy``: parallelised in ``configure_model`` on
    the strategy's ``"tensor_parallel"`` mesh, loss and its backward under ``loss_parallel``,
    the same AdamW and schedule as :class:`lightning_sp.GPTModule`."""

    def __init__(self, config: GPTConfig, optimizer: OptimizerConfig) -> None:
        super().__init__()
        self.config = config
        self.optimizer_config = optimizer
        self.model: dtensor_gpt.DTensorGPT | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = dtensor_gpt.DTensorGPT(self.config)
        # our seeded, layout-independent initialisation: both runs train the same weights
        reference = GPT(self.config, ParallelState.single(), dtype=torch.float32)
        dtensor_gpt.load_from_lightning_sp(model, reference.state_dict())
        del reference
        assert self.device_mesh is not None  # ModelParallelStrategy sets it before this hook
        dtensor_gpt.parallelize(
            model, self.device_mesh["tensor_parallel"], self.config.sequence_parallel
        )
        self.model = model

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        return self.model(batch["input_ids"], batch["labels"])

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        with loss_parallel():
            loss.backward(*args, **kwargs)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        assert self.model is not None  # the same AdamW and schedule as GPTModule
        return configure_adamw(self.model, self.optimizer_config, self.trainer.max_steps)


class StepTimer(Callback):
    """Wall time of every training step, other processes' CPU share during it, its loss, and
    this rank's memory. Stops training once ``clean_steps`` clean steps follow the warm-up.

    The stop decision depends only on all-reduced values, so every rank stops at the same step.
    """

    def __init__(self, warmup_steps: int, clean_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.clean_steps = clean_steps
        self.step_seconds: list[float] = []
        self.foreign_shares: list[float] = []
        self.losses: list[float] = []
        self.rss_at_setup = 0
        self._before = (0.0, 0.0, 0.0)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.rss_at_setup = 1024 * _cpu.rss_kib("VmRSS")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._before = _cpu.sample()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        after = _cpu.sample()
        self.step_seconds.append(after[0] - self._before[0])
        self.foreign_shares.append(_cpu.foreign_share(self._before, after))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, DTensor):
            loss = loss.to_local()
        self.losses.append(float(loss.detach()))
        measured = self.foreign_shares[self.warmup_steps :]
        if sum(share < _cpu.CLEAN_SHARE for share in measured) >= self.clean_steps:
            trainer.should_stop = True


LIVE_MEMORY_MMAP_THRESHOLD = 128 * 1024
"""Allocations of at least this many bytes are ``mmap``ed in the live-memory runs."""


def _train_worker(
    rank: int,
    world_size: int,
    which: str,
    shape: ThroughputShape,
    port: int,
    cache: str,
    mmap_threshold: int | None = None,
) -> dict[str, Any]:
    mmapped = mmap_threshold is not None and _cpu.malloc_mmap_from(mmap_threshold)
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    warnings.filterwarnings("ignore")
    config = model_config(shape)
    timeout = datetime.timedelta(seconds=TIMEOUT_SECONDS)
    if which == "ours":
        strategy: Any = MegatronSPStrategy(
            tensor_parallel_size=shape.t,
            timeout=TIMEOUT_SECONDS,
            start_method="spawn",
        )
        module: L.LightningModule = GPTModule(config, OPTIMIZER)
    else:
        strategy = ModelParallelStrategy(
            tensor_parallel_size=shape.t, data_parallel_size=world_size // shape.t, timeout=timeout
        )
        module = DTensorGPTModule(config, OPTIMIZER)
    data = TextDataModule(
        seq_length=shape.s, batch_size=shape.b, val_fraction=0.05,
        max_documents=shape.max_documents, seed=1234, cache_dir=cache,
    )  # fmt: skip
    timer = StepTimer(shape.warmup_steps, shape.steps)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, num_nodes=1, strategy=strategy,
        precision="32-true",
        max_steps=shape.warmup_steps + max(shape.steps, round(shape.max_tries * shape.steps)),
        logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(module, data)
    result = {
        "step_seconds": timer.step_seconds,
        "foreign_shares": timer.foreign_shares,
        "losses": timer.losses,
        "rss_at_fit_start": timer.rss_at_setup,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(),
        "large_allocations_mmapped": mmapped,
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def _peak_worker(rank: int, world_size: int, seconds: float, rounds: int) -> float:
    """The best of ``rounds`` GEMM-rate measurements, all ranks multiplying at once with one
    thread each, as in training (the best, since other processes only ever slow it down)."""
    best = 0.0
    for _ in range(rounds):
        dist.barrier()
        best = max(best, measure_peak_flops(dtype=torch.float32, size=1024, seconds=seconds))
    return best


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


ORDER = ("ours", "lightning_model_parallel", "lightning_model_parallel", "ours")
"""Training runs, in this order (ABBA: a drift of the machine's speed that is linear in time
hits both strategies alike)."""


def _train(
    which: str, shape: ThroughputShape, cache_dir: str, mmap_threshold: int | None = None
) -> list[dict[str, Any]]:
    return run_distributed(
        _train_worker, shape.t, which, shape, _free_port(), cache_dir, mmap_threshold,
        init_group=False, start_method="fork", held_groups=True,  # DTensor's (spawn.py)
    )  # fmt: skip


def _memory(runs: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Peak RSS of any rank in any of ``runs`` and the largest growth of a rank's RSS from
    before its model existed to its peak."""
    ranks = [rank for run in runs for rank in run]
    return {
        "peak_rss": float(max(r["peak_rss"] for r in ranks)),
        "rss_growth": float(max(r["peak_rss"] - r["rss_at_fit_start"] for r in ranks)),
    }


def run(
    shape: ThroughputShape,
    cache_dir: str | Path,
    peak_seconds: float = 0.5,
    peak_rounds: int = 2,
) -> dict[str, Any]:
    """Train with both strategies (:data:`ORDER`); tokens/s, MFU, HFU, peak RSS per rank, and
    their ratios. The GEMM peak is measured before and after the training runs (the best)."""
    config = model_config(shape)
    cache = str(cache_dir)
    args = (_peak_worker, shape.t, peak_seconds, peak_rounds)
    peaks = [run_distributed(*args, start_method="fork")]
    segments: dict[str, list[list[dict[str, Any]]]] = {which: [] for which in STRATEGIES}
    for which in ORDER:
        segments[which].append(_train(which, shape, cache))
    peaks.append(run_distributed(*args, start_method="fork"))
    peak_per_rank = [max(values) for values in zip(*peaks, strict=True)]
    peak = float(sum(peak_per_rank))
    tokens_per_step = shape.b * shape.s
    model_flops = model_flops_per_iteration(config, shape.b)
    hardware_flops = hardware_flops_per_iteration(config, shape.b)
    runs: dict[str, Any] = {}
    for which in STRATEGIES:
        measured: list[tuple[float, float]] = []  # (seconds of the slower rank, others' share)
        step_seconds = []
        for ranks in segments[which]:
            steps = [max(t) for t in zip(*(r["step_seconds"] for r in ranks), strict=True)]
            pairs = list(zip(steps, ranks[0]["foreign_shares"], strict=True))
            step_seconds.append(steps)
            measured += pairs[shape.warmup_steps :]
        wanted = shape.steps * len(segments[which])
        used = sorted(measured, key=lambda step: step[1])[:wanted]  # the least disturbed
        median = statistics.median(seconds for seconds, _ in used)
        runs[which] = {
            "step_seconds": step_seconds,
            "foreign_shares": [ranks[0]["foreign_shares"] for ranks in segments[which]],
            "steps_used": len(used),
            "used_step_seconds": [seconds for seconds, _ in used],
            "steps_run": sum(len(steps) for steps in step_seconds),
            "others_max_share": max(share for _, share in used),
            "median_step_seconds": median,
            "tokens_per_second": tokens_per_step / median,
            "model_flops_per_second": model_flops / median,
            "mfu": model_flops / median / peak,
            "hfu": hardware_flops / median / peak,
            **_memory(segments[which]),
            "losses": segments[which][0][0]["losses"],
            "threads_per_rank": segments[which][0][0]["threads"],
        }
    # peak memory again, with large allocations mmapped: RSS then follows the live tensors
    # rather than the heap's high-water mark (a few steps suffice: the peak is in the second)
    memory_shape = dataclasses.replace(shape, warmup_steps=2, steps=1, max_tries=1)
    for which in STRATEGIES:
        ranks = _train(which, memory_shape, cache, LIVE_MEMORY_MMAP_THRESHOLD)
        runs[which]["live_memory"] = {
            "mmap_threshold": LIVE_MEMORY_MMAP_THRESHOLD,
            "applied": all(r["large_allocations_mmapped"] for r in ranks),
            "steps": len(ranks[0]["step_seconds"]),
            **_memory([ranks]),
        }
    ours, theirs = runs["ours"], runs["lightning_model_parallel"]
    ratio = ratio_of_medians_ci(theirs["used_step_seconds"], ours["used_step_seconds"])
    return {
        "shape": dataclasses.asdict(shape),
        "dtype": "float32",
        "order": list(ORDER),
        "tokens_per_step": tokens_per_step,
        "model_flops_per_step": model_flops,
        "hardware_flops_per_step": hardware_flops,
        "peak_flops_per_rank": peak_per_rank,
        "peak_flops": peak,
        "runs": runs,
        "tokens_per_second_ratio": ratio[0],
        "tokens_per_second_ratio_ci": list(ratio[1:]),
        "peak_rss_ratio": ours["peak_rss"] / theirs["peak_rss"],
        "training_rss_ratio": ours["rss_growth"] / theirs["rss_growth"],
        "live_peak_rss_ratio": ours["live_memory"]["peak_rss"] / theirs["live_memory"]["peak_rss"],
        "live_training_rss_ratio": ours["live_memory"]["rss_growth"]
        / theirs["live_memory"]["rss_growth"],
    }


def markdown(section: dict[str, Any]) -> str:
    """One table: step time, tokens/s, MFU / HFU and memory per rank for both strategies."""
    names = {
        "ours": "`MegatronSPStrategy` + `GPTModule`",
        "lightning_model_parallel": "`ModelParallelStrategy` + DTensor GPT",
    }
    header = [
        "strategy", "step s", "tokens/s", "MFU", "HFU", "peak RSS GiB", "growth GiB",
        "live peak GiB", "live growth GiB", "loss first → last", "steps used / run",
    ]  # fmt: skip
    rows = []
    for key, run in section["runs"].items():
        live = run["live_memory"]
        rows.append([
            names[key], fixed(run["median_step_seconds"], 3), fixed(run["tokens_per_second"], 0),
            pct(run["mfu"]).lstrip("+"), pct(run["hfu"]).lstrip("+"),
            fixed(run["peak_rss"] / 2**30), fixed(run["rss_growth"] / 2**30),
            fixed(live["peak_rss"] / 2**30), fixed(live["rss_growth"] / 2**30),
            f"{run['losses'][0]:.3f} → {run['losses'][-1]:.3f}",
            f"{run['steps_used']}/{run['steps_run']}",
        ])  # fmt: skip
    return table(header, rows)
