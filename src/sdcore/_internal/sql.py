"""Named SQL statements kept as ``.sql`` files in ``sdcore/postgres/sql/``, read once.

A file holds blocks that start with ``-- name: NAME``; the comment lines right after the marker
document the statement and are kept (PostgreSQL ignores them). ``{table}``-style placeholders are
filled with :func:`render` (identifiers and fixed fragments only; values stay parameters).

A statement includes a piece of ``sql/fragments.sql`` with ``{{name}}``: the piece's SQL (its
documenting comment lines dropped) replaces the token when the file is read, before any
placeholder is filled, and may include other pieces. An unknown name is a packaging error.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

_MARKER = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_INCLUDE = re.compile(r"\{\{([a-z_][a-z0-9_]*)\}\}")
_FRAGMENTS = "fragments"


@cache
def queries(file: str) -> dict[str, str]:
    """Return the named statements of ``sql/<file>.sql``, their ``{{name}}`` pieces expanded.

    Raises:
        KeyError: Two blocks with one name, no block at all, or an unknown or circular
            ``{{name}}`` (a packaging error).
    """
    found = _blocks(file)
    if file == _FRAGMENTS:
        return found
    pieces = _pieces()
    return {name: _expand(body, pieces, file, ()) for name, body in found.items()}


@cache
def _pieces() -> dict[str, str]:
    """The SQL of each piece of ``sql/fragments.sql``, without its comment lines."""
    return {
        name: "\n".join(
            line for line in body.splitlines() if not line.lstrip().startswith("--")
        ).strip()
        for name, body in _blocks(_FRAGMENTS).items()
    }


def _expand(text: str, pieces: dict[str, str], file: str, seen: tuple[str, ...]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in pieces:
            raise KeyError(f"sql/{file}.sql includes {{{{{name}}}}}, not in sql/fragments.sql")
        if name in seen:
            raise KeyError(f"sql/fragments.sql: {name!r} includes itself")
        return _expand(pieces[name], pieces, file, (*seen, name))

    return _INCLUDE.sub(one, text)


def _blocks(file: str) -> dict[str, str]:
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
