"""The paper's activation-memory formulas (Table 2), in bytes.

Symbols as in the paper: s sequence length, b micro-batch, h hidden size, a heads, t tensor
parallel size. Activations are 2 bytes, dropout masks 1 byte.
"""

from __future__ import annotations

from lightning_sp.errors import ConfigError

TABLE2_ROWS = (
    "no_parallelism",
    "tensor_parallel",
    "tensor_sequence_parallel",
    "tensor_parallel_selective",
    "tensor_sequence_parallel_selective",
    "full_recompute",
)


def table2_row(sequence_parallel: bool, recompute: str, tensor_parallel_size: int) -> str:
    """The Table 2 row that describes a (sequence_parallel, recompute, t) configuration."""
    if recompute == "full":
        return "full_recompute"
    if tensor_parallel_size == 1 and not sequence_parallel:
        return "no_parallelism" if recompute == "none" else "tensor_parallel_selective"
    base = "tensor_sequence_parallel" if sequence_parallel else "tensor_parallel"
    return base + ("_selective" if recompute == "selective" else "")


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    *,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes one transformer layer stores on one rank (paper Table 2).

    ``full`` recompute stores the layer input, ``2sbh`` (``2sbh/t`` under sequence parallelism,
    where the input is the sequence shard).
    """
    if recompute not in ("none", "selective", "full"):
        raise ConfigError(f"recompute={recompute!r} is not one of none, selective, full")
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / t if sequence_parallel else 2 * sbh
    attention_scores = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    if sequence_parallel:
        return sbh * (34 / t + attention_scores)
    return sbh * (10 + 24 / t + attention_scores)
