"""The one exception type for configuration mistakes."""


class ConfigError(ValueError):
    """A configuration value is invalid.

    The message is one line naming the field, the value given and what would be valid,
    raised before any work (process groups, weights, data) starts.
    """


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, for "must be one of ..." messages."""
    return [d for d in range(1, n + 1) if n % d == 0]
