"""The README and docs/ hold together: every relative link (a file, and a ``#heading`` in it)
resolves, every repository path and ``lightning_sp.`` name a page quotes in code spans exists
(so a moved module cannot leave the docs behind), and the README stays a five-minute read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli_runs import ROOT

PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md",
         ROOT / "benchmarks" / "README.md")  # fmt: skip
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
README_MAX_LINES = 300
FOLDERS = (
    "lightning_sp", "tests", "benchmarks", "examples", "configs", "scripts", "parallel", "model",
    "interop", "pipeline", "memory", "planner", "runtime", "optim", "checkpoint", "data",
    "training", "callbacks", "cli", "testing",
)  # fmt: skip
PATH = re.compile(rf"(?<![\w./])((?:{'|'.join(FOLDERS)})/[\w/.-]*\.(?:py|yaml|sh))")
DOTTED = re.compile(r"(?<![\w.])(lightning_sp(?:\.\w+)+)")


def _prose_lines(path: Path) -> list[str]:
    """The lines of ``path`` outside fenced code blocks, with inline code spans removed.
    A fence left open (the rest of the page would render as code) is an error."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    assert not fenced, f"{path.name}: a code fence is never closed"
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``\\w``, ``-`` and spaces
    kept, inline code's backticks dropped), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``; a repeated heading gets ``-1``, ``-2``, ... as on
    GitHub."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> tuple[list[str], int]:
    """``(the relative links of path that do not resolve, how many relative links it has)``.
    A link resolves when its file exists (relative to ``path``) and, with ``#anchor``, the
    target markdown file has that heading."""
    broken, checked = [], 0
    for line in _prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            checked += 1
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{path.name}: {target} (no heading #{anchor} in {resolved.name})")
    return broken, checked


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    broken, checked, anchored = [], 0, 0
    for page in PAGES:
        page_broken, page_checked = broken_links(page)
        broken += page_broken
        checked += page_checked
        anchored += sum(
            "#" in t for line in _prose_lines(page) for t in LINK.findall(line) if "://" not in t
        )
    assert not broken, "\n".join(broken)
    assert checked >= 40 and anchored >= 10, (checked, anchored)  # the check saw the links


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## The `estimate` command\n\n## Twice\n\n## Twice\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[good](other.md#the-estimate-command) [good too](other.md#twice-1) "
        "[self](#page) [web](https://example.com/x.md)\n"
        "[missing file](nowhere.md) [missing heading](other.md#the-plan)\n"
        "`[in code](nowhere-either.md)`\n\n```\n[fenced](nor-this.md)\n```\n"
    )
    broken, checked = broken_links(page)
    assert broken == [
        "page.md: nowhere.md (no such file)",
        "page.md: other.md#the-plan (no heading #the-plan in other.md)",
    ]
    assert checked == 5
    page.write_text("# Page\n\n```python\nx = 1\n\n[hidden](nowhere.md)\n")
    with pytest.raises(AssertionError, match=r"page\.md: a code fence is never closed"):
        broken_links(page)


def test_the_readme_is_a_five_minute_read() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    assert "bash scripts/test.sh" in "\n".join(lines) and "bash scripts/train.sh" in "\n".join(
        lines
    )


def missing_names(path: Path, root: Path = ROOT) -> tuple[list[str], int]:
    """``(the quoted names of path that do not exist, how many it quotes)``: inside code spans,
    a path under one of :data:`FOLDERS` (relative to the repository or to ``lightning_sp/``)
    must be a file, and ``lightning_sp.a.b.Name`` must be a module ``a/b`` whose text
    defines or names ``Name``."""
    missing, checked = [], 0
    for span in re.findall(r"`([^`\n]+)`", path.read_text()):
        for quoted in PATH.findall(span):
            checked += 1
            if not (root / quoted).is_file() and not (root / "lightning_sp" / quoted).is_file():
                missing.append(f"{path.name}: {quoted}")
        for dotted in DOTTED.findall(span):
            checked += 1
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):
                candidates = (root.joinpath(*parts[:i]).with_suffix(".py"),
                              root.joinpath(*parts[:i], "__init__.py"))  # fmt: skip
                module = next((c for c in candidates if c.is_file()), None)
                if module is not None:
                    break
            rest = parts[i:]
            if module is None or (rest and not re.search(rf"\b{rest[0]}\b", module.read_text())):
                missing.append(f"{path.name}: {dotted}")
    return missing, checked


def test_every_path_and_module_the_docs_quote_exists() -> None:
    missing, checked = [], 0
    for page in PAGES:
        page_missing, page_checked = missing_names(page)
        missing += page_missing
        checked += page_checked
    assert not missing, "\n".join(missing)
    assert checked >= 100, checked


def test_the_name_check_finds_a_moved_module(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "`lightning_sp/cli/checks.py`, `lightning_sp.cli.checks.check_fit_config`, "
        "`planner/ops.py`, `python -m lightning_sp.planner.table4`\n"
        "`lightning_sp.training.validation`, `training/launch_checks.py`, "
        "`lightning_sp.cli.checks.no_such_function`\n"
    )
    missing, checked = missing_names(page)
    assert missing == [
        "page.md: lightning_sp.training.validation",
        "page.md: training/launch_checks.py",
        "page.md: lightning_sp.cli.checks.no_such_function",
    ]
    assert checked == 7


def code_map_gaps(code_map: str, package: Path) -> list[str]:
    """The modules of ``package`` that ``code_map`` (docs/code-map.md's text) does not name:
    ``folder/x.py`` must appear as `` `x.py` `` in the section headed `` `folder/` ``
    (``folder/sub/x.py`` as `` `sub/x.py` ``), a top-level module as
    `` `lightning_sp/x.py` ``."""
    sections = {
        match.group(1): body
        for match, body in zip(
            re.finditer(r"^## `(\w+)/`.*$", code_map, flags=re.M),
            re.split(r"^## `\w+/`.*$", code_map, flags=re.M)[1:],
            strict=True,
        )
    }
    gaps = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if len(rel.parts) == 1:
            if f"`lightning_sp/{rel.name}`" not in code_map:
                gaps.append(str(rel))
        elif rel.name != "__init__.py" and (
            f"`{'/'.join(rel.parts[1:])}`" not in sections.get(rel.parts[0], "")
        ):
            gaps.append(str(rel))
    return gaps


def test_the_code_map_names_every_module() -> None:
    """A module added without a line in docs/code-map.md fails here, naming it."""
    gaps = code_map_gaps((ROOT / "docs" / "code-map.md").read_text(), ROOT / "lightning_sp")
    assert not gaps, f"docs/code-map.md does not name: {', '.join(gaps)}"


def test_the_code_map_check_finds_an_unnamed_module(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    for name in ("errors.py", "model/__init__.py", "model/gpt.py", "model/moe.py"):
        (tmp_path / name).write_text("")
    code_map = "| `lightning_sp/errors.py` |\n\n## `model/`: the GPT\n\n| `gpt.py` |\n"
    assert code_map_gaps(code_map, tmp_path) == ["model/moe.py"]
