"""What every benchmark writes: its result as ``NAME.json`` and one markdown table as
``NAME.md`` (:func:`write`), and the number formats of those tables. The prose that reads the
tables (where we win and lose, and why) lives in ``docs/benchmarks.md``, not in code."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
"""Where a full run writes by default; a ``--smoke`` run writes under ``results/smoke/``
(ignored by git), so its meaningless numbers never replace a measurement."""


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
    (``markdown``: one table), and print the table. Non-finite numbers are refused
    (``allow_nan=False``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    (out_dir / f"{name}.md").write_text(markdown.rstrip("\n") + "\n")
    print(f"{out_dir / name}.json, .md:\n{markdown.rstrip()}", flush=True)


def parser(
    doc: str, smoke: str = "tiny shapes, seconds; its numbers mean nothing"
) -> argparse.ArgumentParser:
    """A benchmark's command line: ``doc``'s first line as its description, ``--smoke``
    (``smoke`` its help) and ``--out DIR``, where ``NAME.json`` and ``NAME.md`` go
    (:func:`out_dir`)."""
    result = argparse.ArgumentParser(description=doc.splitlines()[0])
    result.add_argument("--smoke", action="store_true", help=smoke)
    result.add_argument("--out", type=Path, default=None, help="output directory (default "
                        "benchmarks/results; benchmarks/results/smoke with --smoke)")  # fmt: skip
    return result


def arguments(doc: str, argv: list[str] | None, smoke: str, **options: Any) -> argparse.Namespace:
    """A benchmark's parsed command line: :func:`parser` (``smoke`` the help of ``--smoke``) and
    ``--NAME`` per option (``_`` written ``-``), given as its default or as ``(default, smoke
    value[, help])``: its type the default's; with ``--smoke`` the smoke value replaces it."""
    result = parser(doc, smoke)
    for name, value in options.items():
        full, *rest = value if isinstance(value, tuple) else (value,)
        help_ = rest[1] if len(rest) > 1 else None
        result.add_argument(f"--{name.replace('_', '-')}", type=type(full), default=full,
                            help=help_)  # fmt: skip
    args = result.parse_args(argv)
    for name, value in options.items():
        if args.smoke and isinstance(value, tuple):
            setattr(args, name, value[1])
    return args


def add_only(
    parser: argparse.ArgumentParser, sections: Sequence[str], default: Sequence[str],
    flag: str = "only",
) -> None:  # fmt: skip
    """``--only A,B`` (``--FLAG``): some of ``sections`` (``default`` when not given); an unknown
    name is argparse's one-line error naming the valid ones."""

    def names(value: str) -> list[str]:
        chosen = [name.strip() for name in value.split(",") if name.strip()]
        if unknown := sorted(set(chosen) - set(sections)):
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; valid: {', '.join(sections)}"
            )
        return chosen

    help_ = f"some of {','.join(sections)} (default: {','.join(default)})"
    parser.add_argument(f"--{flag}", type=names, default=list(default), help=help_)


def save(
    args: argparse.Namespace, argv: list[str] | None, name: str, result: dict[str, Any],
    markdown: str, **meta: Any,
) -> None:  # fmt: skip
    """What ``python -m benchmarks.NAME`` (``argv``: its arguments) measured:
    :func:`write` ``{"meta": {"command": ..., **meta}, **result}`` and ``markdown`` as ``NAME``
    into :func:`out_dir` of ``args.out`` and ``args.smoke``."""
    meta = {"command": command(f"benchmarks.{name}", argv), **meta}
    write(out_dir(args.out, args.smoke), name, {"meta": meta, **result}, markdown)


def out_dir(out: Path | None, smoke: bool) -> Path:
    """``out`` if given, else :data:`RESULTS` (``RESULTS/smoke`` for a smoke run)."""
    if out is not None:
        return out
    return RESULTS / "smoke" if smoke else RESULTS


def stamp() -> dict[str, Any]:
    """When and on what a benchmark ran, for its JSON's ``meta``: UTC date, torch's version and
    the load average at the start."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "loadavg": loadavg(),
    }


def loadavg() -> str:
    """The load average now, ``"1 / 5 / 15 min"``, or ``"n/a"`` where unknown."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def command(module: str, argv: list[str] | None) -> str:
    """The command line that ran a benchmark, for its JSON's ``meta``."""
    return " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])


# -- the GPU benchmarks ------------------------------------------------------------------------

PLUMBING = "**Plumbing check on CPU: the numbers mean nothing.**\n\n"
"""The first line of a GPU benchmark's table when it ran on the CPU (``--device cpu --smoke``)."""


def add_device(parser: argparse.ArgumentParser) -> None:
    """``--device cuda|cpu`` of a GPU benchmark (``cpu``: a plumbing check, with ``--smoke``)."""
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a plumbing check (--smoke)")  # fmt: skip


def refused(args: argparse.Namespace, name: str, needs: str = "a CUDA device") -> bool:
    """Whether ``benchmarks.NAME`` must not run with ``args`` (printed in one line on stderr):
    CUDA asked for and absent, or ``--device cpu`` without ``--smoke``."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"error: benchmarks.{name} needs {needs} and torch.cuda.is_available() is False "
              "(for a CPU plumbing check: --device cpu --smoke)", file=sys.stderr)  # fmt: skip
        return True
    if args.device == "cpu" and not args.smoke:
        print("error: --device cpu is a plumbing check only; add --smoke", file=sys.stderr)
        return True
    return False


def device_name(device: torch.device, cpu: str = "CPU") -> str:
    """The GPU's name, or ``cpu`` where ``device`` is the CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
