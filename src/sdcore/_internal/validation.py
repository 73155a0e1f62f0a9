"""Argument checks shared by the components' constructors (before any I/O)."""

from __future__ import annotations

__all__ = ["at_least", "flag", "int_between", "positive_number", "text"]


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
        TypeError: Not an ``int`` (naming the type and the value given).
        ValueError: Out of range (naming the range and the value).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")
    return value


def flag(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``.

    Raises:
        TypeError: Naming the argument and (shortened) the value given.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r:.40}")
    return value


def text(name: str, value: object, *, empty: bool = False) -> str:
    """Return ``value`` if it is a ``str`` (and, unless ``empty``, not blank).

    Raises:
        TypeError: Not a ``str`` (naming the argument and the value given).
        ValueError: Blank while ``empty`` is false.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r:.40}")
    if not empty and not value.strip():
        raise ValueError(f"{name} must be a non-empty str, got {value!r:.40}")
    return value


def positive_number(name: str, value: object) -> float:
    """Return ``value`` as a ``float`` if it is a finite ``int`` or ``float`` above 0 (no ``bool``).

    Raises:
        ValueError: Naming the argument and (shortened) the value given.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value < float("inf")
    ):
        raise ValueError(f"{name} must be a positive number, got {value!r:.40}")
    return float(value)
