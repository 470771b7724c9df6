"""After a signal no rank prints a traceback or a C++ trace (issue 32, item 5), ``cli.py fit``
on 2 ranks: a SIGTERM to the launcher while rank 1 is starting the process group (rank 1,
blocked in C++ on the launcher's store, used to print the 24-line TCPStore trace once the
store went) gives rank 0's one line and exit 143; a SIGKILL of the launcher ends rank 1 with it
(it used to wait on the store, or fail its next collective with a 79-line traceback)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from cli_runs import CLI, SMALL, TINY, children, error_lines, finish, gone, start

TRACES = ("Traceback", "Exception raised from", "frame #")


def _start(tmp_path: Path):
    logs = str(tmp_path / "logs")
    args = [CLI, "fit", "--config", TINY, *SMALL, "--trainer.max_steps", "200",
            "--trainer.default_root_dir", logs, "--trainer.callbacks", "[]"]  # fmt: skip
    return start(args, tmp_path)


def _wait_for_line(path: Path, text: str, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {text!r}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_during_process_group_start_up_is_one_line(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    # rank 0 waits in init_process_group for rank 1, which is still importing: the handler runs
    # once rank 1 has joined the store, and rank 1 is then left waiting on it in C++
    _wait_for_line(tmp_path / "stderr.txt", "Initializing distributed: GLOBAL_RANK: 0", proc)
    while not children(proc.pid):
        time.sleep(0.05)
    ranks = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    code, stderr = finish(proc, tmp_path, timeout=60)
    assert code == 143, stderr
    assert error_lines(stderr) == ["error: stopped by SIGTERM"], stderr
    traces = [line for line in stderr.splitlines() if line.startswith(TRACES)]
    assert traces == [], stderr
    assert all(gone(pid) for pid in ranks), "a rank outlived the launcher"


@pytest.mark.slow
def test_sigkill_of_the_launcher_ends_every_rank_without_a_trace(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    _wait_for_line(tmp_path / "stderr.txt", "Initializing distributed: GLOBAL_RANK: 1", proc)
    time.sleep(5)  # into the start-up or the first steps
    ranks = children(proc.pid)
    assert ranks, "no child rank"
    proc.send_signal(signal.SIGKILL)
    code, _ = finish(proc, tmp_path, timeout=30)
    assert code == -signal.SIGKILL
    deadline = time.monotonic() + 15
    while not all(gone(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in ranks), "rank 1 outlived its launcher's SIGKILL by 15 s"
    time.sleep(1)
    stderr = (tmp_path / "stderr.txt").read_text()
    traces = [line for line in stderr.splitlines() if line.startswith(TRACES)]
    assert traces == [], stderr
