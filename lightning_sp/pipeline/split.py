"""The pipeline split (paper §4.4): which layers each model chunk holds, and the checks a
pipeline configuration must pass before any work starts.

The ``L`` layers are split into ``p·m`` chunks of ``L/(p·m)`` layers (``p`` pipeline ranks,
``m`` model chunks per rank). As in Megatron-LM's interleaved schedule, chunk ``c`` of
pipeline rank ``r`` is virtual stage ``v = c·p + r`` and holds layers ``[v·L/(p·m),
(v+1)·L/(p·m))``; with ``m = 1`` that is the plain split into ``p`` stages. The global batch
``[B, s]`` is split into ``n`` micro-batches along dim 0 (and over data-parallel replicas).
The schedules that run these chunks are in :mod:`lightning_sp.pipeline.steps`.
"""

from __future__ import annotations

from typing import Literal

from lightning_sp.errors import ConfigError, divisors, positive_int

ScheduleName = Literal["auto", "1f1b", "interleaved"]
SCHEDULES = ("auto", "1f1b", "interleaved")


def check_pipeline_schedule(
    pipeline_parallel_size: int,
    virtual_pipeline_size: int = 1,
    num_microbatches: int = 1,
    schedule: str = "auto",
) -> str:
    """Validate the schedule part of a pipeline layout (what the strategy knows) and return
    the schedule it runs: ``"1f1b"``, ``"interleaved"`` or ``"none"`` (``p = 1``:
    micro-batches run one after another).

    Raises :class:`ConfigError` (one line: field, value, what is valid) when there are fewer
    micro-batches than pipeline stages (torch's ``Schedule1F1B`` needs ``n ≥ p``), or, with
    interleaving, when ``n`` is not a multiple of ``p`` (Megatron's rule; torch's
    ``ScheduleInterleaved1F1B`` would otherwise change its round size and keep more
    micro-batches in flight than the paper's factor).
    """
    p, m, n = pipeline_parallel_size, virtual_pipeline_size, num_microbatches
    positive_int("pipeline_parallel_size", p)
    positive_int("virtual_pipeline_size", m)
    positive_int("num_microbatches", n)
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r} is not a schedule; valid: {', '.join(SCHEDULES)}")
    if m > 1 and p == 1:
        raise ConfigError(
            f"virtual_pipeline_size={m} interleaves model chunks over pipeline stages, but "
            "pipeline_parallel_size=1; use virtual_pipeline_size=1"
        )
    if schedule == "1f1b" and m > 1:
        raise ConfigError(
            f"schedule='1f1b' runs one model chunk per stage, but virtual_pipeline_size={m}; "
            "use schedule='interleaved' (or 'auto') or virtual_pipeline_size=1"
        )
    if p == 1:
        return "none"
    if n < p:
        raise ConfigError(
            f"num_microbatches={n} is fewer than pipeline_parallel_size={p}; the 1F1B and "
            f"interleaved schedules need num_microbatches >= {p}"
        )
    if m > 1 and n % p:
        raise ConfigError(
            f"num_microbatches={n} is not a multiple of pipeline_parallel_size={p}, which the "
            f"interleaved schedule (virtual_pipeline_size={m}) needs; use a multiple of {p}"
        )
    if m > 1 or schedule == "interleaved":
        return "interleaved"
    return "1f1b"


def check_pipeline(
    num_layers: int,
    pipeline_parallel_size: int,
    virtual_pipeline_size: int = 1,
    num_microbatches: int = 1,
    schedule: str = "auto",
) -> str:
    """:func:`check_pipeline_schedule`, and ``num_layers`` divisible by ``p·m`` (every model
    chunk gets the same number of layers); returns the schedule."""
    name = check_pipeline_schedule(
        pipeline_parallel_size, virtual_pipeline_size, num_microbatches, schedule
    )
    p, m = pipeline_parallel_size, virtual_pipeline_size
    chunks = p * m
    if num_layers % chunks:
        valid = [d for d in divisors(num_layers) if d % p == 0]
        raise ConfigError(
            f"num_layers={num_layers} is not divisible by pipeline_parallel_size * "
            f"virtual_pipeline_size = {p} * {m} = {chunks}; p * m must be one of "
            f"{valid or divisors(num_layers)}"
        )
    return name


def check_batch(global_batch_size: int, num_microbatches: int, data_parallel_size: int = 1) -> int:
    """The micro-batch size of a global batch split over ``data_parallel_size`` replicas and
    ``num_microbatches`` micro-batches; :class:`ConfigError` unless it divides evenly."""
    positive_int("global_batch_size", global_batch_size)
    positive_int("num_microbatches", num_microbatches)
    positive_int("data_parallel_size", data_parallel_size)
    split = num_microbatches * data_parallel_size
    if global_batch_size % split:
        raise ConfigError(
            f"global batch size {global_batch_size} is not divisible by num_microbatches * "
            f"data_parallel_size = {num_microbatches} * {data_parallel_size} = {split}; use a "
            f"multiple of {split}"
        )
    return global_batch_size // split


def chunk_layer_ranges(
    num_layers: int, pipeline_parallel_size: int, virtual_pipeline_size: int, rank: int
) -> list[range]:
    """The layers of each model chunk of pipeline rank ``rank``, in virtual-stage order:
    chunk ``c`` is virtual stage ``c·p + rank`` (Megatron's interleaved layout)."""
    p, m = pipeline_parallel_size, virtual_pipeline_size
    per_chunk = num_layers // (p * m)
    return [range((c * p + rank) * per_chunk, (c * p + rank + 1) * per_chunk) for c in range(m)]
