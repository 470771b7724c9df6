"""How a run ends early: on a signal, or when a rank dies. Never a hang, always a reason.

Signals (installed in every rank by :func:`install`, again when training starts, replacing
Lightning's SIGTERM handler, which runs a collective inside the handler):

* ``SIGTERM`` (a scheduler's preemption, ``kill``): recorded, and passed on to the launcher's
  child ranks. During training every rank reports the signal in the step's non-finite-guard
  exchange (no extra collective), so all ranks agree on the same step: it finishes, the
  ``lightning_sp.ModelCheckpoint`` callbacks save it (``last.ckpt`` continues the run exactly)
  and the run stops; ``cli.py`` then exits with 143. Outside training, or on a second
  ``SIGTERM`` (more than :data:`SAME_STOP_SECONDS` after the first: a scheduler's SIGTERM to
  every rank and the launcher's copy of it are one stop), the process exits at once
  (``SystemExit(143)``).
* ``SIGINT`` (Ctrl-C): ``KeyboardInterrupt`` as usual (Lightning's interrupt path tears down
  without a barrier and kills the launcher's children); ``cli.py`` exits with 130.

A dead launcher: every rank it started is killed with it (:func:`install`), silently.

A dead rank: under Lightning's subprocess launcher (``start_method: popen``) rank 0 watches
its child ranks (:class:`RankWatcher`, in place of Lightning's observer, which names no rank
and kills the launcher with ``SIGKILL``). When one ends with a non-zero code while this
process is not itself stopping, rank 0 prints one line naming it (rank, pid, signal or exit
code), kills the other ranks and exits with that code (128 + the signal's number for a
signal) once its own main thread has failed, or after a short grace. A rank that ends on a bad
input it found alone (:class:`~lightning_sp.runtime.agree.LocalError`, exit code 2) leaves
its one line for rank 0 (:func:`report`), which prints it in place of the exit code.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

SAME_STOP_SECONDS = 2.0
"""A SIGTERM this soon after the first is the same stop (a scheduler such as SLURM signals
every process of the job, and the launcher passes its own on to its children); a later one
means "now"."""

GRACE_SECONDS = 5.0
"""How long rank 0 lets its main thread fail on its own after a rank died, before it exits."""

_state: dict[str, Any] = {
    "received": 0,  # the last stop signal this process received (0: none)
    "received_at": 0.0,  # when (time.monotonic) it was received
    "interrupted": False,  # a handler raised: the signal broke whatever this process was doing
    "agreed": 0,  # the stop signal the ranks agreed on during training (0: none)
    "stopping": False,  # this process is ending the job itself: a child's exit is expected
    "dead": None,  # (exit code, message) of a rank that died first
    "training": False,  # inside the training loop: SIGTERM stops at the next step
    "children": [],  # the launcher's child processes (rank 0 under popen)
    "first_child_rank": 1,  # the global rank of the first child
    "reported": False,  # the watcher printed the dead rank's line
}


def exit_code(signum: int) -> int:
    """The shell's exit code for a process ended by ``signum``: 128 + its number."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def received() -> int:
    """The stop signal this process received (0: none)."""
    return int(_state["received"])


def interrupted() -> bool:
    """Whether a stop signal's handler raised in this process (SIGINT; SIGTERM outside
    training or a second time): whatever failed since may be the signal's doing. A SIGTERM
    during training raises nothing: the step, and its save, run on."""
    return bool(_state["interrupted"])


def agreed() -> int:
    """The stop signal the ranks agreed to stop on during training (0: none)."""
    return int(_state["agreed"])


def agree(signum: int) -> None:
    """Every rank has learnt (in one exchange) that some rank received ``signum``."""
    _state["agreed"] = signum
    _state["stopping"] = True


def stopping() -> None:
    """This process is ending the job (an exception, an interrupt): children's exits are ours."""
    _state["stopping"] = True


def dead_rank_reported() -> bool:
    """Whether the watcher has printed the dead rank's line already."""
    return bool(_state["reported"])


def end_children(grace: float = 3.0) -> None:
    """Rank 0 under the subprocess launcher, leaving: wait up to ``grace`` seconds for its
    child ranks to end, then kill those still running (none outlives the launcher)."""
    deadline = time.monotonic() + grace
    for child in _state["children"]:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def find_dead_rank(wait: float = 5.0) -> tuple[int, str] | None:
    """``(exit code, message)`` of a rank that died first: the watcher's finding, or (rank 0,
    after its own main thread failed) a child that ended with a non-zero code within
    ``wait`` seconds (a peer's failure reaches rank 0 while that peer is still tearing
    down); None if every child is still running or succeeded."""
    deadline = time.monotonic() + wait
    while _state["dead"] is None and _state["children"]:
        for index, child in enumerate(_state["children"]):
            code = child.poll()
            if code not in (None, 0):
                _state["dead"] = _describe_child(index, child, code)
                break
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return _state["dead"]


def _describe_child(index: int, child: subprocess.Popen, returncode: int) -> tuple[int, str]:
    code, words = describe_exit(returncode)
    rank = _state["first_child_rank"] + index
    reported = _reported(child.pid)
    if reported is not None:  # the rank's own line (a bad input it found alone)
        return code, f"{reported} (found by rank {rank})"
    return code, f"rank {rank} (pid {child.pid}) {words}"


