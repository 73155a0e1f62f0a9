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

from sdcore.cli._format import one_line, utc_iso
from sdcore.jsonlog import JsonFormatter


class _Formatter(logging.Formatter):
    """Text (``2026-07-20T03:00:00.123456Z WARNING logger: message``) or one JSON object."""

    def __init__(self, *, as_json: bool, secrets: Sequence[str]) -> None:
        super().__init__()
        # One masking for both forms: the JSON formatter's (sdcore.jsonlog).
        self._mask = JsonFormatter(secrets=secrets)
        self._json = as_json

    def format(self, record: logging.LogRecord) -> str:
        if self._json:
            return self._mask.format(record)
        when = utc_iso(datetime.fromtimestamp(record.created, UTC), precise=True)
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        message = self._mask.redact(message)
        return f"{when} {record.levelname} {record.name}: {one_line(message)}"


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
