import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from corpora import python_files
from process_state import process_restored

# Two cores: keep every process (and every spawned rank) to one intra-op thread so four ranks
# do not oversubscribe the machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Prepared corpora and the datasets cache go to a directory of this test session (inherited by
# spawned ranks and cli.py subprocesses), never the user's ~/.cache: a session neither reuses
# nor races with another run's prepared data.
_CACHE = tempfile.mkdtemp(prefix="lightning_sp_tests_")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

from lightning_sp.parallel.threads import threads_per_rank  # noqa: E402 (after XDG_CACHE_HOME)

# torch was imported (its thread pool sized to every core) before OMP_NUM_THREADS was set: this
# process keeps to one thread too, else its tiny kernels run on 2 threads that spin against the
# ranks and other processes (one-process tests 10-40x slower under load)
torch.set_num_threads(threads_per_rank(1))


def _attribute_docstrings_read_once() -> None:
    """Each class's attribute docstrings (what ``--help`` prints for a config field) parsed once
    per test session, not at every command-line parse: ``docstring_parser`` reads and parses the
    class's source each time (about 1 s of each in-process ``cli.main`` here). The result is a
    function of the source, which a session never changes."""
    from docstring_parser import attrdoc

    read = attrdoc.AttributeDocstrings.get_attr_docs
    parsed: dict[Any, dict[str, Any]] = {}

    def get_attr_docs(self: attrdoc.AttributeDocstrings, component: Any) -> dict[str, Any]:
        if component not in parsed:
            parsed[component] = read(self, component)
        return dict(parsed[component])

    attrdoc.AttributeDocstrings.get_attr_docs = get_attr_docs  # type: ignore[method-assign]


_attribute_docstrings_read_once()


@pytest.fixture(autouse=True)
def _process_state_restored() -> Iterator[None]:
    """Each test leaves the process as it found it: an in-process Trainer run leaves Lightning's
    launcher variables (WORLD_SIZE, LOCAL_RANK, MASTER_PORT, ...) in ``os.environ`` and its
    default process group initialised, which a later Trainer would take for an external
    launcher of world size 1 and a later fake-tensor measurement for a live group
    (``process_state.process_restored``)."""
    with process_restored():  # each test rendezvouses afresh, whatever a module fixture left
        yield


@pytest.fixture(autouse=True, scope="module")
def _module_state_restored() -> Iterator[None]:
    """The same for a module's fixtures: a module-scoped fixture that runs a Trainer does so
    before any test's snapshot, so without this its MASTER_PORT outlived the module and every
    later launch in the session rendezvoused on that port (EADDRINUSE while it was held)."""
    with process_restored():
        yield


@pytest.fixture
def shutdown_handlers() -> Iterator[None]:
    """``lightning_sp.runtime.shutdown``'s signal handlers installed in this process for the
    test; the previous handlers and the module's state are restored after it
    (``process_state.process_restored``)."""
    from lightning_sp.runtime import shutdown

    with process_restored():
        shutdown.install()
        yield


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of 8 small Python files for Trainer runs (byte-level or BPE)."""
    return python_files(tmp_path / "corpus")


@pytest.fixture(scope="session")
def moe_ep_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``test_moe_trainer.ep_run``'s folder: the MoE run at d = 2 with e = 2 (one 2-rank spawn)
    that test_moe_trainer compares with one process and test_moe_state resumes."""
    from test_moe_trainer import ep_run

    return ep_run(tmp_path_factory.mktemp("moe_ep"))
