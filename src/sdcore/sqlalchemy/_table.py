"""The job scheduler table as a SQLAlchemy ``Table``: the DDL of ``schema_sql()``, declared again.

``sdcore.postgres.schema_sql()`` stays the single source of truth; this declaration mirrors it
column by column so that Alembic autogenerate finds nothing to change on a database created by
``ensure_schema()`` and ``metadata.create_all()`` builds the same table. An integration test
compares both catalogs.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP, UUID
from sqlalchemy.schema import conv

from sdcore.postgres import check_identifier, derived_name

# The id default of migration lease/0005 (a UUID version 7; PostgreSQL 15 has no uuidv7()),
# spelled as PostgreSQL prints it back (pg_get_expr): Alembic compares defaults as text.
UUIDV7_DEFAULT = (
    "(encode(set_bit(set_bit(OVERLAY(uuid_send(gen_random_uuid()) PLACING"
    " SUBSTRING(int8send((floor((EXTRACT(epoch FROM clock_timestamp())"
    " * (1000)::numeric)))::bigint) FROM 3) FROM 1 FOR 6), (52)::bigint, 1), (53)::bigint, 1),"
    " 'hex'::text))::uuid"
)


def job_scheduler_table(
    metadata: MetaData, *, table: str = "job_scheduler", schema: str | None = None
) -> Table:
    """Declare the job scheduler table on ``metadata``, identical to ``schema_sql()``.

    Same columns in the same order, types, nullability, server defaults, primary key, unique
    constraint, check constraints and indexes, all with the names the DDL gives them. Names are
    wrapped in :class:`sqlalchemy.schema.conv` so that a ``naming_convention`` on ``metadata``
    cannot rename them (a renamed constraint would be a difference Alembic reports).

    The check constraints are emitted by ``create_all`` and by Alembic for a new table, but
    Alembic autogenerate does not compare check constraints of an existing table.

    Args:
        metadata: The metadata to add the table to (e.g. ``Base.metadata`` for Alembic).
        table: Table name, as given to ``JobSchedulerService(table=...)``.
        schema: Schema name, or ``None`` for the connection's ``search_path``.

    Returns:
        The new :class:`sqlalchemy.Table`.

    Raises:
        InvalidIdentifierError: ``table`` or ``schema`` is not a valid PostgreSQL identifier.
        sqlalchemy.exc.InvalidRequestError: ``metadata`` already holds this table.
    """
    check_identifier("table", table)
    if schema is not None:
        check_identifier("schema", schema)

    def name(suffix: str) -> conv:
        return conv(derived_name(table, suffix))

    result = Table(
        table,
        metadata,
        # Migration lease/0005: time-ordered ids (UUID version 7 from the database clock).
        Column("id", UUID(as_uuid=False), nullable=False, server_default=text(UUIDV7_DEFAULT)),
        Column("lock_key", Text, nullable=False),
        Column("idempotency_key", Text, nullable=False),
        Column("code", String(64), nullable=False),
        Column("name", String(256), nullable=True),
        Column("type", Text, nullable=False),
        Column("run_key", Text, nullable=True),
        Column("status", Text, nullable=False),
        Column("owner_token", UUID(as_uuid=False), nullable=False),
        Column("fencing_token", BigInteger, nullable=False, server_default=text("1")),
        # none_as_null: a Python None is SQL NULL, as the service writes it, never JSON 'null'.
        Column("data", JSONB(none_as_null=True), nullable=True),
        Column(
            "created_at",
            TIMESTAMP(timezone=True),
            nullable=False,
            server_default=text("clock_timestamp()"),
        ),
        Column(
            "modified_at",
            TIMESTAMP(timezone=True),
            nullable=False,
            server_default=text("clock_timestamp()"),
        ),
        # Migration lease/0002: the lease the current owner asked for (NULL on 0.1.0 rows).
        Column("lease_ms", BigInteger, nullable=True),
        # Migration lease/0003: the scheduler's attempt budget.
        Column("attempts", Integer, nullable=False, server_default=text("1")),
        # Migration lease/0007: why a FAIL row may be taken again (never the caller's data).
        Column("released", Text, nullable=True),
        Column("given_back", Text, nullable=True),
        PrimaryKeyConstraint("id", name=name("pkey")),
        UniqueConstraint("lock_key", name=name("lock_key_key")),
        CheckConstraint("type IN ('INITIAL', 'SCHEDULE')", name=name("type_check")),
        CheckConstraint("status IN ('RUNNING', 'SUCCESS', 'FAIL')", name=name("status_check")),
        CheckConstraint("(type = 'INITIAL') = (run_key IS NULL)", name=name("run_key_check")),
        CheckConstraint("fencing_token >= 1", name=name("fencing_token_check")),
        CheckConstraint("lease_ms IS NULL OR lease_ms > 2", name=name("lease_ms_check")),
        CheckConstraint("attempts >= 0", name=name("attempts_check")),
        schema=schema,
    )
    # The fencing sequence (migration lease/0002): create_all() creates it; Alembic autogenerate
    # does not compare or create sequences (see docs/how-to/sqlalchemy-alembic.md).
    # CACHE 1 (migration lease/0007): tokens are handed out in the order they are drawn.
    Sequence(
        derived_name(table, "fencing_seq"), metadata=metadata, schema=schema, minvalue=1, cache=1
    )
    Index(name("code_created_at_idx"), result.c.code, result.c.created_at.desc())
    # Migration lease/0004: created_at (never updated) replaced (status, modified_at), so that
    # complete and heartbeat are HOT updates.
    Index(name("created_at_idx"), result.c.created_at)
    # Migration lease/0006: the RUNNING rows, for operators' listings.
    Index(
        name("running_idx"),
        result.c.created_at.desc(),
        result.c.id.desc(),
        postgresql_where=text("status = 'RUNNING'"),
    )
    return result
