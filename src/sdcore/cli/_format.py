"""Terminal-safe rendering: escaped strings, aligned tables, UTC timestamps, compact ages.

Codes, run keys, names and error texts come from whoever wrote the row. Printed raw, a newline
forges a table line or a log record, an ANSI sequence rewrites the terminal and a bidi override
reverses what the operator reads. Every displayed string goes through :func:`escape`; JSON output
is pure ASCII (``ensure_ascii``), so it is safe for the same reasons.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

ELLIPSIS = "…"

_NAMED_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Controls (C0, DEL, C1: ESC starts ANSI sequences), format characters (bidi overrides and
# isolates, zero-width characters), surrogates, private use, unassigned, line/paragraph separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def escape(text: str) -> str:
    """Return ``text`` with every character that could alter a terminal or log line escaped.

    Backslashes are doubled so that the escaping is unambiguous: a literal ``\\n`` in the data
    prints as ``\\\\n``, a real newline as ``\\n``.

    Args:
        text: Any string from the database or from an error.

    Returns:
        One printable line.
    """
    if text.isprintable() and "\\" not in text:
        return text
    out: list[str] = []
    for char in text:
        named = _NAMED_ESCAPES.get(char)
        if named is not None:
            out.append(named)
        elif unicodedata.category(char) in _UNSAFE_CATEGORIES:
            point = ord(char)
            if point < 0x100:
                out.append(f"\\x{point:02x}")
            elif point < 0x10000:
                out.append(f"\\u{point:04x}")
            else:
                out.append(f"\\U{point:08x}")
        else:
            out.append(char)
    return "".join(out)


def one_line(message: str) -> str:
    """Fold a (driver) message onto one escaped line, keeping backslashes as they are."""
    folded = " ".join(part.strip() for part in message.splitlines() if part.strip())
    return escape(folded).replace("\\\\", "\\")


def _char_width(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def width(text: str) -> int:
    """Return how many terminal columns an escaped string takes."""
    if text.isascii():
        return len(text)
    return sum(_char_width(char) for char in text)


def truncate(text: str, limit: int) -> str:
    """Cut an escaped string to at most ``limit`` columns, marking the cut with ``…``."""
    if width(text) <= limit:
        return text
    kept: list[str] = []
    used = 0
    for char in text:
        size = _char_width(char)
        if used + size > limit - 1:
            break
        kept.append(char)
        used += size
    return "".join(kept) + ELLIPSIS


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], limits: Mapping[str, int]
) -> list[str]:
    """Render escaped cells as aligned columns separated by two spaces.

    Args:
        headers: Column titles.
        rows: Cells, one sequence per row, in header order.
        limits: Maximum width per header; cells beyond it are truncated with ``…``.

    Returns:
        The lines, header first, without trailing spaces.
    """
    cells = [
        [
            truncate(escape(cell), limits.get(header, 10_000))
            for header, cell in zip(headers, row, strict=True)
        ]
        for row in rows
    ]
    widths = [width(header) for header in headers]
    for row in cells:
        widths = [max(size, width(cell)) for size, cell in zip(widths, row, strict=True)]
    lines = []
    for row in [list(headers), *cells]:
        padded = [cell + " " * (size - width(cell)) for cell, size in zip(row, widths, strict=True)]
        lines.append("  ".join(padded).rstrip())
    return lines


def utc_iso(moment: datetime, *, precise: bool = False) -> str:
    """Format an aware datetime in UTC: ``2026-07-20T03:00:00Z`` (microseconds if ``precise``)."""
    text = moment.astimezone(UTC).isoformat(timespec="microseconds" if precise else "seconds")
    return text.removesuffix("+00:00") + "Z"


def compact_age(age: timedelta) -> str:
    """Format a duration as its two largest units: ``3d4h``, ``12m5s``, ``2h``, ``0s``."""
    seconds = max(0, int(age.total_seconds()))
    counts: list[tuple[int, str]] = []
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)):
        count, seconds = divmod(seconds, size)
        counts.append((count, unit))
    for index, (count, unit) in enumerate(counts):
        if count:
            text = f"{count}{unit}"
            if index + 1 < len(counts) and counts[index + 1][0]:
                text += f"{counts[index + 1][0]}{counts[index + 1][1]}"
            return text
    return "0s"


def json_line(value: Mapping[str, Any]) -> str:
    """Serialize one object as a single pure-ASCII JSON line (control and bidi chars escaped)."""
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)


def emit(line: str) -> None:
    """Print one line of command output; a character the terminal cannot encode is escaped."""
    try:
        print(line)
    except UnicodeEncodeError:
        encoding = sys.stdout.encoding or "ascii"
        print(line.encode(encoding, "backslashreplace").decode(encoding))
