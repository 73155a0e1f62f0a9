"""Argument checks shared by the components' constructors and APIs (before any I/O).

Every check returns the value it accepts, so a constructor reads ``self._x = at_least("x", x, 1)``,
and every refusal reads the same: ``<name> must be <rule>, got <value, shortened>``.

By default a value of the wrong type raises :class:`TypeError` and a value of the right type out
of range raises :class:`ValueError` (``bool`` is never an ``int`` here: ``True`` is a wrong type).
An API that documents its own error passes ``error=``, a factory that turns the
:class:`Refusal` into that error, e.g. ``error=field_error(InvalidJobLeaseOptionsError)`` for the
``FieldError(field, problem)`` family, or ``error=lambda r: ScheduleError(name, r.message)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, TypeAlias

__all__ = [
    "ErrorFactory",
    "Refusal",
    "at_least",
    "boolean",
    "field_error",
    "int_between",
    "integer",
    "non_empty_str",
    "number_at_least",
    "positive_number",
    "positive_timedelta",
    "shown",
    "text",
]

SHOWN_CHARS = 40
"""A refused value is shown by its ``repr``, cut to this many characters."""


def shown(value: object) -> str:
    """Return ``repr(value)`` cut to :data:`SHOWN_CHARS` characters (``…`` marks a cut)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the refusal
        text = f"<{type(value).__name__}>"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """Why an argument was refused.

    Attributes:
        name: The argument, as the caller spells it.
        rule: What it must be, e.g. ``"an int from 1 to 1000"``.
        value: The value given.
        wrong_type: The value is not of the rule's type (else it is out of range).
    """

    name: str
    rule: str
    value: object
    wrong_type: bool

    @property
    def problem(self) -> str:
        """``must be <rule>, got <value>``: the message without the name."""
        return f"must be {self.rule}, got {shown(self.value)}"

    @property
    def message(self) -> str:
        """``<name> must be <rule>, got <value>``."""
        return f"{self.name} {self.problem}"

    def exception(self) -> TypeError | ValueError:
        """Return the default error: a :class:`TypeError` or a :class:`ValueError`."""
        return TypeError(self.message) if self.wrong_type else ValueError(self.message)


ErrorFactory: TypeAlias = Callable[[Refusal], Exception]
"""Turns a :class:`Refusal` into the error an API documents."""


def field_error(cls: Callable[[str, str], Exception]) -> ErrorFactory:
    """Return a factory raising ``cls(name, problem)`` (the ``FieldError`` family's signature)."""

    def build(refusal: Refusal) -> Exception:
        return cls(refusal.name, refusal.problem)

    return build


def _refuse(
    name: str, rule: str, value: object, *, wrong_type: bool, error: ErrorFactory | None
) -> NoReturn:
    refusal = Refusal(name=name, rule=rule, value=value, wrong_type=wrong_type)
    raise (refusal.exception() if error is None else error(refusal))


def at_least(name: str, value: object, minimum: int, *, error: ErrorFactory | None = None) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``.

    Raises:
        TypeError: Not an ``int`` (unless ``error`` is given).
        ValueError: Less than ``minimum`` (unless ``error`` is given).
    """
    rule = f"an int of at least {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        _refuse(name, rule, value, wrong_type=True, error=error)
    if value < minimum:
        _refuse(name, rule, value, wrong_type=False, error=error)
    return value


def integer(name: str, value: object, *, error: ErrorFactory | None = None) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``), of any size.

    Raises:
        TypeError: Not an ``int`` (unless ``error`` is given).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        _refuse(name, "an int", value, wrong_type=True, error=error)
    return value


def int_between(
    name: str, value: object, low: int, high: int, *, error: ErrorFactory | None = None
) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) from ``low`` to ``high`` inclusive.

    Raises:
        TypeError: Not an ``int`` (unless ``error`` is given).
        ValueError: Out of range (unless ``error`` is given).
    """
    rule = f"an int from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, int):
        _refuse(name, rule, value, wrong_type=True, error=error)
    if not low <= value <= high:
        _refuse(name, rule, value, wrong_type=False, error=error)
    return value


