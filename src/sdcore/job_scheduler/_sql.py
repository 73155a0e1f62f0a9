"""The lease statements, rendered once per table from ``sdcore/postgres/sql/``.

The SQL itself, with the reasoning behind each statement, is in ``lease.sql`` (the lease),
``lease_ticks.sql`` (the scheduler's tick operations) and ``ticks.sql`` (a burst of ticks in one
statement). This module fills in the table and its fencing sequence, once per service, so that
the hot path sends ready-made bytes, and lays out the acquire statements' parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Self

from psycopg import sql

from sdcore._internal.sql import queries, render
from sdcore.job_scheduler._attempts import AttemptBudget
from sdcore.job_scheduler._options import JobAcquireOptions
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
    first_seen_many: bytes


@dataclass(frozen=True, slots=True)
class TickBatchStatements(_Rendered):
    """The statements of ``ticks.sql`` rendered for one table."""

    FILE = "ticks"

    acquire_attempt_many: bytes
    read_owned_attempts: bytes


def identity_params(opts: JobAcquireOptions, token: str) -> tuple[Any, ...]:
    """The first parameters of every insert into the lease table, in the statements' order."""
    return (
        opts.lock_key,
        opts.idempotency_key,
        opts.code,
        opts.name,
        str(opts.type),
        opts.run_key,
        token,
    )


def many_params(options: list[JobAcquireOptions], tokens: list[str]) -> tuple[Any, ...]:
    """The column arrays of ``acquire_many`` (items sorted by lock key)."""
    return (
        [o.lock_key for o in options],
        [o.idempotency_key for o in options],
        [o.code for o in options],
        [o.name for o in options],
        [str(o.type) for o in options],
        [o.run_key for o in options],
        tokens,
        [o.lease_ms for o in options],
    )


def _joined(keys: list[str]) -> str:
    """``keys`` as one comma-separated text (``v2:`` hex keys and UUIDs hold no comma)."""
    text = ",".join(keys)
    if text.count(",") != len(keys) - 1:  # cannot happen for derived keys: checked, not assumed
        raise ValueError("acquire_attempts: a key or token holds a comma")
    return text


def _column(values: list[Any]) -> tuple[list[Any] | None, Any]:
    """A column as ``(array, None)``, or ``(None, value)`` when every key has the same value."""
    first = values[0]
    if values.count(first) == len(values):
        return None, first
    return values, None


def ticks_params(
    options: list[JobAcquireOptions], budgets: list[AttemptBudget], tokens: list[str]
) -> tuple[Any, ...]:
    """The parameters of ``acquire_attempt_many`` (items sorted by lock key)."""
    return (
        _joined([o.lock_key for o in options]),
        _joined([o.idempotency_key for o in options]),
        [o.code for o in options],
        _joined(tokens),
        *_column([o.name for o in options]),
        *_column([str(o.type) for o in options]),
        *_column([o.run_key for o in options]),
        *_column([o.lease_ms for o in options]),
        *_column([b.max_attempts for b in budgets]),
        *_column([float(b.backoff_ms) for b in budgets]),
    )
