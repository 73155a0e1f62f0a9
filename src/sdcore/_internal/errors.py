"""Exception text that is safe to store in jsonb and to log."""

from __future__ import annotations

MAX_ERROR_TEXT = 4096


class FieldError(Exception):
    """Base of the "invalid <field>: <problem>" errors (raised before any SQL).

    Each feature's public error adds its own root and builtin, e.g.
    ``class InvalidOutboxMessageError(FieldError, OutboxError, ValueError)``.

    Attributes:
        field: The offending argument or option.
        problem: What is wrong with it.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"invalid {field}: {problem}")


def error_text(exc: BaseException) -> str:
    """Return a bounded, jsonb-safe text of an exception (type and message)."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        message = "<unprintable message>"
    text = f"{type(exc).__qualname__}: {message}" if message else type(exc).__qualname__
    text = text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > MAX_ERROR_TEXT:
        text = text[: MAX_ERROR_TEXT - 1] + "…"
    return text
