"""How the training software executes on a :class:`~lightning_sp.planner.cluster.Cluster`:
which of its communication it overlaps with compute, and the routing balance it runs at.

The step-time model prices what this project's code does unless told otherwise, so the
default :class:`Execution` is this project's: tensor-parallel collectives placed as Megatron
places them but not split and pipelined with their GEMMs, and the distributed optimizer's
parameter all-gather run after the optimizer step, exposed (its gradient reduce-scatter
overlaps the last micro-batch's backward when the layout says ``overlap_grad_reduce``, a
field of the run's layout). A run on another stack states its own: a published Megatron-Core
run with ``--tp-comm-overlap --overlap-param-gather`` is :data:`MEGATRON_CORE_OVERLAPS`
(:mod:`lightning_sp.planner.published` states which each row ran). A cluster YAML sets it as
``execution: {tensor_parallel_overlap: true, ...}``.

What each overlap hides, from first principles (:mod:`lightning_sp.planner.layertime`,
:mod:`lightning_sp.planner.steptime`):

* ``tensor_parallel_overlap``: TransformerEngine's userbuffers (Megatron-Core
  ``--tp-comm-overlap``) cut each sequence-parallel all-gather and reduce-scatter into ``t``
  chunks exchanged while the GEMM that consumes (or produces) them runs on the chunks already
  there. The GEMM and the transfer proceed together; the first or last chunk of the shorter
  of the two cannot: a collective of ``C`` seconds beside a GEMM of ``G`` seconds adds
  ``max(0, C - G) + min(C, G)/t``.
* ``param_gather_overlap``: the distributed optimizer's bf16 all-gather of the updated
  parameters is dispatched bucket by bucket as the next iteration's first forward reaches
  them (Megatron-Core ``--overlap-param-gather``): what outlasts one micro-batch's forward of
  a stage is exposed.
* ``pipeline_overlap``: with interleaved stages (``m > 1``) each point-to-point send and
  receive of a micro-batch's boundary activation runs beside the next model chunk's compute
  (Megatron-Core's default for its interleaved schedule, ``overlap_p2p_comm``; its
  non-interleaved 1F1B batches them, unoverlapped): what outlasts one chunk's forward is
  exposed.
* ``expert_load_imbalance``: the tokens the busiest expert-parallel rank receives over the
  mean. A step waits for its slowest rank, so that rank's expert GEMMs, expert kernels and
  all-to-all set the pace. 1 is balanced routing, what published MoE benchmarks force
  (``--moe-router-force-load-balancing``); a dropless run of a trained router is above 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_sp.errors import ConfigError


@dataclass(frozen=True)
class Execution:
    """Overlaps and routing balance of one training stack (default: this project's code)."""

    tensor_parallel_overlap: bool = False
    """Sequence-parallel all-gathers / reduce-scatters split into ``t`` chunks and pipelined
    with their GEMMs (TransformerEngine userbuffers, ``--tp-comm-overlap``); off: each is
    exposed except where Megatron's placement already overlaps it in backward."""

    param_gather_overlap: bool = False
    """The distributed optimizer's parameter all-gather overlapped with the next iteration's
    first forward (``--overlap-param-gather``); off: exposed after the optimizer step."""

    pipeline_overlap: bool = False
    """Interleaved pipelines (``m > 1``): point-to-point transfers overlapped with the next
    chunk's compute (Megatron-Core's ``overlap_p2p_comm``); off: exposed."""

    expert_load_imbalance: float = 1.0
    """Tokens routed to the busiest expert-parallel rank over the mean, >= 1 (1: balanced)."""

    def validate(self, where: str) -> None:
        """:class:`ConfigError` (one line naming ``where``, the field and the value) unless the
        overlaps are booleans and the imbalance is a finite number >= 1."""
        for name in ("tensor_parallel_overlap", "param_gather_overlap", "pipeline_overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"{where}: execution.{name}={getattr(self, name)!r} must be true or false"
                )
        x = self.expert_load_imbalance
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 1:
            raise ConfigError(
                f"{where}: execution.expert_load_imbalance={x!r} must be a finite number >= 1 "
                "(the busiest expert-parallel rank's tokens over the mean; 1 = balanced)"
            )

    def overlapped(self, collective: float, gemm: float, t: int) -> float:
        """What a TP collective of ``collective`` seconds adds beside the GEMM of ``gemm``
        seconds it feeds or drains: all of it without ``tensor_parallel_overlap``; with it,
        ``max(0, C - G) + min(C, G)/t`` (``t`` chunks, one of the shorter side unhidden)."""
        if not self.tensor_parallel_overlap:
            return collective
        return max(0.0, collective - gemm) + min(collective, gemm) / t


MEGATRON_CORE_OVERLAPS = Execution(
    tensor_parallel_overlap=True, param_gather_overlap=True, pipeline_overlap=True
)
"""Megatron-Core with ``--tp-comm-overlap --overlap-param-gather`` (and the layout's
``--overlap-grad-reduce``), its interleaved schedule's default ``overlap_p2p_comm``, balanced
routing."""


def execution_from_dict(data: Any, where: str) -> Execution:
    """An :class:`Execution` from a YAML mapping of its fields; :class:`ConfigError` (one line)
    on anything else."""
    fields = (
        "tensor_parallel_overlap", "param_gather_overlap", "pipeline_overlap",
        "expert_load_imbalance",
    )  # fmt: skip
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: execution must be a mapping of {', '.join(fields)}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key execution.{unknown[0]}; valid: {', '.join(fields)}"
        )
    execution = Execution(**data)
    execution.validate(where)
    return execution
