"""Checks of a run's configuration that need nothing but the configuration.

Each raises :class:`~lightning_sp.errors.ConfigError` with one line naming the field, the value
and what is valid. The strategy and the module call them from their constructors; ``cli.py``
calls :func:`check_fit_config` on the parsed config before any class is built or any process
starts (a constructor's error would otherwise reach the user inside jsonargparse's multi-line
Union report).
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
from typing import Any

from lightning_sp.errors import ConfigError, positive_int
from lightning_sp.model.config import GPTConfig
from lightning_sp.parallel.config import resolve_sequence_parallel
from lightning_sp.parallel.state import ParallelState
from lightning_sp.pipeline import check_pipeline_schedule

SUPPORTED_PRECISION = ("32-true", "bf16-true", "64-true")
STRATEGY = "trainer.strategy"


def check_strategy_args(**args: Any) -> None:
    """The values of ``MegatronSPStrategy``'s arguments (names as in its signature; an unknown
    name is refused by the constructor, and by the CLI's parser before that)."""
    get = args.get
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                 "expert_parallel_size", "num_microbatches", "virtual_pipeline_size"):  # fmt: skip
        positive_int(name, get(name, 1))
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
    positive_int("bucket_size", get("bucket_size", 1))
    for name in ("overlap_grad_reduce", "distributed_optimizer"):
        if not isinstance(get(name, True), bool):
            raise ConfigError(f"{name}={get(name)!r} must be true or false")
    if get("sequence_parallel") not in (None, True, False):
        raise ConfigError(
            f"sequence_parallel={get('sequence_parallel')!r} must be true, false or null (the "
            "model config's)"
        )
    p, n = get("pipeline_parallel_size", 1), get("num_microbatches", 1)
    if n > 1 and p == 1:
        raise ConfigError(
            f"num_microbatches={n} splits a step over pipeline stages, but "
            "pipeline_parallel_size=1; for gradient accumulation use "
            f"trainer.accumulate_grad_batches={n}"
        )
    check_pipeline_schedule(p, get("virtual_pipeline_size", 1), n)


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


def _strategy_init_args(strategy: Any) -> dict[str, Any] | None:
    """The init args of a ``MegatronSPStrategy`` in a parsed config (``None``: another one)."""
    if isinstance(strategy, str):
        return {} if strategy.startswith("megatron_sp") else None
    class_path = str(getattr(strategy, "class_path", "") or "")
    if not class_path.endswith("MegatronSPStrategy"):
        return None
    init = getattr(strategy, "init_args", None)
    return dict(vars(init)) if init is not None else {}


def check_fit_config(config: Any) -> None:
    """Every check that needs only a parsed ``fit`` config (a jsonargparse Namespace):
    strategy arguments, precision, layout against the devices, model against the layout,
    optimizer values and, when resuming, the checkpoint (present, intact, same shapes)."""
    from lightning_sp.model.config import GPTConfig
    from lightning_sp.model.moe_config import MoEConfig
    from lightning_sp.parallel.state import check_expert_layout, check_layout

    trainer = config.trainer
    args = _strategy_init_args(trainer.strategy)
    fields = dict(vars(config.model.config))
    if fields.get("moe") is not None and not isinstance(fields["moe"], MoEConfig):
        fields["moe"] = MoEConfig(**vars(fields["moe"]))  # a parsed Namespace
    model_config = GPTConfig(**fields)
    if args is not None:
        check_strategy_args(**args)
        check_precision(trainer.precision)
        devices = trainer.devices
        if isinstance(devices, int) and devices > 0:
            t, p = args.get("tensor_parallel_size", 1), args.get("pipeline_parallel_size", 1)
            c = args.get("context_parallel_size", 1)
            d = check_layout(devices * (trainer.num_nodes or 1), t, p, c)
            e = args.get("expert_parallel_size", 1)
            check_expert_layout(d * c, e)
            resolve_sequence_parallel(args.get("sequence_parallel"), model_config.sequence_parallel)
            model_config.validate(t)
            if model_config.feed_forward == "moe" and model_config.moe is not None:
                model_config.moe.check_layout(e, t, model_config.sequence_parallel)
            check_context_sequence(model_config, t, c)
    check_optimizer(config.model.optimizer)
    ckpt_path = getattr(config, "ckpt_path", None)
    if ckpt_path and ckpt_path not in ("last", "hpc", "best", "registry"):
        check_checkpoint(ckpt_path, model_config)


def check_context_sequence(config: GPTConfig, tensor_parallel_size: int, cp_size: int) -> None:
    """Under context parallelism (``cp_size = c > 1``) every sequence is cut into ``2c``
    equal chunks, and with sequence parallelism each rank's ``s/c`` tokens are split again over
    ``t``: ``model.config.seq_length`` must be a multiple of ``2c`` (with SP, of
    ``lcm(2c, c·t)``). One-line :class:`ConfigError` otherwise, naming the nearest valid
    lengths."""
    if cp_size == 1:
        return
    s, t = config.seq_length, tensor_parallel_size
    need = 2 * cp_size
    why = f"context_parallel_size={cp_size} cuts each sequence into {need} chunks"
    if config.sequence_parallel and t > 1:
        need = math.lcm(need, cp_size * t)
        why += f" and sequence parallelism splits each rank's s/c over tensor_parallel_size={t}"
    if s % need:
        below, above = s // need * need, (s // need + 1) * need
        nearest = f"{below} or {above}" if below else f"{above}"
        raise ConfigError(
            f"model.config.seq_length={s} is not a multiple of {need} ({why}); use e.g. {nearest}"
        )


def check_checkpoint(ckpt_path: str, model_config: Any) -> None:
    """The checkpoint exists, is intact, and its tensors have this model's shapes."""
    import dataclasses
    from pathlib import Path

    import torch

    from lightning_sp.model.gpt import GPT
    from lightning_sp.parallel.state import ParallelState
    from lightning_sp.training.checkpoint.shards import global_shapes
    from lightning_sp.training.checkpoint.verify import check_shapes, verify

    meta, metadata = verify(Path(ckpt_path))
    config = model_config
    if config.recompute == "auto":  # resolved per device at run time; shapes do not depend on it
        config = dataclasses.replace(config, recompute="none")
    with torch.device("meta"):
        model = GPT(config, ParallelState.single("meta"), device="meta")
    check_shapes(metadata, global_shapes(model), meta, dataclasses.asdict(model_config))


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