REPORTS_ENV = "LIGHTNING_SP_REPORTS"
"""The directory where the launcher's child ranks leave their one-line errors for rank 0
(set by :class:`WatchedLauncher` for its children)."""


def report(message: str) -> bool:
    """Hand this child rank's one-line error to rank 0, which prints it when it finds this
    rank ended, in place of "rank N exited with code 2". False where nobody collects it (rank
    0 itself, torchrun's ranks): the caller prints it."""
    directory = os.environ.get(REPORTS_ENV)
    if not directory or not os.path.isdir(directory):
        return False
    path = os.path.join(directory, str(os.getpid()))
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        f.write(message)
    os.replace(f"{path}.tmp", path)  # whole, or not there
    return True


def _reported(pid: int) -> str | None:
    directory = os.environ.get(REPORTS_ENV)
    try:
        with open(os.path.join(directory or "", str(pid)), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def set_training(active: bool) -> None:
    """Whether the training loop is running (a SIGTERM then waits for the step's end)."""
    _state["training"] = active


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    now = time.monotonic()
    first = not _state["received"]
    if not first and now - _state["received_at"] < SAME_STOP_SECONDS:
        return  # the same stop: a scheduler signals every rank, and the launcher passes it on
    _state["received"], _state["received_at"] = signum, now
    for child in _state["children"]:
        if child.poll() is None:
            child.send_signal(signum)
    if not first or not _state["training"]:
        stopping()
        _state["interrupted"] = True
        # before this process goes (rank 0 serves the process group's store): a child blocked
        # in the group's start-up cannot run its handler, and would print C++'s trace of the
        # lost store; it is killed instead
        end_children()
        raise SystemExit(exit_code(signum))


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _state["received"] = signum
    _state["interrupted"] = True
    stopping()
    raise KeyboardInterrupt


def wait_for_stop(seconds: float) -> int | None:
    """A child rank whose step failed without a signal of its own, e.g. a collective or a
    checkpoint save broken because rank 0 was interrupted: the launcher ends it with the
    signal it received in a moment. Wait up to ``seconds`` for that signal; its exit code, or
    ``None`` when none came (the failure is this rank's own)."""
    deadline = time.monotonic() + seconds
    try:
        while not _state["received"] and time.monotonic() < deadline:
            time.sleep(0.05)
    except (KeyboardInterrupt, SystemExit):  # the handlers' way of ending the wait
        pass
    return exit_code(received()) if received() else None


def install() -> None:
    """Install this module's SIGTERM and SIGINT handlers (main thread only; a no-op
    elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, _on_sigint)
        _end_with_the_launcher()


def _end_with_the_launcher() -> None:
    """A rank its launcher started (Lightning's subprocess launcher: ``LOCAL_RANK`` > 0;
    torchrun: every rank) is killed when the launcher dies (Linux ``PR_SET_PDEATHSIG``): after a
    ``SIGKILL`` of the launcher nothing is left to finish the job with, and the rank would
    otherwise fail in its next collective with a traceback, or wait for the process group's
    store until its timeout."""
    started = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_RANK", "0") != "0"
    if not started or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the call
        os._exit(exit_code(signal.SIGKILL))


def describe_exit(returncode: int) -> tuple[int, str]:
    """``(exit code, words)`` for a child's ``returncode`` (negative: killed by a signal)."""
    if returncode < 0:
        return exit_code(-returncode), f"was killed by {signal_name(-returncode)}"
    if returncode > 128 and returncode - 128 in {s.value for s in signal.Signals}:
        return returncode, f"exited with code {returncode} ({signal_name(returncode - 128)})"
    return returncode, f"exited with code {returncode}"


class RankWatcher(threading.Thread):
    """Rank 0's watch over the ranks it launched (the launcher's children, in rank order)."""

    def __init__(self, period: float = 0.5) -> None:
        super().__init__(daemon=True, name="lightning-sp-rank-watcher")
        self.period = period

    @override
    def run(self) -> None:
        children: list[subprocess.Popen] = _state["children"]
        while True:
            time.sleep(self.period)
            codes = [child.poll() for child in children]
            if all(code == 0 for code in codes) or _state["dead"] is not None:
                return
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed and not _state["stopping"]:
                index, returncode = failed[0]
                self._stop_the_job(_describe_child(index, children[index], returncode))
                return

    def _stop_the_job(self, dead: tuple[int, str]) -> None:
        _state["dead"] = dead
        code, message = dead
        print(f"error: {message}; stopping the other ranks", file=sys.stderr, flush=True)
        _state["reported"] = True
        for other in _state["children"]:
            if other.poll() is None:
                other.kill()
        time.sleep(GRACE_SECONDS)  # the main thread fails in its next collective and exits
        os._exit(code)


class WatchedLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher (``ddp``'s) with :class:`RankWatcher` in place of its
    child-process observer."""

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(
            num_devices=self.num_processes, num_nodes=self.num_nodes
        )
        if not self.cluster_environment.creates_processes_externally:
            reports = tempfile.mkdtemp(prefix="lightning_sp_reports_")
            atexit.register(shutil.rmtree, reports, ignore_errors=True)
            os.environ[REPORTS_ENV] = reports  # the children inherit it
            self._call_children_scripts()
            _state["children"] = self.procs
            _state["first_child_rank"] = (
                self.cluster_environment.node_rank() * self.num_processes + 1
            )
            RankWatcher().start()
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        stopping()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)
