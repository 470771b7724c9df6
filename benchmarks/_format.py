"""Number and table formatting shared by the benchmark report's markdown and its notes."""

from __future__ import annotations

from typing import Any


def table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |"]
    lines.append("| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fixed(v: float, digits: int = 2) -> str:
    return f"{v:.{digits}f}"


def pct(v: float, digits: int = 1) -> str:
    return f"{100 * v:+.{digits}f}%"


def gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def ci(triplet: list[float], digits: int = 3) -> str:
    """``median [low, high]``."""
    median, lo, hi = triplet
    return f"{median:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def pct_ci(triplet: list[float]) -> str:
    median, lo, hi = (x - 1 for x in triplet)
    return f"{pct(median)} [{pct(lo)}, {pct(hi)}]"


def config_name(r: dict[str, Any]) -> str:
    return f"{'SP' if r['sequence_parallel'] else 'TP'} + {r['recompute']}"
