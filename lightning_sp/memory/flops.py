"""FLOPs of one training iteration (paper Appendix A) and the peak FLOP/s of a device.

Only matrix multiplications are counted, as in the paper. With ``B`` the global batch size,
``s`` the sequence length, ``h`` the hidden size, ``f`` the MLP width, ``L`` the number of
layers and ``v`` the vocabulary, one layer's forward pass costs

* QKV projection ``6Bsh²``, attention scores QKᵀ ``2Bs²h``, attention over V ``2Bs²h``,
  output projection ``2Bsh²``: ``8Bsh² + 4Bs²h``;
* MLP ``h -> f -> h``: ``4Bshf`` (``16Bsh²`` for the GPT-3 width ``f = 4h``);

and the output layer (logits) ``2Bshv``. Backward costs twice the forward (gradients of both
the inputs and the weights), so the model FLOPs of an iteration are three times the forward.
For ``f = 4h`` this is the paper's ``72BsLh²(1 + s/(6h) + v/(12hL))``.

*Model* FLOPs count what the model needs, independent of the implementation; *hardware*
FLOPs add what the recompute policy executes a second time in backward (MFU vs HFU).
"""

from __future__ import annotations

import math
import time

import torch

from lightning_sp.errors import positive_int
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.cores import ATTENTION_BACKENDS
from lightning_sp.model.parts.block import block_of_shape
from lightning_sp.model.recompute import active_modules
from lightning_sp.model.shape import ActivationShape

__all__ = [
    "attention_core_flops_per_iteration",
    "causal_half_model_flops_per_iteration",
    "forward_flops_per_iteration",
    "hardware_flops_per_iteration",
    "layer_forward_flops",
    "measure_peak_flops",
    "model_flops_per_iteration",
    "peak_flops",
]


def _check_batch(global_batch_size: int) -> None:
    positive_int("global_batch_size", global_batch_size)


def _batch_shape(config: GPTConfig, batch: int) -> ActivationShape:
    """The layer's shape for ``batch`` whole sequences on one rank, the FLOP counts' unit."""
    return config.activation_shape(micro_batch_size=batch)


def layer_forward_flops(config: GPTConfig, batch_size: int) -> float:
    """Matmul FLOPs of one layer's forward for ``batch_size`` sequences of
    ``config.seq_length`` tokens: the sum over the layer's parts (:mod:`lightning_sp.model.
    parts`), for GPT-2 / Llama attention ``2Bsh(a + 2g)d + 4Bs²ad + 2Bsadh`` and the MLP
    ``2Bshf`` per projection."""
    shape = _batch_shape(config, batch_size)
    return block_of_shape(shape).forward_flops(shape)


def forward_flops_per_iteration(config: GPTConfig, global_batch_size: int) -> float:
    """Matmul FLOPs of one forward pass over ``global_batch_size`` sequences of
    ``config.seq_length`` tokens: ``L·(8Bsh² + 4Bshf + 4Bs²h) + 2Bshv`` for GPT
    (:func:`layer_forward_flops` for other architectures: grouped-query attention's smaller
    K and V, SwiGLU's third projection).

    ``v`` is the true ``config.vocab_size`` (padding rows of the embedding are not model
    FLOPs); ``f`` is ``config.ffn_size``.
    """
    _check_batch(global_batch_size)
    layer = layer_forward_flops(config, global_batch_size)
    logits = 2 * global_batch_size * config.seq_length * config.hidden_size * config.vocab_size
    return float(config.num_layers * layer + logits)


