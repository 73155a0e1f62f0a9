"""``JsonFormatter``: one JSON object per log record, with the fields sdcore puts in ``extra``.

sdcore logs with a stable ``extra={"action": …}`` and the identifiers that matter (``schedule``,
``run_key``, ``job_code``, ``fencing_token``, ``outbox_id``, ``queue``…). This formatter writes
them next to ``time`` (UTC, ISO 8601 with ``Z``), ``level``, ``logger`` and ``message`` (with the
traceback, if any), masks passwords of connection strings, and adds ``trace_id`` / ``span_id``
when an OpenTelemetry span is current. ``sdcore --log-json`` (or ``SDCORE_LOG_JSON=1``) uses it;
in your own process::

    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.getLogger().addHandler(handler)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from sdcore._internal.redact import redact_text

__all__ = ["JsonFormatter"]

# Attributes every LogRecord has; anything else came in through ``extra=`` and is shown.
_STANDARD = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)
_MAX_DEPTH = 8  # deeper containers are written as their redacted str()


class JsonFormatter(logging.Formatter):
    """Format each record as one line of pure-ASCII JSON.

    Args:
        secrets: Connection strings whose passwords are masked wherever they appear (passwords
            in any URL are masked anyway).
        trace_ids: Add ``trace_id`` and ``span_id`` (hex) when an OpenTelemetry span is current
            (only if ``opentelemetry`` is installed).
    """

    def __init__(self, *, secrets: Sequence[str] = (), trace_ids: bool = True) -> None:
        super().__init__()
        self._secrets = list(secrets)
        self._current_span: Any = None
        if trace_ids:
            try:
                from opentelemetry.trace import get_current_span
            except ImportError:
                pass
            else:
                self._current_span = get_current_span

    def redact(self, text: str) -> str:
        """Mask the passwords of the configured secrets and of any URL in ``text``."""
        for secret in self._secrets:
            text = redact_text(text, secret)
        return redact_text(text)

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        """The record as a mapping: the standard fields, then every ``extra`` field."""
        moment = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds")
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        shown: dict[str, Any] = {
            "time": moment.removesuffix("+00:00") + "Z",
            "level": record.levelname,
            "logger": record.name,
            "message": self.redact(message),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD:
                shown.setdefault(key, self._scrub(value, 0))
        if self._current_span is not None:
            context = self._current_span().get_span_context()
            if context.is_valid:
                shown.setdefault("trace_id", format(context.trace_id, "032x"))
                shown.setdefault("span_id", format(context.span_id, "016x"))
        return shown

    def _scrub(self, value: object, depth: int) -> object:
        """``value`` with every string in it redacted, through dicts, lists and tuples."""
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, dict | list | tuple) and depth >= _MAX_DEPTH:
            return self.redact(str(value))
        if isinstance(value, dict):
            return {
                self._scrub(k, depth + 1) if isinstance(k, str) else k: self._scrub(v, depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, list | tuple):
            return [self._scrub(item, depth + 1) for item in value]
        return value

    def format(self, record: logging.LogRecord) -> str:
        """One JSON line; values that are not JSON are shown as their (redacted) ``str()``."""
        shown = self.fields(record)
        try:
            return _line(shown, self._as_text)
        except (TypeError, ValueError):
            plain = {k: v if _is_plain(v) else self._as_text(v) for k, v in shown.items()}
            return _line(plain, self._as_text)

    def _as_text(self, value: object) -> str:
        """A value JSON cannot write, as its redacted ``str()``."""
        return self.redact(str(value))


def _line(value: dict[str, Any], default: Callable[[object], str]) -> str:
    # ASCII only: control and bidi characters of messages are escaped, never written raw.
    return json.dumps(
        value, ensure_ascii=True, separators=(",", ":"), allow_nan=False, default=default
    )


def _is_plain(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)
