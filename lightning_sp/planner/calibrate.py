"""Calibrate the step-time model on the device at hand (``lightning-sp calibrate``,
:mod:`lightning_sp.cli.calibrate`).

Measures, in bf16 on a GPU (fp32 on a CPU, whose bf16 matmul is emulated):

* the best GEMM rate over a few large shapes (the device's "maximum achievable matmul
  FLOPS"), and the HBM bandwidth of a large copy;
* every GEMM of one transformer layer of ``--config``'s model (forward, data gradient, weight
  gradient; :func:`lightning_sp.planner.ops.layer_gemms`) and of its output layer, for each
  ``--tensor_parallel_sizes`` x ``--micro_batch_sizes``;
* the fused attention core (``F.scaled_dot_product_attention``, causal, forward + backward)
  at the same sizes, and, when the config has attention dropout, the same calls with its
  ``dropout_p``: their total time over the total without is the cluster's
  ``flash_attention_dropout_cost``;

and writes a cluster YAML (``--out``): the ``--base`` preset's figures with the measured
efficiencies, and the measured kernels as a calibration table. ``lightning-sp estimate
--cluster <that file>`` then times those exact shapes as measured and the rest by the model
with the measured efficiencies.

On a GPU the datasheet peak and bandwidth stay (the base preset's) and the efficiencies are
measured against them. On a CPU there is no datasheet: the peak and the bandwidth become the
measured ones (efficiencies 1), which makes the file a plumbing check rather than a cluster
(``--smoke`` shrinks everything to seconds; ``tests/test_steptime.py`` runs it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_sp.model.config import GPTConfig
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.ops import Gemm, backward_gemms, head_gemms, layer_gemms

SMOKE_CONFIG = GPTConfig(vocab_size=512, seq_length=128, hidden_size=128, num_layers=2, num_heads=4)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], Any], device: torch.device, seconds: float) -> float:
    """Median seconds of one ``fn()`` over batches (doubling) run for at least ``seconds``
    after a warm-up call."""
    import time

    fn()
    _sync(device)
    samples: list[float] = []
    spent, batch = 0.0, 1
    while spent < seconds or len(samples) < 3:
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        _sync(device)
        elapsed = time.perf_counter() - start
        samples.append(elapsed / batch)
        spent += elapsed
        if elapsed < seconds / 10:
            batch *= 2
    samples.sort()
    return samples[len(samples) // 2]


def dtype_for(device: torch.device) -> torch.dtype:
    """bf16 on accelerators (what training runs); fp32 on a CPU, whose bf16 matmul is
    emulated (5x slower here, DESIGN.md) and says nothing about a GPU."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def gemm_time(gemm: Gemm, device: torch.device, seconds: float) -> float:
    """Seconds of ``[batch] x (m x k) @ (k x n)`` (:func:`dtype_for`)."""
    shape_a = (gemm.batch, gemm.m, gemm.k) if gemm.batch > 1 else (gemm.m, gemm.k)
    shape_b = (gemm.batch, gemm.k, gemm.n) if gemm.batch > 1 else (gemm.k, gemm.n)
    a = torch.randn(shape_a, device=device, dtype=dtype_for(device))
    b = torch.randn(shape_b, device=device, dtype=dtype_for(device))
    return time_it(lambda: torch.matmul(a, b), device, seconds)


def attention_time(
    seq: int,
    head_dim: int,
    heads: int,
    device: torch.device,
    seconds: float,
    dropout_p: float = 0.0,
) -> float:
    """Seconds of a causal ``scaled_dot_product_attention`` forward + backward over ``heads``
    heads of ``seq x head_dim`` (:func:`dtype_for`), with attention dropout ``dropout_p``.
    The gradients are returned, not accumulated into the inputs (the model's core runs no
    such adds)."""
    q, k, v = (
        torch.randn(
            1, heads, seq, head_dim, device=device, dtype=dtype_for(device), requires_grad=True
        )
        for _ in range(3)
    )
    grad = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype_for(device))

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True
        )
        torch.autograd.grad(out, (q, k, v), grad)

    return time_it(step, device, seconds)


def copy_bandwidth(device: torch.device, nbytes: int, seconds: float) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / time_it(lambda: dst.copy_(src), device, seconds)


def model_gemms(config: GPTConfig, t: int, b: int) -> list[Gemm]:
    """Every GEMM shape the step-time model asks for at (t, b): a layer's and the output
    layer's forward GEMMs and their two backward GEMMs each."""
    shape = config.activation_shape(ParallelConfig(tensor_parallel_size=t), b)
    forward = [*layer_gemms(shape), *head_gemms(config, t, b)]
    return [g for f in forward for g in (f, *backward_gemms(f))]


def calibrate(
    config: GPTConfig,
    base: Cluster,
    device: torch.device,
    tensor_parallel_sizes: list[int],
    micro_batch_sizes: list[int],
    seconds: float,
    square: int,
    copy_bytes: int,
) -> dict[str, Any]:
    """The cluster YAML mapping (see the module docstring)."""
    best = max(
        Gemm("square", n, n, n).flops / gemm_time(Gemm("square", n, n, n), device, seconds)
        for n in (square // 2, square)
    )
    bandwidth = copy_bandwidth(device, copy_bytes, seconds)
    measured: dict[tuple[str, int, int, int, int], float] = {}
    with_dropout: list[float] = []  # the attention shapes again, with the config's dropout
    for t in tensor_parallel_sizes:
        for b in micro_batch_sizes:
            for g in model_gemms(config, t, b):
                key = ("gemm", g.m, g.n, g.k, g.batch)
                if key not in measured:
                    measured[key] = gemm_time(g, device, seconds)
            heads = b * config.num_heads // t
            key = ("attention", config.seq_length, config.head_dim, 0, heads)
            if key not in measured:
                shape = (config.seq_length, config.head_dim, heads, device, seconds)
                measured[key] = attention_time(*shape)
                if config.attention_dropout > 0:
                    with_dropout.append(attention_time(*shape, config.attention_dropout))
    kernels = [
        {"kind": kind, "m": m, "n": n, "k": k, "batch": batch, "seconds": sec}
        for (kind, m, n, k, batch), sec in measured.items()
    ]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        figures = {
            "gemm_efficiency": min(1.0, best / base.peak_flops),
            "hbm_efficiency": min(1.0, bandwidth / base.hbm_bandwidth),
        }
    else:  # no datasheet: the measured rates are the peak
        name = "cpu"
        figures = {
            "peak_flops": best,
            "gemm_efficiency": 1.0,
            "hbm_bandwidth": bandwidth,
            "hbm_efficiency": 1.0,
        }
    if with_dropout:  # the same shapes' total time with dropout over without
        without = sum(sec for (kind, *_), sec in measured.items() if kind == "attention")
        figures["flash_attention_dropout_cost"] = sum(with_dropout) / without
    return {
        "base": base.name,
        **figures,
        "calibration": {"device": name, "kernels": kernels},
    }
