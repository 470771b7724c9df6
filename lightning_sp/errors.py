"""The one exception type for configuration mistakes, and the checks every config shares
(a positive size, a size dividing another, a writable directory)."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable


class ConfigError(ValueError):
    """A configuration value is invalid.

    The message is one line naming the field, the value given and what would be valid,
    raised before any work (process groups, weights, data) starts.
    """


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an ``int`` ≥ 1 (``True``/``False`` are not sizes); else
    :class:`ConfigError` naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return value


def finite_number(
    name: str, value: object, valid: str, in_range: Callable[[float], bool] = lambda v: True
) -> float:
    """``value`` if it is a finite real number (``True``/``False`` are not) for which
    ``in_range`` holds; else :class:`ConfigError` naming ``name``, the value and ``valid``
    (the range in words: ``"in [0, 1)"``, ``"a finite number >= 0"``)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not in_range(value):  # type: ignore[arg-type]
        raise ConfigError(f"{name}={value!r} must be {valid}")
    return float(value)  # type: ignore[arg-type]


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, for "must be one of ..." messages."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(field: str, value: int, size_name: str, size: int) -> None:
    """:class:`ConfigError` unless ``size`` divides ``value``: one line naming the field, its
    value, the size and the sizes that would divide it."""
    if value % size:
        raise ConfigError(
            f"{field}={value} is not divisible by {size_name}={size}; "
            f"{size_name} must be one of {divisors(value)}"
        )


def check_writable(field: str, directory: str) -> None:
    """``directory`` exists and a file can be created in it, or it can be created: its
    nearest existing ancestor is a directory in which a file can be created (a probe file,
    removed at once). ``field`` names the setting in the message."""
    path = os.path.abspath(os.path.expanduser(directory))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{field}={directory!r} cannot be written: {existing!r} is a file, not a "
            "directory; give a directory path"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(
            f"{field}={directory!r} cannot be written: {error.strerror or error} in "
            f"{existing!r}; give a directory this user can write"
        ) from error
