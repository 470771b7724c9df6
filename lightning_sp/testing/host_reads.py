"""Counting host reads of tensor values: the step's host-device synchronisations on a GPU.

``.item()``, ``bool(t)``, ``int(t)``, ``float(t)`` all run ``aten._local_scalar_dense``; on a
CUDA tensor each waits for the device's queue to drain, after which the CPU's next work (the
loop's hooks, logging, the next batch) no longer overlaps the device's. :class:`HostReads`
counts those calls under a dispatch mode, each by where it comes from, so that a CPU test or
benchmark can state how many a training step makes. Reads inside ``torch/optim`` (AdamW's
step counters, host tensors under CUDA's fused AdamW) are counted apart.
"""

from __future__ import annotations

import collections
import os
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH = f"site-packages{os.sep}torch{os.sep}"
_OPTIM = f"torch{os.sep}optim{os.sep}"


def origin(stack: list[traceback.FrameSummary], skip: tuple[str, ...] = ()) -> str:
    """Where a read comes from: the innermost frame outside torch's own package (and outside
    files ending in ``skip``) and the two frames that called it, ``file:line:function``."""
    frames = [f for f in stack if _TORCH not in f.filename and not f.filename.endswith(skip)]
    return " <- ".join(
        f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-3:])
    )


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads: ...``: ``reads.reads`` counts the host reads by
    :func:`origin`, ``reads.optimizer_counters`` those inside ``torch/optim``; ``total`` is
    the former's sum."""

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.skip = skip
        self.reads: collections.Counter[str] = collections.Counter()
        self.optimizer_counters = 0

    @property
    def total(self) -> int:
        return sum(self.reads.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            stack = traceback.extract_stack()[:-1]
            if any(_OPTIM in f.filename for f in stack):
                self.optimizer_counters += 1
            else:
                self.reads[origin(stack, self.skip)] += 1
        return func(*args, **(kwargs or {}))