def number_at_least(
    name: str,
    value: object,
    minimum: float,
    *,
    maximum: float | None = None,
    error: ErrorFactory | None = None,
) -> float:
    """Return ``value`` if it is a finite ``int`` or ``float`` (not a ``bool``) in range.

    Args:
        name: The argument's name.
        value: The value given.
        minimum: The least accepted value.
        maximum: The largest accepted value (``None``: no bound).
        error: Builds the error to raise instead of the default one.

    Raises:
        TypeError: Not a number (unless ``error`` is given).
        ValueError: Out of range, or NaN / infinite (unless ``error`` is given).
    """
    rule = f"a number of at least {minimum}"
    if maximum is not None:
        rule = f"a number from {minimum} to {maximum}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        _refuse(name, rule, value, wrong_type=True, error=error)
    if not math.isfinite(value) or value < minimum or (maximum is not None and value > maximum):
        _refuse(name, rule, value, wrong_type=False, error=error)
    return value


def positive_number(
    name: str, value: object, *, maximum: float | None = None, error: ErrorFactory | None = None
) -> float:
    """Return ``value`` if it is a finite ``int`` or ``float`` (not a ``bool``) above zero.

    Raises:
        TypeError: Not a number (unless ``error`` is given).
        ValueError: Zero, negative, above ``maximum``, NaN or infinite (unless ``error`` is
            given).
    """
    rule = "a positive number" if maximum is None else f"a positive number of at most {maximum}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        _refuse(name, rule, value, wrong_type=True, error=error)
    if not math.isfinite(value) or value <= 0 or (maximum is not None and value > maximum):
        _refuse(name, rule, value, wrong_type=False, error=error)
    return value


def boolean(name: str, value: object, *, error: ErrorFactory | None = None) -> bool:
    """Return ``value`` if it is a ``bool`` (``0`` and ``1`` are not).

    Raises:
        TypeError: Not a ``bool`` (unless ``error`` is given).
    """
    if not isinstance(value, bool):
        _refuse(name, "a bool", value, wrong_type=True, error=error)
    return value


def non_empty_str(
    name: str, value: object, *, max_length: int | None = None, error: ErrorFactory | None = None
) -> str:
    """Return ``value`` if it is a ``str`` with 1 to ``max_length`` characters.

    Raises:
        TypeError: Not a ``str`` (unless ``error`` is given).
        ValueError: Empty or too long (unless ``error`` is given).
    """
    rule = "a non-empty str"
    if max_length is not None:
        rule = f"a non-empty str of at most {max_length} characters"
    if not isinstance(value, str):
        _refuse(name, rule, value, wrong_type=True, error=error)
    if not value or (max_length is not None and len(value) > max_length):
        _refuse(name, rule, value, wrong_type=False, error=error)
    return value


def positive_timedelta(
    name: str,
    value: object,
    *,
    at_most: timedelta | None = None,
    error: ErrorFactory | None = None,
) -> timedelta:
    """Return ``value`` if it is a ``timedelta`` longer than zero and at most ``at_most``.

    Raises:
        TypeError: Not a ``timedelta`` (unless ``error`` is given).
        ValueError: Zero, negative or too long (unless ``error`` is given).
    """
    rule = "a positive timedelta"
    if at_most is not None:
        whole_days = at_most % timedelta(days=1) == timedelta(0)
        span = f"{at_most.days} days" if whole_days else str(at_most)
        rule = f"a positive timedelta of at most {span}"
    if not isinstance(value, timedelta):
        _refuse(name, rule, value, wrong_type=True, error=error)
    if value <= timedelta(0) or (at_most is not None and value > at_most):
        _refuse(name, rule, value, wrong_type=False, error=error)
    return value


def text(
    name: str, value: object, *, empty: bool = False, error: ErrorFactory | None = None
) -> str:
    """Return ``value`` if it is a ``str`` (and, unless ``empty``, not blank).

    Raises:
        TypeError: Not a ``str`` (unless ``error`` is given).
        ValueError: Blank while ``empty`` is false (unless ``error`` is given).
    """
    rule = "a str" if empty else "a non-blank str"
    if not isinstance(value, str):
        _refuse(name, rule, value, wrong_type=True, error=error)
    if not empty and not value.strip():
        _refuse(name, rule, value, wrong_type=False, error=error)
    return value
