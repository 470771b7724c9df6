"""Crash-safe checkpoint names: a checkpoint appears under its final name only when complete.

A checkpoint named ``<dir>/<name>`` (``step100.ckpt``, ``last.ckpt``) is a symbolic link to a
hidden sibling data directory ``<dir>/.<name>.<token>``. A save writes a fresh data directory,
and only after every rank has finished writing does one process point the name at it, with
``os.replace`` of a new link over the old one: an atomic rename. So at every instant the name
resolves to a complete checkpoint (the previous one or the new one) or does not exist yet;
``last.ckpt`` changes only by that rename, and the data it pointed to before is deleted only
after the rename. A crash leaves at most an orphaned data directory, which the next save of the
same name deletes (:func:`collect_garbage`).

``LIGHTNING_SP_CHECKPOINT_FAULT=<point>:<rank>:<n>`` makes rank ``<rank>`` kill itself with
SIGKILL at ``<point>`` of its ``<n>``-th save in this process (1-based), to test all this:
``shard`` (in the middle of writing its shard files: they are left half written), ``written``
(after its shards are written, while other ranks may still be writing) and ``rename`` (all
data and metadata written, just before the rename; the committing rank 0 only). ``full``
does not kill: rank ``<rank>``'s shard write raises ``OSError(ENOSPC)``, a disk gone full.
``interrupt``: rank ``<rank>`` receives SIGINT in its shard write, and the write turns the
``KeyboardInterrupt`` into a ``RuntimeError`` (as ``torch.save``'s zip writer can).
``publish`` does not kill either: the publishing rank 0's rename raises ``OSError(EIO)``
after every rank wrote, the failure only rank 0 sees (the outcome must still be agreed).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import time
from pathlib import Path

FAULT_ENV = "LIGHTNING_SP_CHECKPOINT_FAULT"
FAULT_POINTS = ("shard", "written", "rename", "full", "interrupt", "publish")


def data_directory(final: Path, token: str) -> Path:
    """Where the data of the checkpoint ``final`` written under ``token`` lives."""
    return final.parent / f".{final.name}.{token}"


def _is_data_of(final: Path, path: Path) -> bool:
    return path.parent == final.parent and path.name.startswith(f".{final.name}.")


def current_data(final: Path) -> Path | None:
    """The data directory ``final`` points to (``None`` if it does not exist or is not a link)."""
    if not final.is_symlink():
        return None
    return final.parent / os.readlink(final)


def collect_garbage(final: Path) -> None:
    """Delete data directories of ``final`` that it does not point to (left by crashes)."""
    keep = current_data(final)
    if not final.parent.is_dir():
        return
    for path in final.parent.glob(f".{final.name}.*"):
        if path != keep and _is_data_of(final, path):
            if path.is_symlink() or path.is_file():
                path.unlink(missing_ok=True)
            else:
                shutil.rmtree(path, ignore_errors=True)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(final: Path, data: Path) -> None:
    """Point ``final`` at the complete checkpoint ``data`` by an atomic rename, then delete
    the data ``final`` pointed to before. One process calls this, after every rank wrote."""
    maybe_fault("rename", rank=0)
    if maybe_fault("publish", rank=0):
        raise OSError(errno.EIO, f"fault injection: publishing {final.name} failed")
    old = current_data(final)
    if final.exists() and not final.is_symlink():  # a real directory (an older format)
        final.rename(data_directory(final, "replaced"))
    link = data.with_name(data.name + ".link")
    link.unlink(missing_ok=True)
    os.symlink(data.name, link)  # relative: the folder can be moved or copied as a whole
    os.replace(link, final)
    _fsync_directory(final.parent)
    if old is not None and old != data and _is_data_of(final, old):
        shutil.rmtree(old, ignore_errors=True)


def remove(final: Path) -> None:
    """Delete the checkpoint ``final``: first the name, then its data."""
    data = current_data(final)
    if final.is_symlink():
        final.unlink()
    elif final.is_dir():
        shutil.rmtree(final, ignore_errors=True)
    if data is not None and _is_data_of(final, data):
        shutil.rmtree(data, ignore_errors=True)


_save_counts: dict[int, int] = {}


def count_save(rank: int) -> None:
    """Note that rank ``rank`` began a save (the ``<n>`` of the fault variable)."""
    _save_counts[rank] = _save_counts.get(rank, 0) + 1


def maybe_fault(point: str, rank: int) -> bool:
    """True when the fault variable names ``point`` for ``rank`` at this save; the caller (or
    this function, for points without cleanup work) then kills the process."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    want_point, want_rank, want_save = spec.split(":")
    if (want_point, int(want_rank), int(want_save)) != (point, rank, _save_counts.get(rank, 0)):
        return False
    if point not in ("shard", "full", "interrupt", "publish"):  # their callers act themselves
        die(point, rank)
    return True


def die(point: str, rank: int) -> None:
    """``kill -9`` this process (fault injection), saying when on stderr."""
    print(f"fault injection: kill -9 of rank {rank} at {point}, time {time.time():.3f}",
          file=sys.stderr, flush=True)  # fmt: skip
    os.kill(os.getpid(), signal.SIGKILL)
