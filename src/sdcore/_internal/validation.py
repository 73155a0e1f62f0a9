"""Argument checks shared by the components' constructors (before any I/O)."""

from __future__ import annotations

__all__ = ["at_least"]


def at_least(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``.

    Raises:
        ValueError: Naming the argument, the bound and (shortened) the value given.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}, got {value!r:.40}")
    return value
