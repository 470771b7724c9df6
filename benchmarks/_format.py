"""What every benchmark writes: its result as ``NAME.json`` and one markdown table as
``NAME.md`` (:func:`write`), and the number formats of those tables. The prose that reads the
tables (where we win and lose, and why) lives in ``docs/benchmarks.md``, not in code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned."""

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


def ci(triplet: list[float], digits: int = 3) -> str:
    """``median [low, high]``."""
    median, lo, hi = triplet
    return f"{median:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def pct_ci(triplet: list[float]) -> str:
    """A ratio's ``median [low, high]`` as percent changes."""
    median, lo, hi = (x - 1 for x in triplet)
    return f"{pct(median)} [{pct(lo)}, {pct(hi)}]"


def write(out_dir: Path, name: str, result: dict[str, Any], markdown: str) -> None:
    """Write ``out_dir/NAME.json`` (``result``, everything measured) and ``out_dir/NAME.md``
    (``markdown``: one table). Non-finite numbers are refused (``allow_nan=False``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    (out_dir / f"{name}.md").write_text(markdown.rstrip("\n") + "\n")
