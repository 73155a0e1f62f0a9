"""The one source of truth for sdcore's tables, and race-safe schema creation."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from psycopg import sql

if TYPE_CHECKING:
    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool

# One advisory lock serializes every sdcore schema change: 16 replicas running
# CREATE TABLE IF NOT EXISTS at once otherwise fail on pg_type's unique index (RESEARCH.md).
SCHEMA_LOCK_ID = int.from_bytes(hashlib.sha256(b"sdcore/schema").digest()[:8], "big", signed=True)

MAX_IDENTIFIER_BYTES = 63

_JOB_TABLE = """\
CREATE TABLE IF NOT EXISTS {table} (
    id              uuid         NOT NULL DEFAULT gen_random_uuid(),
    lock_key        text         NOT NULL,
    idempotency_key text         NOT NULL,
    code            varchar(64)  NOT NULL,
    name            varchar(256),
    type            text         NOT NULL,
    run_key         text,
    status          text         NOT NULL,
    owner_token     uuid         NOT NULL,
    fencing_token   bigint       NOT NULL DEFAULT 1,
    data            jsonb,
    created_at      timestamptz  NOT NULL DEFAULT clock_timestamp(),
    modified_at     timestamptz  NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT {pkey} PRIMARY KEY (id),
    CONSTRAINT {lock_key_unique} UNIQUE (lock_key),
    CONSTRAINT {type_check} CHECK (type IN ('INITIAL', 'SCHEDULE')),
    CONSTRAINT {status_check} CHECK (status IN ('RUNNING', 'SUCCESS', 'FAIL')),
    CONSTRAINT {run_key_check} CHECK ((type = 'INITIAL') = (run_key IS NULL)),
    CONSTRAINT {fencing_check} CHECK (fencing_token >= 1)
);
CREATE INDEX IF NOT EXISTS {code_idx} ON {table} (code, created_at DESC);
CREATE INDEX IF NOT EXISTS {status_idx} ON {table} (status, modified_at);
"""


_OUTBOX_TABLE = """\
CREATE TABLE IF NOT EXISTS {table} (
    id              bigint       GENERATED ALWAYS AS IDENTITY,
    idempotency_key text         NOT NULL,
    queue           text         NOT NULL,
    name            text         NOT NULL,
    job_id          text         NOT NULL,
    payload         jsonb        NOT NULL,
    options         jsonb        NOT NULL DEFAULT '{{}}',
    status          text         NOT NULL DEFAULT 'PENDING',
    attempts        integer      NOT NULL DEFAULT 0,
    max_attempts    integer      NOT NULL,
    next_attempt_at timestamptz  NOT NULL DEFAULT clock_timestamp(),
    claimed_until   timestamptz,
    last_error      text,
    created_at      timestamptz  NOT NULL DEFAULT clock_timestamp(),
    published_at    timestamptz,
    CONSTRAINT {pkey} PRIMARY KEY (id),
    CONSTRAINT {key_unique} UNIQUE (idempotency_key),
    CONSTRAINT {status_check} CHECK (status IN ('PENDING', 'PUBLISHED', 'DEAD'))
);
CREATE INDEX IF NOT EXISTS {due_idx} ON {table} (next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX IF NOT EXISTS {published_idx} ON {table} (published_at) WHERE status = 'PUBLISHED';
"""


class InvalidIdentifierError(ValueError):
    """A schema or table name that PostgreSQL would truncate or cannot hold."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"invalid {field}: {problem}")


def check_identifier(field: str, value: object) -> str:
    """Validate a configurable identifier (quoted later with ``sql.Identifier``).

    Args:
        field: The option name, for the message.
        value: The identifier.

    Returns:
        The identifier, unchanged.

    Raises:
        InvalidIdentifierError: Not a str, empty, with NUL, or longer than 63 bytes.
    """
    if not isinstance(value, str):
        raise InvalidIdentifierError(field, f"must be a str, got {type(value).__name__}")
    if not value:
        raise InvalidIdentifierError(field, "must not be empty")
    if "\x00" in value:
        raise InvalidIdentifierError(field, "must not contain a NUL character")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidIdentifierError(field, "must be valid Unicode") from None
    if size > MAX_IDENTIFIER_BYTES:
        raise InvalidIdentifierError(
            field, f"PostgreSQL would truncate it: {size} bytes, at most {MAX_IDENTIFIER_BYTES}"
        )
    return value


def qualified(table: str, schema: str | None) -> sql.Identifier:
    """Return the quoted ``schema.table`` (or ``table``) after validating both parts."""
    check_identifier("table", table)
    if schema is None:
        return sql.Identifier(table)
    return sql.Identifier(check_identifier("schema", schema), table)


def derived_name(table: str, suffix: str) -> str:
    """Return the name of a constraint or index of ``table``: ``{table}_{suffix}``.

    When that exceeds 63 bytes the table part is clipped (at a character boundary) and an
    8-hex-digit hash of the whole table name is added, so two long table names that share a
    prefix never get the same index names (``CREATE INDEX IF NOT EXISTS`` would silently skip the
    second table's indexes).

    Args:
        table: The validated table name.
        suffix: ``lock_key_key``, ``pkey``, ``code_created_at_idx``, ...

    Returns:
        The unquoted name, at most 63 bytes.
    """
    name = f"{table}_{suffix}"
    if len(name.encode("utf-8")) <= MAX_IDENTIFIER_BYTES:
        return name
    digest = hashlib.sha256(table.encode("utf-8")).hexdigest()[:8]
    room = MAX_IDENTIFIER_BYTES - len(suffix.encode("utf-8")) - len(digest) - 2
    base = table.encode("utf-8")[:room].decode("utf-8", "ignore")
    return f"{base}_{digest}_{suffix}"


def _derived(table: str, suffix: str) -> sql.Identifier:
    return sql.Identifier(derived_name(table, suffix))


def _render(template: str, table: str, schema: str | None, names: dict[str, str]) -> str:
    """Fill a DDL template: ``{table}`` plus constraint/index names derived from the table."""
    body = sql.SQL(template).format(
        table=qualified(table, schema),
        **{placeholder: _derived(table, suffix) for placeholder, suffix in names.items()},
    )
    parts: list[sql.Composable] = []
    if schema is not None:
        parts.append(sql.SQL("CREATE SCHEMA IF NOT EXISTS {};\n").format(sql.Identifier(schema)))
    parts.append(body)
    return sql.Composed(parts).as_string(None)


def schema_sql(*, table: str = "job_scheduler", schema: str | None = None) -> str:
    """Return the idempotent DDL of the job scheduler table.

    Args:
        table: Table name.
        schema: Schema name; ``None`` means the connection's default (``search_path``).

    Returns:
        A SQL script (``CREATE … IF NOT EXISTS``), safe to run more than once.

    Raises:
        InvalidIdentifierError: A bad table or schema name.
    """
    names = {
        "pkey": "pkey",
        "lock_key_unique": "lock_key_key",
        "type_check": "type_check",
        "status_check": "status_check",
        "run_key_check": "run_key_check",
        "fencing_check": "fencing_token_check",
        "code_idx": "code_created_at_idx",
        "status_idx": "status_modified_at_idx",
    }
    return _render(_JOB_TABLE, table, schema, names)


def outbox_schema_sql(*, table: str = "outbox", schema: str | None = None) -> str:
    """Return the idempotent DDL of the outbox table (arguments as :func:`schema_sql`)."""
    names = {
        "pkey": "pkey",
        "key_unique": "idempotency_key_key",
        "status_check": "status_check",
        "due_idx": "due_idx",
        "published_idx": "published_idx",
    }
    return _render(_OUTBOX_TABLE, table, schema, names)


async def apply_schema(
    target: AsyncConnection[object] | AsyncConnectionPool[AsyncConnection[object]],
    script: str,
) -> None:
    """Run a DDL script in one transaction under sdcore's schema advisory lock.

    Args:
        target: A connection (must not be inside a transaction) or a pool.
        script: The DDL, e.g. from :func:`schema_sql`.
    """
    from psycopg import AsyncConnection as _Conn

    if isinstance(target, _Conn):
        await _apply(target, script)
        return
    async with target.connection() as conn:
        await _apply(conn, script)


async def _apply(conn: AsyncConnection[object], script: str) -> None:
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_ID,))
        await conn.execute(script.encode("utf-8"))
