"""Imports point one way: every import of a ``lightning_sp`` module (at module level, in a
function, or under ``TYPE_CHECKING``) names a module of its own layer or a lower one, and no
modules import each other in a circle.

The layers, lowest first: ``errors``, ``parallel``, ``testing``, ``model``, ``interop``,
``pipeline``, ``memory``, ``planner`` (the pure model of the system), then ``runtime`` (signals,
rank agreement, the non-finite guard), ``optim``, ``checkpoint``, ``data``, ``training`` (the
Lightning adapter), ``callbacks`` and ``cli`` (the commands); the package's ``__init__`` and
``__main__`` sit above them all. The imports are read from the source (``ast``), so a lazy
import inside a function counts like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import lightning_sp

PACKAGE = Path(lightning_sp.__file__).parent
LAYERS = (
    "errors", "parallel", "testing", "model", "interop", "pipeline", "memory", "planner",
    "runtime", "optim", "checkpoint", "data", "training", "callbacks", "cli",
)  # fmt: skip


def _modules() -> dict[str, Path]:
    """``{"parallel.state": path, ...}``: every module of the package, by its dotted name
    under ``lightning_sp`` (a package by its folder's name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(path: Path, name: str, modules: dict[str, Path]) -> Iterator[str]:
    """The package's modules that ``path`` (module ``name``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from _known([alias.name for alias in node.names], name, modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join(["lightning_sp", *[p for p in anchor if p], base]).strip(".")
            named = list(_known([f"{base}.{alias.name}" for alias in node.names], name, modules))
            # `from pkg import mod` imports mod; `from pkg import name` the package itself
            yield from named or _known([base], name, modules)


def _known(targets: list[str], name: str, modules: dict[str, Path]) -> Iterator[str]:
    for target in targets:
        short = target.removeprefix("lightning_sp.")
        if target.startswith("lightning_sp.") and short in modules and short != name:
            yield short


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set(_imported(path, name, modules)) for name, path in modules.items()}


def _layer(module: str) -> int:
    """The module's layer (the package's ``__init__``, named ``""``, above every layer)."""
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else len(LAYERS)


def test_every_module_has_a_layer() -> None:
    tops = ("", "__main__")  # the package itself, above every layer
    unplaced = [m for m in _modules() if m not in tops and m.split(".")[0] not in LAYERS]
    assert not unplaced, f"modules outside the layers {LAYERS}: {unplaced}"


def test_no_import_runs_up_the_layers() -> None:
    upward = [
        f"{module} ({LAYERS[_layer(module)]}) imports {target} ({LAYERS[_layer(target)]})"
        for module, targets in _graph().items()
        if module
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


LOOP = ("training", "pipeline", "checkpoint", "callbacks")
"""The folders that drive a model: they reach a part's modules only through the generic module
hooks (``model/hooks.py``), never by importing the part."""


def _part_imports(graph: dict[str, set[str]], part: str) -> list[str]:
    """The imports of ``part`` (a folder under ``model``) by a module of :data:`LOOP`."""
    return [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.split(".")[0] in LOOP
        for target in sorted(targets)
        if target == part or target.startswith(f"{part}.")
    ]


def test_the_loop_imports_nothing_from_the_moe_folder() -> None:
    found = _part_imports(_graph(), "model.moe")
    assert not found, "training/pipeline/checkpoint/callbacks import the MoE folder:\n" + "\n".join(
        found
    )


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_circle_of_imports() -> None:
    circles = _circles(_graph())
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_the_checker_sees_an_upward_import_and_a_circle() -> None:
    """The two checks on a made-up graph, so that they cannot pass by seeing nothing."""
    graph = {"parallel.a": {"training.b"}, "training.b": {"parallel.a"}, "model.c": set()}
    assert _circles(graph) == [{"parallel.a", "training.b"}]
    assert _layer("training.b") > _layer("parallel.a")
    assert _part_imports({"training.x": {"model.moe.layer"}}, "model.moe") == [
        "training.x imports model.moe.layer"
    ]
    real = _graph()
    assert "parallel.state" in real["training.strategy"]  # the reader sees real imports
    assert "planner.layout" in real["planner.estimate"]
    assert "model.moe.layer" in real["model.moe.part"]
