"""Named SQL statements kept as ``.sql`` files in ``sdcore/postgres/sql/``, read once.

A file holds blocks that start with ``-- name: NAME``; the comment lines right after the marker
document the statement and are kept (PostgreSQL ignores them). ``{table}``-style placeholders are
filled with :func:`render` (identifiers and fixed fragments only; values stay parameters).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

_MARKER = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


@cache
def queries(file: str) -> dict[str, str]:
    """Return the named statements of ``sql/<file>.sql``.

    Raises:
        KeyError: Two blocks with one name, or no block at all (a packaging error).
    """
    text = resources.files("sdcore.postgres").joinpath("sql", f"{file}.sql").read_text("utf-8")
    parts = _MARKER.split(text)
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in found:
            raise KeyError(f"sql/{file}.sql names {name!r} twice")
        found[name] = body.strip() + "\n"
    if not found:
        raise KeyError(f"sql/{file}.sql has no '-- name:' block")
    return found


def render(statement: str, table: sql.Identifier, **fragments: str) -> sql.Composed:
    """Fill ``{table}`` and fixed SQL fragments (never values) into a statement."""
    return sql.SQL(statement).format(
        table=table, **{name: sql.SQL(text) for name, text in fragments.items()}
    )
