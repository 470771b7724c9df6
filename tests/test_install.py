"""The commands ship in the package: a plain (non-editable) ``pip install .`` into a new virtual
environment gives ``lightning-sp`` and ``python -m lightning_sp``, and both run from a
directory outside the repository.

The new environment holds exactly what ``pyproject.toml`` declares, installed by pip's own
resolver: the distributions of the declared requirements and of theirs (markers and extras
evaluated), no other. They are borrowed from the test environment through a path file to a
directory of links to their files (nothing is downloaded), and pip installs this package from
a wheel it builds of the working tree *with* its dependencies, against the index-less
environment: a requirement the test environment lacks fails the install, and a module the
package imports without declaring it fails the commands. Chat SFT needs the ``chat`` extra:
without it, one line says what to install; with it (a second environment), a chat corpus
prepares.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from cli_runs import ROOT, SMALL
from corpora import chat_tokenizer, conversations, jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # pip builds a wheel, installs it


def _declared(extras: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions of this package's declared requirements (with ``extras``),
    theirs, and so on: the closure, markers and extras evaluated."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"]]
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    found: dict[str, metadata.Distribution] = {}
    requested: dict[str, set[str]] = {}
    todo = [(Requirement(r), {""}) for r in wanted]
    while todo:
        requirement, parent_extras = todo.pop()
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in parent_extras):
            continue
        name = canonicalize_name(requirement.name)
        new = set(requirement.extras) - requested.get(name, set())
        if name in found and not new:
            continue
        dist = found.get(name) or metadata.distribution(requirement.name)
        found[name] = dist
        requested[name] = requested.get(name, set()) | new
        todo += [(Requirement(r), {"", *requested[name]}) for r in dist.requires or []]
    return list(found.values())


def _link_declared(directory: Path, extras: tuple[str, ...]) -> None:
    """Links in ``directory`` to the top-level files (packages, modules, ``.dist-info``) of
    the :func:`_declared` distributions."""
    directory.mkdir()
    for dist in _declared(extras):
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (directory / top).exists():
                (directory / top).symlink_to(source)


def _install(tmp_path: Path, extras: tuple[str, ...] = ()) -> Path:
    """A new venv under ``tmp_path`` with this repository (and ``extras``) installed by ``pip
    install`` with its declared dependencies, which alone the venv holds."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    _link_declared(tmp_path / "declared", extras)
    (Path(purelib) / "declared.pth").write_text(f"{tmp_path / 'declared'}\n")
    source = tmp_path / "source"  # what a wheel is built of; the build writes beside it
    shutil.copytree(ROOT / "lightning_sp", source / "lightning_sp",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    target = f"{source}[{','.join(extras)}]" if extras else str(source)
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-build-isolation", target],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PIP_NO_INDEX": "1"},
    )  # fmt: skip
    assert installed.returncode == 0, (
        "pip install with the declared dependencies failed:\n" + (installed.stderr[-3000:])
    )
    return env_dir


@pytest.fixture(scope="module")
def core_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The core install (no extras), one for the module: no test changes the venv."""
    return _install(tmp_path_factory.mktemp("core"))


def test_pip_install_ships_the_commands(tmp_path: Path, core_install: Path) -> None:
    env_dir = core_install
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    python, script = env_dir / "bin" / "python", env_dir / "bin" / "lightning-sp"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}

    where = subprocess.run(
        [python, "-c", "import lightning_sp; print(lightning_sp.__file__)"],
        cwd=outside, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert where.startswith(str(env_dir)), f"lightning_sp imported from {where}, not the wheel"
    assert script.read_text().startswith(f"#!{python}"), "the script runs another interpreter"

    estimate = subprocess.run(
        [script, "estimate", "--config", str(ROOT / "configs" / "gpt175b.yaml")],
        cwd=outside, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    assert "configured: SP + " in estimate.stdout

    fit = subprocess.run(
        [python, "-m", "lightning_sp", "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
         *SMALL, "--trainer.max_steps", "2",
         "--trainer.default_root_dir", str(outside / "run"),
         "--data.cache_dir", str(outside / "cache")],
        cwd=outside, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-2000:]
    assert list((outside / "run").rglob("metrics.csv")), "fit logged nothing"


def _prepare_chat(env_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """``lightning-sp prepare`` of a chat corpus in the venv ``env_dir``."""
    rows = jsonl(tmp_path / "chat.jsonl", conversations(8))
    tokenizer = chat_tokenizer(tmp_path / "tok")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [env_dir / "bin" / "lightning-sp", "prepare", "--config",
         str(ROOT / "configs" / "tiny.yaml"), "--data.paths", str(rows),
         "--data.chat_template_dir", str(tokenizer), "--data.prepared_dir", str(tmp_path / "p"),
         "--model.config.seq_length", "64"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_chat_sft_needs_the_chat_extra_and_says_so(tmp_path: Path, core_install: Path) -> None:
    """Issue 40: chat SFT imports transformers, which the core install does not declare. On
    the core install it is one line naming the extra; with ``lightning-sp[chat]`` the chat
    corpus prepares."""
    (tmp_path / "core").mkdir()
    core = _prepare_chat(core_install, tmp_path / "core")
    assert core.returncode == 2, core.stderr[-3000:]
    assert (core.stdout + core.stderr).splitlines() == [
        "error: chat SFT (data.chat_template_dir) renders conversations with a Hugging Face "
        "chat template, which needs the package 'transformers': install the chat extra, pip "
        "install 'lightning-sp[chat]' (transformers, jinja2)"
    ], core.stderr[-3000:]
    chat = _prepare_chat(_install(tmp_path / "chat", ("chat",)), tmp_path / "chat")
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "prepared 8 conversations" in chat.stdout + chat.stderr
