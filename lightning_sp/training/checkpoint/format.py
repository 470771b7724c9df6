"""What a checkpoint records beside DCP's files: ``meta.json`` (format, layout, step, model
config, file checksums), and the key of each rank's RNG state (the keys:
:mod:`lightning_sp.training.checkpoint`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "lightning_sp.dcp"
FORMAT_VERSION = 1
META_FILE = "meta.json"
DCP_METADATA = ".metadata"


@dataclass
class Layout:
    """What a checkpoint records about the run that wrote it."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_size: int = 1
    sequence_parallel: bool = False

    def describe(self) -> str:
        return (
            f"t={self.tensor_parallel_size}, p={self.pipeline_parallel_size}, "
            f"m={self.virtual_pipeline_size}, d={self.data_parallel_size}, "
            f"SP={self.sequence_parallel}"
        )


@dataclass
class Meta:
    """``meta.json``."""

    step: int
    layout: Layout
    model: dict[str, Any]
    format: str = FORMAT
    version: int = FORMAT_VERSION
    checksums: dict[str, int] = field(default_factory=dict)

    def dumps(self) -> str:
        data = dict(self.__dict__, layout=self.layout.__dict__)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def read(cls, path: Path) -> Meta:
        data = json.loads((path / META_FILE).read_text())
        return cls(**dict(data, layout=Layout(**data["layout"])))


def rng_key(pipeline_rank: int, data_rank: int, tensor_rank: int) -> str:
    """The key of one rank's RNG state (per rank: only the same layout restores it)."""
    return f"rng.pp{pipeline_rank}.dp{data_rank}.tp{tensor_rank}"
