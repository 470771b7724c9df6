"""Running ``python cli.py`` as a user does, for the tests that go through it: the one helper
for these subprocesses (``run`` to completion, ``start`` to signal it mid-run), a small
config, and the ``error:`` lines of a run's stderr."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = str(ROOT / "cli.py")
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = ["--model.config.hidden_size", "64", "--model.config.num_layers", "2",
         "--model.config.num_heads", "4", "--model.config.seq_length", "64",
         "--data.batch_size", "4", "--data.max_documents", "30",
         "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
         "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false"]  # fmt: skip
"""configs/tiny.yaml shrunk to seconds per step on 2 busy cores (no validation)."""


def _env() -> dict[str, str]:
    # PYTHONFAULTHANDLER: a rank sent SIGABRT prints every thread's stack (see wait_for)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


RENDEZVOUS_TRIES = 3
"""How many times :func:`run` starts a run whose rendezvous found its port taken."""


def port_taken(stderr: str) -> bool:
    """Whether a run failed because rank 0's rendezvous could not listen on its port: Lightning's
    launcher picks a free port (bind to port 0, close) and rank 0 binds it again later; another
    test's connection can take it in between (EADDRINUSE). Nothing has run then: no rank got
    past the rendezvous."""
    return "EADDRINUSE" in stderr and "failed to listen" in stderr


def run(
    args: list[str], cwd: Path, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python *args`` in ``cwd`` to its end (stdout and stderr captured as text), with
    ``env`` added to the environment; started again (up to :data:`RENDEZVOUS_TRIES` in all)
    when its rendezvous port was taken (:func:`port_taken`), the test machine's race, not the
    run's."""
    for _ in range(RENDEZVOUS_TRIES):
        result = subprocess.run(
            [sys.executable, *args], cwd=cwd, env={**_env(), **(env or {})},
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if result.returncode == 0 or not port_taken(result.stderr):
            break
    return result


def run_many(
    commands: list[list[str]], cwd: Path, timeout: float = 240, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess]:
    """:func:`run` for independent commands, all started at once: each process spends its
    first seconds importing on one core, so two at a time use the 2 cores one leaves idle.
    Their results in order; one whose rendezvous port was taken is run again by :func:`run`."""
    results = []
    with contextlib.ExitStack() as stack:
        outputs = [
            (stack.enter_context(tempfile.TemporaryFile("w+")),
             stack.enter_context(tempfile.TemporaryFile("w+")))
            for _ in commands
        ]  # fmt: skip
        procs = [
            stack.enter_context(
                subprocess.Popen(
                    [sys.executable, *args],
                    cwd=cwd,
                    stdout=out,
                    stderr=err,
                    env={**_env(), **(env or {})},
                    text=True,
                )
            )
            for args, (out, err) in zip(commands, outputs, strict=True)
        ]
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                raise
        for args, proc, (out, err) in zip(commands, procs, outputs, strict=True):
            out.seek(0)
            err.seek(0)
            result = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
            if proc.returncode != 0 and port_taken(result.stderr):
                result = run(args, cwd, timeout, env)
            results.append(result)
    return results


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """``python *args`` in ``cwd``, running (stdout and stderr to files in ``cwd``, so that a
    full pipe never blocks it); :func:`finish` waits for it."""
    out, err = open(cwd / "stdout.txt", "w"), open(cwd / "stderr.txt", "w")  # noqa: SIM115
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=_env(), stdout=out, stderr=err)


def finish(proc: subprocess.Popen, cwd: Path, timeout: float) -> tuple[int, str]:
    """Wait at most ``timeout`` seconds for ``proc`` (killed, with its children, after that):
    its exit code and stderr."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*children(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        code = None  # type: ignore[assignment]
    return code, (cwd / "stderr.txt").read_text()


def children(pid: int) -> list[int]:
    """The process ids of ``pid``'s children (Linux)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


class Stalled(AssertionError):
    """A run still going without getting to where :func:`wait_for` waited for it."""


def wait_for(path: Path, proc: subprocess.Popen, cwd: Path, timeout: float = 150) -> None:
    """Wait until ``path`` exists (the run :func:`start` ran in ``cwd`` got that far); fail if
    ``proc`` ended first, or after ``timeout`` seconds (:class:`Stalled`): then every process
    of the run is sent ``SIGABRT`` (each prints its threads' stacks: :func:`start` sets
    ``PYTHONFAULTHANDLER``) and the failure shows the end of the run's stderr."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {path}"
        if time.monotonic() > deadline:
            for pid in [*children(proc.pid), proc.pid]:
                os.kill(pid, signal.SIGABRT)
            _, stderr = finish(proc, cwd, 30)
            raise Stalled(f"no {path} after {timeout} s; its stderr:\n{stderr[-20000:]}")
        time.sleep(0.2)


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (no longer listed, or a zombie awaiting its parent)."""
    proc = Path(f"/proc/{pid}")
    return not proc.exists() or "zombie" in (proc / "status").read_text()


def error_lines(stderr: str) -> list[str]:
    """The ``error:`` lines of a run's stderr."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]
