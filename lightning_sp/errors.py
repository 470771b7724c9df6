"""The one exception type for configuration mistakes, and the checks every config shares."""

from __future__ import annotations


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


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, for "must be one of ..." messages."""
    return [d for d in range(1, n + 1) if n % d == 0]