def model_flops_per_iteration(config: GPTConfig, global_batch_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward, no recomputation).

    Equals the paper's ``72·B·s·L·h²·(1 + s/(6h) + v/(12·h·L))`` (Appendix A), which
    assumes the GPT-3 MLP width ``ffn_size = 4h``; for another width the MLP term is
    ``12·B·s·h·f`` per layer instead of ``48·B·s·h²`` (three times ``4Bshf``).

    ``v`` is the true ``config.vocab_size``, not the vocabulary padded for tensor
    parallelism: the padded rows compute logits nobody asked for, so they are not model FLOPs
    (they make the measured matmul count ``(v_padded - v)·6Bsh`` larger). ``s`` is
    ``config.seq_length``; pass a config with the sequence length actually run if it is
    shorter.
    """
    return 3.0 * forward_flops_per_iteration(config, global_batch_size)


def attention_core_flops_per_iteration(config: GPTConfig, global_batch_size: int) -> float:
    """The model FLOPs of the attention cores in one iteration (forward + backward, 3x the
    forward): ``QKᵀ`` and ``probs·V`` over every query-key pair, ``4·B·s²·a·d`` per layer
    forward (the parts' GEMMs tagged ``core_attn``), as :func:`model_flops_per_iteration`
    counts them: whole, causal or not."""
    _check_batch(global_batch_size)
    shape = _batch_shape(config, global_batch_size)
    core = sum(g.flops for g in block_of_shape(shape).gemms(shape) if g.tag == "core_attn")
    return 3.0 * config.num_layers * core


def causal_half_model_flops_per_iteration(config: GPTConfig, global_batch_size: int) -> float:
    """Model FLOPs counted the way Megatron-LM (since 2025) and MaxText count them: causal
    attention's cores at half (the pairs a causal mask keeps), the rest as
    :func:`model_flops_per_iteration` counts it (whole attention, torchtitan's convention,
    this project's and Megatron-Core's until 2025). For GPT, ``72BsLh²(1 + s/(12h) +
    v/(12hL))`` against ``72BsLh²(1 + s/(6h) + v/(12hL))``."""
    whole = model_flops_per_iteration(config, global_batch_size)
    return whole - 0.5 * attention_core_flops_per_iteration(config, global_batch_size)


def hardware_flops_per_iteration(
    config: GPTConfig,
    global_batch_size: int,
    layers_per_chunk: int | None = None,
    context_parallel_size: int = 1,
) -> float:
    """FLOPs the hardware executes in one iteration: model FLOPs plus the forward work that
    ``config.recompute`` runs again during backward, plus what the attention backend's own
    backward recomputes. ``layers_per_chunk``: the layers of one model chunk (``L / (p·m)``
    under pipeline parallelism), since ``recompute_num_layers`` counts per chunk; default: the
    whole model is one chunk.

    * no module (``none``): nothing is recomputed, equal to :func:`model_flops_per_iteration`.
    * ``full``: every layer's forward runs twice (the logits are not recomputed), so each
      layer costs 4x its forward instead of 3x: ``96·B·s·L·h²·(1 + s/(6h) + v/(16·h·L))``
      for ``ffn_size = 4h``, about 4/3 of the model FLOPs for large ``h``. (Layers that
      ``recompute_num_layers`` leaves out run ``recompute_rest``, counted as a module set.)
    * a module set: each active module's ``redone_flops``
      (:data:`lightning_sp.model.recompute.RECOMPUTE_MODULES`). Only ``core_attn`` redoes
      matmuls: the two ``s x s`` matmuls QKᵀ and probs·V, ``2·B·s²·h`` each, so ``4·B·s²·h·L``
      is added (LayerNorm, GeLU, masks and softmax are not matmuls and are not counted, as
      everywhere here). That is ``s/(18h)`` in units of ``72BsLh²``: relative to the model
      FLOPs the overhead is ``(s/(18h)) / (1 + s/(6h) + v/(12hL))``, 0.90% for GPT-3 175B
      (s=2048, h=12288) and 0.54% for MT-NLG 530B (h=20480). The paper's "2.7%" and "1.6%"
      are the same recomputed FLOPs relative to one *forward* pass,
      ``4Bs²h / (24Bsh² + 4Bs²h) = s/(6h + s)`` (2.70% and 1.64%); ``tests/test_flops.py``
      checks both readings.
    * ``attention: sdpa``: the fused kernel's backward recomputes QKᵀ, ``2·B·s²·h`` per
      layer (the backend's ``backward_redone_flops``); ``core_attn`` does not act there.
    * context parallelism (``context_parallel_size > 1``): the CP attention core replays its
      forward in its backward whatever the policy (:mod:`lightning_sp.parallel.
      context_attention`), ``4·B·s²·h`` per layer in the paper's count (the same as
      ``core_attn``'s, which the model does not apply under CP), on top of the backend's own
      backward recomputation and of ``full``'s replay.
    """
    model = model_flops_per_iteration(config, global_batch_size)
    shape = _batch_shape(config, global_batch_size)
    layer = layer_forward_flops(config, global_batch_size)
    backend = ATTENTION_BACKENDS[config.attention].backward_redone_flops(shape)
    extra = 0.0
    chunk = layers_per_chunk or config.num_layers
    cp_core = 0.0
    if context_parallel_size > 1:  # a size the layout record checked
        cp_core = 4.0 * global_batch_size * config.seq_length**2 * config.num_heads
        cp_core *= config.head_dim  # QKᵀ and probs·V again: 4Bs²·ad (4Bs²h when a·d = h)
    for index in range(config.num_layers):
        policy = config.layer_recompute(index % chunk)  # ConfigError for auto
        if policy.full:
            extra += layer + backend + cp_core
        else:
            active = active_modules(policy.modules, config.attention)
            if cp_core:  # core_attn leaves the CP core alone; the core replays itself
                active = tuple(m for m in active if not m.needs_scores)
            extra += sum(m.redone_flops(shape) for m in active) + backend + cp_core
    return model + extra


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    size: int = 1024,
    seconds: float = 0.5,
) -> float:
    """This machine's GEMM rate in FLOP/s: ``size x size`` matmuls in ``dtype`` on ``device``.

    One warm-up matmul, then matmuls until at least ``seconds`` of ``time.perf_counter`` have
    passed. Each matmul counts ``2·size³`` FLOPs. Used as the "peak" where no datasheet value
    is known (CPUs), so MFU there means "fraction of what a large square matmul achieves".
    On CPU the clock is read after every matmul, so no matmul starts after ``seconds``:
    processes that start measuring together (the ranks of a host, after a barrier) also stop
    together, and each measures its rate while all of them multiply, as they do in training
    (where cores share their vector units, a rank that went on alone would overstate its
    share). On accelerators the device is synchronised after
    batches of matmuls doubling in length (few synchronisations). Returns a positive finite
    number.
    """
    positive_int("size", size)
    if not seconds > 0:
        raise ValueError(f"seconds={seconds!r} must be positive")
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up: kernel selection, thread pool start
    _synchronize(device)
    iterations, batch = 0, 1
    start = time.perf_counter()
    while True:
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        _synchronize(device)
        iterations += batch
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
        if device.type != "cpu":
            batch *= 2
    flops = 2.0 * size**3 * iterations / elapsed
    if not (math.isfinite(flops) and flops > 0):  # pragma: no cover - a timer of zero resolution
        raise RuntimeError(f"could not measure the matmul rate ({iterations} in {elapsed} s)")
    return flops


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> float:
    """Peak FLOP/s of one ``device`` for matmuls in ``dtype``.

    On accelerators, the datasheet value Lightning knows
    (:func:`lightning.fabric.utilities.throughput.get_available_flops`, e.g. 312e12 for an
    A100 in bf16), else ours for chips it lacks (:data:`DATASHEET_FLOPS`: the H200), else the
    rate :func:`measure_peak_flops` measures with :data:`ACCELERATOR_MEASURE_SIZE` matmuls.
    On CPU, always the measured rate (1024² matmuls).
    """
    device = torch.device(device)
    if device.type != "cpu":
        from lightning.fabric.utilities.throughput import get_available_flops

        available = get_available_flops(device, dtype) or _datasheet_flops(device, dtype)
        if available:
            return float(available)
        return measure_peak_flops(dtype=dtype, device=device, size=ACCELERATOR_MEASURE_SIZE)
    return measure_peak_flops(dtype=dtype, device=device)


ACCELERATOR_MEASURE_SIZE = 8192
"""Square matmul size measured on an accelerator whose datasheet rate is unknown: large enough
that the kernel, not its launch, sets the rate (1024 read about 100 TFLOP/s on an H200, whose
8192 rate is about 700)."""

DATASHEET_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H200 SXM datasheet: the H100 SXM's tensor cores and clocks (dense, no sparsity)
    "h200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
}
"""Dense peak FLOP/s of chips Lightning's table lacks, by a lower-case name fragment."""


def _datasheet_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """:data:`DATASHEET_FLOPS` for ``device``'s name and ``dtype`` (fp32 as TF32 unless the
    float32 matmul precision is ``"highest"``, as Lightning reads it), or ``None``."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if dtype == torch.float32:
        key = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    for fragment, rates in DATASHEET_FLOPS.items():
        if fragment in name and key in rates:
            return rates[key]
    return None
