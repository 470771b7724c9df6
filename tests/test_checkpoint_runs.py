"""No run replaces or deletes another run's checkpoint (issue 32, item 2): run A saves into a
directory; its ``last.ckpt`` is copied; runs B and C both resume from the copy into A's
directory (the copy's restored names point there). Before, C overwrote B's ``last.ckpt``
(deleting its data) and, with ``save_top_k: 0``, B's only checkpoint was gone. Now B and C
write names of their own (``-vN``, said in one line each), and A's, B's and C's checkpoints are
all present and loadable at their own steps afterwards; a run that resumes from the newest
``last.ckpt`` of a directory still continues it in place (same names, old top-k rotated)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_resume import Notices, _module, _one_process

from lightning_sp import ModelCheckpoint, OptimizerConfig
from lightning_sp.checkpoint import read_full

from test_trainer import data


def _step(path: Path) -> int:
    """The global step a checkpoint holds (read in full: it loads)."""
    return int(read_full(path)["lightning"]["global_step"])


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def _runs(tmp_path: Path, corpus: Path, **checkpoint: Any) -> Callable[..., list[str]]:
    """``fit(name, steps, ckpt_path=None)``: train run ``name`` for ``steps`` steps into
    ``tmp_path / "ck"`` (``ModelCheckpoint(**checkpoint)``, saving every step as ``{step}``),
    resumed from ``ckpt_path``; returns its ``-vN`` notice lines."""
    optimizer = OptimizerConfig(lr=3e-3, warmup_steps=1)

    def fit(name: str, steps: int, ckpt_path: Path | None = None) -> list[str]:
        checkpoints = ModelCheckpoint(
            dirpath=tmp_path / "ck", every_n_train_steps=1, filename="{step}", **checkpoint
        )
        with Notices() as notices:
            _one_process(tmp_path, name, steps, [checkpoints]).fit(
                _module(optimizer),
                data(corpus),
                ckpt_path=None if ckpt_path is None else str(ckpt_path),
            )
        return notices.containing("from another run")

    return fit


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 1])
def test_two_runs_from_one_checkpoint_keep_each_others_checkpoints(
    tmp_path: Path, corpus: Path, top_k: int
) -> None:
    folder = tmp_path / "ck"
    fit = _runs(tmp_path, corpus, save_last=True, save_top_k=top_k)

    assert fit("a", 2) == []
    copy = tmp_path / "copy.ckpt"
    shutil.copytree((folder / "last.ckpt").resolve(), copy)
    b_lines = fit("b", 4, copy)
    c_lines = fit("c", 3, copy)
    assert len(b_lines) == 1 and "last-v1.ckpt" in b_lines[0], b_lines
    assert len(c_lines) == 1 and "last-v2.ckpt" in c_lines[0], c_lines
    assert _step(folder / "last.ckpt") == 2, "run A's last.ckpt was replaced"
    assert _step(folder / "last-v1.ckpt") == 4, "run B's last was replaced"
    assert _step(folder / "last-v2.ckpt") == 3, "run C's last is not its own"
    if top_k == 0:
        assert _names(folder) == ["last-v1.ckpt", "last-v2.ckpt", "last.ckpt"]
        return
    # top-1: each run keeps its newest step and deletes only its own older ones
    assert _names(folder) == ["last-v1.ckpt", "last-v2.ckpt", "last.ckpt", "step=2.ckpt",
                              "step=3.ckpt", "step=4.ckpt"]  # fmt: skip
    assert _step(folder / "step=2.ckpt") == 2  # A's, which B and C restored as their top-1
    assert _step(folder / "step=4.ckpt") == 4  # B's
    assert _step(folder / "step=3.ckpt") == 3  # C's (B had rotated its own step=3 out)


@pytest.mark.slow
def test_a_resume_from_the_newest_last_continues_in_place(tmp_path: Path, corpus: Path) -> None:
    folder = tmp_path / "ck"
    fit = _runs(tmp_path, corpus, save_last=True)

    fit("a", 2)
    assert fit("a2", 3, folder / "last.ckpt") == [], "the resume from last.ckpt warned"
    names = _names(folder)
    assert names == ["last.ckpt", "step=3.ckpt"], (  # step2 rotated out as before
        f"after the resume: {names}; last.ckpt does not continue in place"
    )
    assert _step(folder / "last.ckpt") == 3, "last.ckpt is not the resumed run's step 3"


@pytest.mark.slow
def test_save_last_link_points_at_the_newest_step_and_resumes_in_place(
    tmp_path: Path, corpus: Path
) -> None:
    """``save_last: "link"``: ``last.ckpt`` is a link to the newest saved step (a checkpoint
    directory here), a resume through the link continues the run in place, and a run resumed
    from a copy links its own ``last-v1.ckpt`` without touching the first run's link."""
    folder = tmp_path / "ck"
    fit = _runs(tmp_path, corpus, save_last="link", save_top_k=1)

    fit("a", 2)
    last = folder / "last.ckpt"
    assert last.is_symlink() and last.resolve() == (folder / "step=2.ckpt").resolve()
    assert fit("a2", 3, last) == []
    assert _names(folder) == ["last.ckpt", "step=3.ckpt"]
    assert last.is_symlink() and _step(last) == 3
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(last.resolve(), copy)
    lines = fit("b", 5, copy)
    assert len(lines) == 1 and "(last-v1.ckpt)" in lines[0], lines
    assert last.is_symlink() and _step(last) == 3, "run A's link was moved"
    assert _step(folder / "last-v1.ckpt") == 5 and (folder / "last-v1.ckpt").is_symlink()
