"""What a run in the test process changes in the process, saved and restored: the one context
manager that ``conftest.py``'s fixtures (per test, per module, around ``shutdown``'s handlers)
and ``test_context_trainer.py`` (per one-rank Trainer fit) enter."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist

LAUNCH = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
"""What a launcher leaves in ``os.environ``: a later Trainer in this process takes a leftover
MASTER_PORT as its rendezvous port, which another process may have taken since (EADDRINUSE),
and the rest for an external launcher of world size 1."""


@contextlib.contextmanager
def process_restored() -> Iterator[None]:
    """The block rendezvouses afresh: the :data:`LAUNCH` variables an earlier run left (an
    earlier spawn's port, which this process's store would then hold against the next spawn)
    are removed on entry. On exit, also when the block raises, what it changed is restored:
    ``os.environ`` as it was on entry, no default process group (one left initialised would
    pass for a live group to a later Trainer or fake-tensor measurement), the SIGINT and SIGTERM
    handlers, ``lightning_sp.runtime.shutdown``'s state, and torch's intra-op threads."""
    from lightning_sp.runtime import shutdown

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    state, threads = dict(shutdown._state), torch.get_num_threads()
    environ = dict(os.environ)
    for name in LAUNCH:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
        shutdown._state.clear()
        shutdown._state.update(state)
        torch.set_num_threads(threads)
