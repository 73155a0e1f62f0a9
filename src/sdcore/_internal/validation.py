"""Argument checks shared by the components' constructors (before any I/O)."""

from __future__ import annotations

__all__ = ["at_least", "int_between"]


def at_least(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``.

    Raises:
        ValueError: Naming the argument, the bound and (shortened) the value given.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}, got {value!r:.40}")
    return value


def int_between(name: str, value: object, low: int, high: int) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) in ``low..high``.

    Raises:
        TypeError: Not an ``int`` (naming the type given).
        ValueError: Out of range (naming the range and the value).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")
    return value
