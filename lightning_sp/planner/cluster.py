"""The hardware a step-time estimate is made for: one GPU type, how GPUs are wired, and the
efficiencies published (or measured on the device at hand) for its kernels and links.

The named clusters (:data:`~lightning_sp.planner.presets.PRESETS`), with the source of every
constant, and how a preset name or a YAML file of :class:`Cluster` fields becomes one
(:func:`~lightning_sp.planner.presets.load_cluster`) are :mod:`lightning_sp.planner.presets`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

from lightning_sp.errors import ConfigError
from lightning_sp.planner.execution import Execution

KERNEL_KINDS: tuple[str, ...] = ("gemm", "attention")
"""The kinds of :class:`MeasuredKernel` the step-time model looks up."""


def _bad_number(value: object, allow_zero: bool = False) -> bool:
    """Whether ``value`` is not a finite positive number (``>= 0`` with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    return not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero)


@dataclass(frozen=True)
class MeasuredKernel:
    """One measured kernel time: a GEMM ``[batch] x (m x k) @ (k x n)`` (``kind = "gemm"``) or
    an attention core (``kind = "attention"``: ``m`` = sequence, ``n`` = head dim, ``batch``
    = micro-batch x heads on one rank; forward + backward)."""

    kind: str
    """One of :data:`KERNEL_KINDS`."""
    m: int
    """Rows of the output (attention: the sequence)."""
    n: int
    """Columns of the output (attention: the head dimension)."""
    k: int
    """The reduced dimension (attention: 0)."""
    batch: int
    """Independent products (attention: micro-batch x heads)."""
    seconds: float
    """The measured time, finite and positive."""

    def validate(self, where: str) -> None:
        """:class:`ConfigError` (one line naming ``where``, the field and the value) unless the
        kind is known, the sizes are positive integers (``k`` may be 0) and ``seconds`` is
        finite and positive."""
        if self.kind not in KERNEL_KINDS:
            raise ConfigError(
                f"{where}.kind={self.kind!r} is not a kernel kind; valid: {', '.join(KERNEL_KINDS)}"
            )
        for name in ("m", "n", "k", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or _bad_number(value, allow_zero=name == "k"):
                raise ConfigError(f"{where}.{name}={value!r} must be a positive integer")
        if _bad_number(self.seconds):
            raise ConfigError(
                f"{where}.seconds={self.seconds!r} must be a finite positive number of seconds"
            )


@dataclass(frozen=True)
class Calibration:
    """Kernel times measured on one device (``lightning_sp.planner.calibrate``); the step-time model
    uses a measured time when it has the exact shape, and its analytic model otherwise."""

    device: str = ""
    """The device measured (``torch.cuda.get_device_name`` or ``cpu``)."""

    kernels: tuple[MeasuredKernel, ...] = ()
    """The measured kernel times."""

    def lookup(self, kind: str, m: int, n: int, k: int, batch: int) -> float | None:
        """The measured seconds of this exact kernel, or ``None``."""
        for x in self.kernels:
            if (x.kind, x.m, x.n, x.k, x.batch) == (kind, m, n, k, batch):
                return x.seconds
        return None


@dataclass(frozen=True)
class Cluster:
    """One GPU type and its wiring. Bandwidths are bytes per second per GPU, one direction."""

    name: str
    """Preset name or file the cluster was read from."""

    peak_flops: float
    """Dense BF16 Tensor Core peak of one GPU, FLOP/s (datasheet)."""

    hbm_bytes: float
    """Memory per GPU, bytes (the default for ``--device_memory``)."""

    hbm_bandwidth: float
    """Memory bandwidth per GPU, bytes/s (datasheet)."""

    num_sms: int
    """Streaming multiprocessors per GPU (wave quantization of GEMMs)."""

    gpus_per_node: int
    """GPUs joined by NVLink in one node."""

    nvlink_bandwidth: float
    """NVLink bandwidth per GPU, one direction, bytes/s."""

    network_bandwidth: float
    """Inter-node bandwidth per GPU, one direction, bytes/s (one NIC per GPU)."""

    gemm_efficiency: float
    """Fraction of ``peak_flops`` the best-shaped large GEMM reaches (MAMF)."""

    hbm_efficiency: float
    """Fraction of ``hbm_bandwidth`` a streaming kernel reaches."""

    nvlink_efficiency: float
    """Fraction of ``nvlink_bandwidth`` NCCL's ring collectives reach (bus bandwidth)."""

    network_efficiency: float
    """Fraction of ``network_bandwidth`` collectives and send/recv reach."""

    flash_attention_efficiency: float
    """Fraction of ``peak_flops`` a fused (flash) attention kernel reaches, forward +
    backward (``attention: sdpa``), without attention dropout
    (:attr:`flash_attention_dropout_cost` prices that)."""

    flash_attention_dropout_cost: float = 1.0
    """The fused attention kernel's forward + backward time with attention dropout over its
    time without, at the same shapes: what drawing and applying a dropout mask per score
    inside the kernel costs. Priced when a layout's ``attention_dropout > 0``
    (:func:`~lightning_sp.planner.kernels.flash_attention_seconds`); 1.0 where unmeasured.
    ``lightning-sp calibrate`` measures it when its config has attention dropout."""

    fp8_peak_flops: float | None = None
    """Dense FP8 Tensor Core peak of one GPU, FLOP/s (datasheet); None: no FP8 GEMMs (an
    A100). What an ``fp8`` run's linears are priced at (:mod:`lightning_sp.planner.fp8`)."""

    gemm_tile: tuple[int, int] = (256, 128)
    """Output tile of one thread block, ``(rows, cols)``; either orientation is tried."""

    calibration: Calibration = field(default_factory=Calibration)
    """Measured kernel times (empty for the presets)."""

    execution: Execution = field(default_factory=Execution)
    """What the training stack overlaps and the routing balance it runs at
    (:mod:`lightning_sp.planner.execution`; default: this project's code)."""

    def validate(self) -> None:
        """:class:`ConfigError` (one line naming the field and the value) unless every figure
        is a finite positive number, every efficiency is in (0, 1], ``gemm_tile`` is two
        positive integers and every calibration kernel is valid
        (:meth:`MeasuredKernel.validate`)."""
        where = f"cluster {self.name}"
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type not in ("float", "int"):
                continue
            if _bad_number(value) or (f.type == "int" and not isinstance(value, int)):
                kind = "integer" if f.type == "int" else "finite number"
                raise ConfigError(f"{where}: {f.name}={value!r} must be a positive {kind}")
            if f.name.endswith("efficiency") and not 0 < value <= 1:
                raise ConfigError(f"{where}: {f.name}={value!r} must be in (0, 1]")
        fp8 = self.fp8_peak_flops
        if fp8 is not None and _bad_number(fp8):
            raise ConfigError(f"{where}: fp8_peak_flops={fp8!r} must be a positive finite number")
        tile = self.gemm_tile
        if (
            not isinstance(tile, tuple)
            or len(tile) != 2
            or any(not isinstance(x, int) or _bad_number(x) for x in tile)
        ):
            raise ConfigError(
                f"{where}: gemm_tile={list(tile) if isinstance(tile, tuple) else tile!r} must be "
                "two positive integers [rows, cols], e.g. [256, 128]"
            )
        for i, kernel in enumerate(self.calibration.kernels):
            kernel.validate(f"{where}: calibration.kernels[{i}]")
        self.execution.validate(where)

    @property
    def gemm_flops(self) -> float:
        """The best GEMM rate, FLOP/s: ``peak_flops x gemm_efficiency``."""
        return self.peak_flops * self.gemm_efficiency

    @property
    def memory_rate(self) -> float:
        """Achievable memory bandwidth, bytes/s."""
        return self.hbm_bandwidth * self.hbm_efficiency

    def within_node(self, group: int) -> bool:
        """Whether a group of ``group`` consecutive ranks lies inside one node."""
        return group <= self.gpus_per_node and self.gpus_per_node % group == 0

    def members_in_node(self, stride: int, group: int) -> int:
        """Of a group of ``group`` ranks ``stride`` apart (``0, stride, 2·stride, ...``,
        nodes of ``gpus_per_node`` consecutive ranks), how many share a node with the
        least-accompanied one (itself included): ``group`` when the group lies inside a node, 1
        when every member has a node to itself. An expert-parallel group is ``e`` ranks
        ``t`` apart (:class:`~lightning_sp.parallel.state.ParallelState`'s mesh)."""
        nodes = Counter(i * stride // self.gpus_per_node for i in range(group))
        return min(nodes.values())

    def link_rate(self, within_node: bool) -> float:
        """Achievable bandwidth per GPU, one direction, of NVLink or the network."""
        if within_node:
            return self.nvlink_bandwidth * self.nvlink_efficiency
        return self.network_bandwidth * self.network_efficiency
