"""Errors found after launch, agreed by every rank: one line, printed once.

A bad input found inside the processes (an empty corpus, a JSONL row without the text field,
a checkpoint directory that cannot be written) is often found by one rank only: Lightning
runs ``prepare_data`` on local rank 0 while the others wait in the next barrier. Had that rank
raised alone, its peers would fail in that collective ("Connection closed by peer") and print
their tracebacks after the one useful line.

:func:`ranks_agree` runs a block on every rank and then exchanges, in one collective of the
default process group (the strategy's, with its timeout), whether the block raised
:class:`~lightning_sp.errors.ConfigError` and with which message. If any rank did, every rank
raises the same ``ConfigError`` (the lowest failing rank's message) at the same point; ``cli.py``
prints it once (rank 0) and every rank exits with code 2, quietly on the others. An error
one rank finds alone in the middle of a step is a :class:`LocalError`, reported by that rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from lightning_sp.errors import ConfigError


class LocalError(ConfigError):
    """A bad input one rank finds alone after launch, where no collective can agree on it in
    time (a corrupt sample that rank read, while its peers wait in the step's collectives).
    That rank reports it: printed by rank 0 in place of "rank N exited with code 2" (a child
    of the subprocess launcher hands it over with
    :func:`lightning_sp.runtime.shutdown.report`), or by the rank itself where no launcher
    collects it (torchrun); see ``lightning_sp.cli.main.fail``."""


def agree_on_error(error: ConfigError | None) -> None:
    """Raise on every rank the first rank's ``ConfigError`` if any rank has one (``error``:
    this rank's, or None). Every rank of the default process group must call this; without a
    process group (one process), ``error`` is raised as it is."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else str(error))
    first = next((message for message in messages if message is not None), None)
    if first is not None:
        raise ConfigError(first) from error


@contextmanager
def ranks_agree() -> Iterator[None]:
    """Run the block on every rank, then :func:`agree_on_error` on the ``ConfigError`` it
    raised (others propagate unchanged: this rank fails alone, as before)."""
    error: ConfigError | None = None
    try:
        yield
    except ConfigError as raised:
        error = raised
    agree_on_error(error)
