"""Passwords inside structured ``extra`` values (dicts, lists, objects) are masked too."""

from __future__ import annotations

import json
import logging

from sdcore.jsonlog import JsonFormatter

URL = "postgresql://app:S3cret-pw@db:5432/app"


class Opaque:
    def __str__(self) -> str:
        return f"Opaque({URL})"


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord("app", logging.INFO, __file__, 1, "connecting", None, None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_nested_extras_are_redacted() -> None:
    nested = {"db": {"url": URL, "hosts": [URL, ("redis://:R3dis-pw@r:6379", 1)]}, URL: 1}
    deep: object = URL
    for _ in range(20):
        deep = [deep]
    line = JsonFormatter().format(_record(config=nested, opaque=Opaque(), deep=deep))
    assert "S3cret-pw" not in line
    assert "R3dis-pw" not in line
    shown = json.loads(line)
    assert shown["config"]["db"]["hosts"][1][1] == 1, "non-string values are kept"
    assert shown["opaque"].startswith("Opaque(postgresql://app:")
