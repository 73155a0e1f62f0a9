"""The lease statements, rendered once per table from ``sdcore/postgres/sql/``.

The SQL itself, with the reasoning behind each statement, is in ``lease.sql`` (the lease),
``lease_ticks.sql`` (the scheduler's tick operations) and ``ticks.sql`` (a burst of ticks in one
statement); this module only fills in the table and its fencing sequence, once per service, so
that the hot path sends ready-made bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Self

from psycopg import sql

from sdcore._internal.sql import queries, render
from sdcore.postgres import derived_name


def fencing_sequence(table: sql.Identifier, sequence: sql.Identifier | None = None) -> str:
    """Return the SQL of the table's fencing sequence as a ``regclass`` (for ``nextval``).

    By default ``{table}_fencing_seq`` next to the table, as migration ``lease/0002`` names it.
    """
    if sequence is None:
        *schema, name = table._obj  # psycopg keeps the identifier's parts here
        sequence = sql.Identifier(*schema, derived_name(name, "fencing_seq"))
    return sql.Literal(sequence.as_string(None)).as_string(None) + "::regclass"


class _Rendered:
    """Render every field of a statements dataclass from the ``.sql`` file of the same names."""

    __slots__ = ()
    FILE = ""

    @classmethod
    def render(cls, table: sql.Identifier, sequence: sql.Identifier | None = None) -> Self:
        """Render every statement for ``table`` and its fencing ``sequence``.

        Args:
            table: The quoted (optionally schema-qualified) table.
            sequence: Its fencing sequence; by default ``{table}_fencing_seq`` next to it, as
                migration ``lease/0002`` names it.
        """
        named = queries(cls.FILE)
        seq = fencing_sequence(table, sequence)
        values = {
            f.name: render(named[f.name], table, sequence=seq).as_string(None).encode("utf-8")
            for f in fields(cls)  # type: ignore[arg-type]
        }
        return cls(**values)


@dataclass(frozen=True, slots=True)
class LeaseStatements(_Rendered):
    """The lease statements of ``lease.sql`` rendered for one table."""

    FILE = "lease"

    acquire: bytes
    heartbeat: bytes
    finalize: bytes
    reopen: bytes
    finalize_many: bytes
    read_status: bytes
    statuses: bytes
    acquire_many: bytes
    read_owned_many: bytes


@dataclass(frozen=True, slots=True)
class TickStatements(_Rendered):
    """The scheduler tick statements of ``lease_ticks.sql`` rendered for one table."""

    FILE = "lease_ticks"

    acquire_attempt: bytes
    record_skipped: bytes
    tick_records: bytes
    reopen_initial: bytes
    first_seen: bytes


@dataclass(frozen=True, slots=True)
class TickBatchStatements(_Rendered):
    """The statements of ``ticks.sql`` rendered for one table."""

    FILE = "ticks"

    acquire_attempt_many: bytes
    read_owned_attempts: bytes
