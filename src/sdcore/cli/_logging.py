"""``--log-level`` / ``--log-json``: the CLI's log records on stderr, passwords masked.

Only the CLI configures logging (the library never does). The handler is installed for one
``main()`` call and removed afterwards, so ``main`` can run in-process (tests, other tools)
without leaving handlers behind.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sdcore.cli._format import json_line, one_line, utc_iso
from sdcore.postgres import redact_text

# Attributes every LogRecord has; anything else came in through ``extra=`` and is shown.
_STANDARD = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


def _redact(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        text = redact_text(text, secret)
    return redact_text(text)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in vars(record).items() if key not in _STANDARD}


class _Formatter(logging.Formatter):
    """Text (``2026-07-20T03:00:00.123456Z WARNING logger: message``) or one JSON object."""

    def __init__(self, *, as_json: bool, secrets: Sequence[str]) -> None:
        super().__init__()
        self._json = as_json
        self._secrets = list(secrets)

    def format(self, record: logging.LogRecord) -> str:
        when = utc_iso(datetime.fromtimestamp(record.created, UTC), precise=True)
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        message = _redact(message, self._secrets)
        if self._json:
            shown: dict[str, Any] = {
                "time": when,
                "level": record.levelname,
                "logger": record.name,
                "message": message,
            }
            for key, value in _extras(record).items():
                if isinstance(value, str):
                    value = _redact(value, self._secrets)
                shown.setdefault(key, value)
            try:
                return json_line(shown)
            except (TypeError, ValueError):
                return json_line({k: v if _is_plain(v) else str(v) for k, v in shown.items()})
        return f"{when} {record.levelname} {record.name}: {one_line(message)}"


def _is_plain(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


@contextmanager
def cli_logging(level: str, *, as_json: bool, secrets: Sequence[str]) -> Iterator[None]:
    """Send log records of ``level`` and above to stderr while the block runs.

    Args:
        level: ``DEBUG`` … ``CRITICAL``.
        as_json: One JSON object per record instead of a text line.
        secrets: Connection strings whose passwords are masked in every record.
    """
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(as_json=as_json, secrets=secrets))
    handler.setLevel(level)
    previous = root.level
    root.addHandler(handler)
    if previous != logging.NOTSET:  # NOTSET already lets every record through
        root.setLevel(min(previous, logging.getLevelNamesMapping()[level]))
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)
