"""What a checkpoint records beside DCP's files: ``meta.json`` (format, the layout that saved
it, step, model config, file checksums), and the key of each rank's RNG state (the keys:
:mod:`lightning_sp.checkpoint`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sp.parallel.config import ParallelConfig

FORMAT = "lightning_sp.dcp"
FORMAT_VERSION = 1
META_FILE = "meta.json"
DCP_METADATA = ".metadata"
FORMER_LAYOUT_FIELDS = ("sequence_parallel",)
"""Keys a ``meta.json`` layout may hold that the layout no longer has (sequence parallelism
is the model config's, recorded in ``model``); read and skipped."""


@dataclass
class Meta:
    """``meta.json``."""

    step: int
    layout: ParallelConfig
    """The run's layout (files written before micro-batches and the distributed optimizer
    were recorded read with their defaults; the ``sequence_parallel`` of files written while
    the layout also held it is skipped: :data:`FORMER_LAYOUT_FIELDS`)."""
    model: dict[str, Any]
    """The model config (:meth:`~lightning_sp.model.config.GPTConfig.values`; ``{}`` for a
    module without a GPT), its ``sequence_parallel`` included."""
    format: str = FORMAT
    version: int = FORMAT_VERSION
    checksums: dict[str, int] = field(default_factory=dict)

    def dumps(self) -> str:
        data = dict(self.__dict__, layout=dataclasses.asdict(self.layout))
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def read(cls, path: Path) -> Meta:
        data = json.loads((path / META_FILE).read_text())
        layout = {k: v for k, v in data["layout"].items() if k not in FORMER_LAYOUT_FIELDS}
        return cls(**dict(data, layout=ParallelConfig(**layout)))


def rng_key(
    pipeline_rank: int, data_rank: int, tensor_rank: int, context_rank: int | None = None
) -> str:
    """The key of one rank's RNG state (per rank: only the same layout restores it);
    ``context_rank`` under context parallelism (``None`` for ``c = 1``, the key of runs
    without CP)."""
    cp = "" if context_rank is None else f".cp{context_rank}"
    return f"rng.pp{pipeline_rank}.dp{data_rank}{cp}.tp{tensor_rank}"
