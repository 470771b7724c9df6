"""A blend of prepared directories with weights, written as Megatron-LM's ``--data-path``:
``[0.3, /data/a, 0.7, /data/b]`` (weight, directory, weight, directory, ...)."""

from __future__ import annotations

import dataclasses
import math

from lightning_sp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Blend:
    """Prepared directories and their (positive, unnormalized) weights, in order."""

    directories: tuple[str, ...]
    weights: tuple[float, ...]


def parse_blend(spec: list[float | str]) -> Blend:
    """Check and split a ``[weight, directory, ...]`` list.

    Raises:
        ConfigError: odd length, a weight that is not a number > 0, or an empty directory.
    """
    items = list(spec)
    if not items or len(items) % 2:
        raise ConfigError(
            f"blend={items!r} is not a list of weight, directory pairs; write it as "
            "[0.3, /data/a, 0.7, /data/b]"
        )
    directories: list[str] = []
    weights: list[float] = []
    for i in range(0, len(items), 2):
        weight, directory = items[i], items[i + 1]
        try:
            value = float(weight)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(weight, bool) or not math.isfinite(value) or value <= 0:
            raise ConfigError(
                f"blend[{i}]={weight!r} is not a weight > 0; each prepared directory in blend "
                "is preceded by a positive weight"
            )
        if not isinstance(directory, str) or not directory.strip():
            raise ConfigError(
                f"blend[{i + 1}]={directory!r} is not a prepared directory path; write "
                "blend as [0.3, /data/a, 0.7, /data/b]"
            )
        weights.append(value)
        directories.append(directory)
    return Blend(tuple(directories), tuple(weights))
