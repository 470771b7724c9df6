"""The checks the strategy and the module run on their own arguments, the data and the
vocabulary, before any step.

Each raises :class:`~lightning_sp.errors.ConfigError` with one line naming the field, the value
and what is valid. The command line runs the same checks on the parsed config before any class
is built or any process starts (:func:`lightning_sp.cli.checks.check_fit_config`; a
constructor's error would otherwise reach the user inside jsonargparse's multi-line Union
report).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import shutil
from collections.abc import Mapping
from typing import Any

from lightning_sp.errors import ConfigError, finite_number
from lightning_sp.model.config import GPTConfig
from lightning_sp.parallel.buffer import DEFAULT_BUCKET_NUMEL, GradBufferConfig
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import check_batch, check_pipeline_schedule

SUPPORTED_PRECISION = ("32-true", "bf16-true", "64-true")
STRATEGY = "trainer.strategy"

COMPILED_MEMORY_WARNING = (
    "compile_layers=True: a compiled layer saves for backward what the compiler's partitioner "
    "chooses, not what the recompute policy states (the same loss and gradients); the activation "
    "formulas and the planner describe eager layers, ActivationMemoryMonitor measures these"
)
"""Warned once where ``compile_layers=True`` passes :func:`check_compile`."""


def eager_fp8_warning(config: GPTConfig, compile_layers: bool) -> str | None:
    """The line warned once where ``config.fp8`` turns on FP8 GEMMs (not emulated) and the
    layers run eager: measured on an H200, an eager FP8 step was 2.7-3.4x slower than BF16
    (docs/fp8.md); None otherwise."""
    fp8 = config.fp8
    if fp8 is None or fp8.recipe is None or fp8.emulate or compile_layers:
        return None
    return (
        f"fp8.recipe={fp8.recipe!r} with compile_layers=False: eager FP8 scales each GEMM's "
        "inputs in separate kernels, and an eager FP8 step measured 2.7-3.4x slower than BF16 "
        "on an H200 (docs/fp8.md); set compile_layers=true to fuse them"
    )


MOVED_STRATEGY_ARGS = {"sequence_parallel": "model.config.sequence_parallel"}
"""Former ``MegatronSPStrategy`` arguments and their one home now: sequence parallelism is a
run setting of the model config (:class:`~lightning_sp.model.run_settings.RunSettings`)."""


def check_moved_strategy_args(args: Mapping[str, Any]) -> None:
    """One-line :class:`ConfigError` for a strategy argument that moved
    (:data:`MOVED_STRATEGY_ARGS`), naming where it lives now."""
    for name in MOVED_STRATEGY_ARGS:
        if name in args:
            raise ConfigError(moved_strategy_arg(name))


def moved_strategy_arg(name: str) -> str:
    """The one line for ``trainer.strategy.init_args.<name>``, a moved argument
    (:data:`MOVED_STRATEGY_ARGS`): where it lives now (the CLI's parser prints it too)."""
    return (
        f"{STRATEGY}.init_args.{name} is no longer a strategy argument: it moved to "
        f"{MOVED_STRATEGY_ARGS[name]}; set it there"
    )


def check_strategy_args(**args: Any) -> ParallelConfig:
    """The values of ``MegatronSPStrategy``'s arguments (names as in its signature; an unknown
    name is refused by the constructor, and by the CLI's parser before that; a moved one,
    :data:`MOVED_STRATEGY_ARGS`, names its new home), and the layout record they state (its
    sizes checked by :class:`ParallelConfig` itself)."""
    check_moved_strategy_args(args)
    get = args.get
    layout = ParallelConfig(
        **{f.name: get(f.name, f.default) for f in dataclasses.fields(ParallelConfig)
           if f.name != "data_parallel_size"}
    )  # fmt: skip
    timeout = get("timeout", 600.0)
    if not isinstance(timeout, int | float) or not timeout > 0 or not math.isfinite(timeout):
        raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds")
    if get("start_method", "popen") not in ("popen", "spawn"):
        raise ConfigError(f"start_method={get('start_method')!r} is not one of popen, spawn")
    if get("process_group_backend") not in (None, "gloo", "nccl"):
        raise ConfigError(
            f"process_group_backend={get('process_group_backend')!r} is not one of gloo, nccl "
            "(or null: chosen from the device)"
        )
    if get("nonfinite", "stop") not in ("stop", "skip"):
        raise ConfigError(f"nonfinite={get('nonfinite')!r} is not one of stop, skip")
    skips = get("max_skipped_steps", 10)
    if not isinstance(skips, int) or isinstance(skips, bool) or skips < 0:
        raise ConfigError(f"max_skipped_steps={skips!r} must be a non-negative integer")
    GradBufferConfig(
        get("bucket_size", DEFAULT_BUCKET_NUMEL),
        get("overlap_grad_reduce", True),
        get("distributed_optimizer", False),
    )
    p, n = layout.pipeline_parallel_size, layout.num_microbatches
    if n > 1 and p == 1:
        raise ConfigError(
            f"num_microbatches={n} splits a step over pipeline stages, but "
            "pipeline_parallel_size=1; for gradient accumulation use "
            f"trainer.accumulate_grad_batches={n}"
        )
    check_pipeline_schedule(p, layout.virtual_pipeline_size, n)
    return layout


def check_precision(precision: object) -> None:
    """The Trainer's ``precision``: the model runs in one dtype (fp32 master weights in the
    optimizer for bf16); autocast ("mixed") is not supported."""
    if str(precision) not in SUPPORTED_PRECISION:
        raise ConfigError(
            f"trainer.precision={precision!r} is not supported by megatron_sp; use one of "
            f"{', '.join(SUPPORTED_PRECISION)} (bf16-true keeps fp32 master weights)"
        )


def check_optimizer(optimizer: Any, field: str = "model.optimizer") -> None:
    """AdamW and schedule values (an ``OptimizerConfig``)."""
    for name in ("lr", "min_lr", "weight_decay", "eps"):
        value = getattr(optimizer, name)
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{field}.{name}={value!r} must be a finite number >= 0")
    if optimizer.eps == 0:
        raise ConfigError(f"{field}.eps=0 must be > 0 (Adam divides by sqrt(v) + eps)")
    if optimizer.min_lr > optimizer.lr:
        raise ConfigError(
            f"{field}.min_lr={optimizer.min_lr!r} exceeds {field}.lr={optimizer.lr!r}; the "
            "cosine decay ends at min_lr <= lr"
        )
    for name in ("beta1", "beta2"):
        value = getattr(optimizer, name)
        if not isinstance(value, int | float) or not 0 <= value < 1:
            raise ConfigError(f"{field}.{name}={value!r} must be in [0, 1)")
    if not isinstance(optimizer.warmup_steps, int) or optimizer.warmup_steps < 0:
        raise ConfigError(f"{field}.warmup_steps={optimizer.warmup_steps!r} must be >= 0")
    decay = optimizer.decay_steps
    if decay is not None and (not isinstance(decay, int) or decay < 1):
        raise ConfigError(f"{field}.decay_steps={decay!r} must be a positive integer or null")
    if decay is not None and decay <= optimizer.warmup_steps:  # Megatron asserts the same
        raise ConfigError(
            f"{field}.decay_steps={decay} must exceed {field}.warmup_steps="
            f"{optimizer.warmup_steps} (the cosine runs from the end of the warm-up to "
            "decay_steps; else the rate drops from lr to min_lr in one step)"
        )


def check_gradient_clipping(value: object, algorithm: object) -> None:
    """The Trainer's ``gradient_clip_val`` (a finite number >= 0; 0 or null: no clipping;
    Lightning takes any number, and a negative one would flip the gradients' sign) and
    ``gradient_clip_algorithm`` (null or ``norm``: ``GPTModule`` clips by the global norm over
    every shard)."""
    if value is not None:
        valid = "a finite number >= 0 (0 or null: no clipping)"
        finite_number("trainer.gradient_clip_val", value, valid, lambda v: v >= 0)
    name = getattr(algorithm, "value", algorithm)  # Lightning's GradClipAlgorithmType, or text
    if name is not None and str(name).lower() != "norm":
        raise ConfigError(
            f"trainer.gradient_clip_algorithm={name!r} is not supported; use norm (clipping by "
            "the global norm over every shard) or null"
        )


def check_compile(state: ParallelState) -> None:
    """Raise :class:`ConfigError` (one line) where ``compile_layers=True`` cannot run: no
    compiler for inductor (a C++ compiler on CPU, Triton on CUDA). Any layout compiles: each
    layer is compiled on its own, its tensor-parallel collectives inside, the pipeline's
    sends and receives outside (``tests/test_device_context.py``: t=2 + SP and p=2 give the
    eager loss and gradients, traced by dynamo and AOTAutograd; inductor at t=1)."""
    if state.device.type == "cpu":
        compiler = os.environ.get("CXX", "g++")
        if shutil.which(compiler) is None:
            raise ConfigError(
                f"compile_layers=True on CPU needs a C++ compiler for inductor; {compiler!r} "
                "is not on PATH (set CXX) or set compile_layers=false"
            )
    elif state.device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError(
            "compile_layers=True on CUDA needs Triton, which is not installed; install it or set "
            "compile_layers=false"
        )


def check_pipeline_batch(
    accumulate_grad_batches: int | None, batch_size: int | None, num_microbatches: int
) -> None:
    """Under a pipeline schedule a step's batch splits into the micro-batches and the schedule
    accumulates: fail before any step if the trainer asks otherwise (``None``: not known)."""
    if accumulate_grad_batches is not None and accumulate_grad_batches != 1:
        raise ConfigError(
            f"trainer.accumulate_grad_batches={accumulate_grad_batches} with "
            "pipeline_parallel_size > 1; the schedule accumulates over num_microbatches, "
            "use accumulate_grad_batches=1"
        )
    if batch_size is not None:  # this replica's batch splits into the micro-batches
        check_batch(batch_size, num_microbatches)


def check_predict(state: ParallelState) -> None:
    """``predict`` generates with the whole model and sequence on each rank: no pipeline or
    context parallelism."""
    for field in ("pipeline_parallel_size", "context_parallel_size"):
        if getattr(state, field) > 1:
            raise ConfigError(
                f"{field}={getattr(state, field)}: predict needs the whole model and "
                f"sequence on each rank; predict with {field}=1"
            )


def check_data(datamodule: object, config: GPTConfig) -> None:
    """The data must fit the model (``datamodule``'s ``seq_length`` and ``vocab_size``, where
    it has them): fail before any step if it does not."""
    seq_length = getattr(datamodule, "seq_length", None)
    if seq_length is not None and seq_length != config.seq_length:
        raise ConfigError(
            f"data.seq_length={seq_length} differs from model.config.seq_length="
            f"{config.seq_length}; give both the same value (the CLI links them)"
        )
    tokens = getattr(datamodule, "vocab_size", None)
    if tokens is not None and tokens > config.vocab_size:
        raise ConfigError(
            f"model.config.vocab_size={config.vocab_size} is smaller than the tokenizer's "
            f"vocabulary of {tokens} tokens; set model.config.vocab_size >= {tokens}"
        )


def vocabulary_identity(vocab_size: int, datamodule: Any) -> dict[str, Any]:
    """What a checkpoint records of its vocabulary: the model's ``vocab_size``, the
    datamodule's ``tokenizer_id`` and the tokenizer's path (``cli.py export`` copies it)."""
    tokenizer = getattr(datamodule, "tokenizer", None)
    return {
        "vocab_size": vocab_size,
        "tokenizer": getattr(datamodule, "tokenizer_id", None),
        "tokenizer_path": os.path.abspath(os.path.expanduser(tokenizer)) if tokenizer else None,
    }


def check_vocabulary(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """A checkpoint's vocabulary (``vocab_size``, tokenizer identity) against this run's:
    resuming with another vocabulary or tokenizer would silently train on other tokens."""
    if saved and saved["vocab_size"] != current["vocab_size"]:
        raise ConfigError(
            f"model.config.vocab_size={current['vocab_size']} does not match the "
            f"checkpoint's vocab_size={saved['vocab_size']}; use the checkpoint's vocabulary"
        )
    if (
        saved.get("tokenizer")
        and current["tokenizer"]
        and saved["tokenizer"] != current["tokenizer"]
    ):
        raise ConfigError(
            f"data tokenizer {current['tokenizer']!r} does not match the checkpoint's "
            f"tokenizer {saved['tokenizer']!r}; resume with the tokenizer it was trained with"
        )
