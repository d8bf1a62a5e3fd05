"""Sizes (``4GiB``) and durations (``30s``) as written in a config, read into bytes and seconds.

Sizes: a whole number of bytes, or a number with a unit, case-insensitive and with optional space
(``4GiB``, ``4 gib``, ``1.5GB``, ``512MiB``, ``64KiB``, ``4096``). Binary units ``KiB MiB GiB TiB``
(also ``Ki Mi Gi Ti``) are powers of 1024; decimal units ``KB MB GB TB`` (also ``k M G T``) are
powers of 1000, as in SI and Kubernetes; ``B`` is bytes. A fraction of a byte is rounded down.

Durations: a number of seconds, or a number with one of the units ``ms s m h d``
(``500ms``, ``30s``, ``10m``, ``2h``, ``1d``).

Example:
    >>> parse_size("1.5GiB", key="host.capacity")
    1610612736
    >>> parse_duration("10m", key="tiers[2].flush.min_interval")
    600.0
    >>> format_size(4 << 30)
    '4GiB'
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal
from fractions import Fraction

from tierckpt.errors import ConfigError

__all__ = ["parse_size", "parse_duration", "format_size"]

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{f"{prefix}{suffix}": 1000**power for power, prefix in enumerate("kmgt", 1) for suffix in ("", "b")},
    **{f"{prefix}i{suffix}": 1024**power for power, prefix in enumerate("kmgt", 1) for suffix in ("", "b")},
}
_DURATION_UNITS: dict[str, Fraction] = {
    "": Fraction(1),
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "h": Fraction(3600),
    "d": Fraction(86400),
}
# Largest first; at the same scale the binary unit wins, so 4 << 30 reads as 4GiB.
_FORMAT_UNITS: tuple[tuple[str, int], ...] = (
    ("TiB", 1024**4),
    ("TB", 1000**4),
    ("GiB", 1024**3),
    ("GB", 1000**3),
    ("MiB", 1024**2),
    ("MB", 1000**2),
    ("KiB", 1024),
    ("KB", 1000),
)
_AMOUNT = re.compile(r"\s*(?P<number>-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*(?P<unit>[a-z]*)\s*", re.IGNORECASE)
_SIZE_EXAMPLES = "use a whole number of bytes or a number with a unit, e.g. 4096, 64KiB, 512MiB, 4GiB, 1.5GB"
_DURATION_EXAMPLES = "use a number of seconds or a number with a unit, e.g. 0.5, 500ms, 30s, 10m, 2h, 1d"


def parse_size(value: object, *, key: str, where: str | None = None) -> int:
    """Read a size in bytes: an ``int``, or a string such as ``"4GiB"`` (units in the module docstring).

    Args:
        value: the value as written in the config.
        key: the config key it belongs to, named in errors (``"host.capacity"``).
        where: where the value was written (``"in tiers.yaml, line 2"``), named in errors.

    Returns:
        The size in bytes; a fraction of a byte (``"1.1KiB"``) is rounded down.

    Raises:
        ConfigError: the value is negative, not a size, or has an unknown unit.

    Example:
        >>> parse_size("512 MiB", key="host.capacity")
        536870912
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise _error(key, f"{value!r} is negative", where, _SIZE_EXAMPLES)
        return value
    amount = _read_amount(value, _SIZE_UNITS, key=key, where=where, what="a size", examples=_SIZE_EXAMPLES)
    return math.floor(amount)


def parse_duration(value: object, *, key: str, where: str | None = None) -> float:
    """Read a duration in seconds: a number, or a string such as ``"30s"`` (units in the module docstring).

    Args:
        value: the value as written in the config.
        key: the config key it belongs to, named in errors (``"tiers[2].flush.min_interval"``).
        where: where the value was written (``"in tiers.yaml, line 15"``), named in errors.

    Returns:
        The duration in seconds, as a ``float``.

    Raises:
        ConfigError: the value is negative, not finite, not a duration, or has an unknown unit.

    Example:
        >>> parse_duration("500ms", key="tiers[1].flush.min_interval")
        0.5
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise _error(key, f"{value!r} is not a finite duration", where, _DURATION_EXAMPLES)
        if value < 0:
            raise _error(key, f"{value!r} is negative", where, _DURATION_EXAMPLES)
        return float(value)
    amount = _read_amount(
        value, _DURATION_UNITS, key=key, where=where, what="a duration", examples=_DURATION_EXAMPLES
    )
    return float(amount)


def format_size(n: int) -> str:
    """Write a size in bytes the way a config would, exactly: ``4GiB``, ``1.5MiB``, ``1GB``, ``4097B``.

    The largest unit that states the size exactly with at most two decimals is chosen, binary before
    decimal at the same scale; ``parse_size(format_size(n), key=...) == n`` for every ``n >= 0``.

    Raises:
        TypeError: ``n`` is not an ``int``.
        ValueError: ``n`` is negative.

    Example:
        >>> format_size(1536)
        '1.5KiB'
    """
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"format_size() takes an int number of bytes, not {type(n).__name__}")
    if n < 0:
        raise ValueError(f"format_size() takes a size >= 0, not {n}")
    for unit, factor in _FORMAT_UNITS:
        hundredths, remainder = divmod(n * 100, factor)
        if remainder == 0 and hundredths >= 100:
            whole, fraction = divmod(hundredths, 100)
            decimals = f".{fraction:02d}".rstrip("0").rstrip(".")
            return f"{whole}{decimals}{unit}"
    return f"{n}B"


def _read_amount(
    value: object,
    units: Mapping[str, int | Fraction],
    *,
    key: str,
    where: str | None,
    what: str,
    examples: str,
) -> Fraction:
    """Read ``"<number><unit>"`` into an exact amount of the base unit (bytes or seconds)."""
    match = _AMOUNT.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise _error(key, f"{value!r} is not {what}", where, examples)
    factor = units.get(match["unit"].lower())
    if factor is None:
        raise _error(key, f"{value!r} has an unknown unit {match['unit']!r}", where, examples)
    number = Fraction(Decimal(match["number"]))
    if number < 0:
        raise _error(key, f"{value!r} is negative", where, examples)
    return number * factor


def _error(key: str, problem: str, where: str | None, hint: str) -> ConfigError:
    """The error for a bad value, spelled like every config error: ``key: problem (where); hint``."""
    located = f" ({where})" if where else ""
    return ConfigError(f"{key}: {problem}{located}; {hint}", key=key)
