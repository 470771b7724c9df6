"""The commands ship in the package: a plain (non-editable) ``pip install .`` into a new virtual
environment gives ``lightning-sp`` and ``python -m lightning_sp``, and both run from a
directory outside the repository.

The new environment borrows the test environment's dependencies (torch, Lightning, ...) through
a path file, so that only this package is installed, from a wheel that pip builds of the
working tree: nothing of the repository is importable in it but what the wheel holds.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from cli_runs import ROOT, SMALL

pytestmark = pytest.mark.slow


def _install(tmp_path: Path) -> Path:
    """A new venv under ``tmp_path`` with this repository installed by ``pip install .``."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # dependencies from the test environment; its .pth files (an editable install of this
    # package among them) are not read from a directory a path file adds
    (Path(purelib) / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    source = tmp_path / "source"  # what a wheel is built of; the build writes beside it
    shutil.copytree(ROOT / "lightning_sp", source / "lightning_sp",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-build-isolation", str(source)],
        check=True, capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )  # fmt: skip
    return env_dir


def test_pip_install_ships_the_commands(tmp_path: Path) -> None:
    env_dir = _install(tmp_path)
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
