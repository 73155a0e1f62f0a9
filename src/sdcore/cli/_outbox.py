"""``sdcore outbox list|retry`` and ``sdcore relay``."""

from __future__ import annotations

import asyncio
import signal

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from sdcore.cli._db import CliError, Target, connection, describe_error
from sdcore.cli._format import escape, json_line, render_table, utc_iso
from sdcore.cli._jobs import Emit
from sdcore.outbox import Outbox

HEADERS = (
    "id",
    "status",
    "queue",
    "name",
    "attempts",
    "next_attempt_at",
    "idempotency_key",
    "last_error",
)
# The database answered the check a moment ago: a pool that still cannot open is a new outage.
OPEN_TIMEOUT_S = 10
WIDTHS = {"name": 24, "idempotency_key": 28, "last_error": 60}
_LIST = """\
SELECT id, status, queue, name, attempts, max_attempts, next_attempt_at, idempotency_key, job_id,
       last_error, created_at, published_at
FROM {table} WHERE status = ANY(%s) ORDER BY id DESC LIMIT %s"""


def list_outbox(
    target: Target, emit: Emit, *, statuses: list[str], limit: int, as_json: bool
) -> None:
    """Print outbox rows newest first (``target.table`` is the outbox table).

    Raises:
        CliError: Database unreachable or table missing.
    """
    query = sql.SQL(_LIST).format(table=target.identifier)
    with connection(target) as conn, conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(query, (statuses, limit)).fetchall()
    if as_json:
        for row in rows:
            shown = dict(row)
            for key in ("next_attempt_at", "created_at", "published_at"):
                if shown[key] is not None:
                    shown[key] = utc_iso(shown[key], precise=True)
            emit(json_line(shown))
        return
    if not rows:
        emit("no outbox rows found")
        return
    cells = [
        [
            str(row["id"]),
            row["status"],
            row["queue"],
            row["name"],
            f"{row['attempts']}/{row['max_attempts']}",
            utc_iso(row["next_attempt_at"]),
            row["idempotency_key"],
            "-" if row["last_error"] is None else row["last_error"],
        ]
        for row in rows
    ]
    for line in render_table(HEADERS, cells, WIDTHS):
        emit(line)
    if len(rows) == limit:
        emit(f"(limit {limit} reached: raise --limit to see more)")


def retry_outbox(target: Target, emit: Emit, row_id: int) -> None:
    """Make a DEAD (or pending) row due now with its attempts reset.

    Raises:
        CliError: No such row, or it is already published.
    """
    outbox = Outbox(table=target.table, schema=target.schema)
    with connection(target) as conn:
        found = conn.execute(outbox.sql.retry, (row_id,)).fetchone()
    if found is None:
        raise CliError(f"no DEAD or PENDING outbox row with id {row_id}")
    emit(f"outbox row {row_id} is PENDING again and due now")


def check_outbox(target: Target) -> None:
    """Check, in seconds, that the database answers and ``target`` is an outbox table.

    The relay's pool would retry a bad database for its whole open timeout and its loop would
    treat a missing table as an outage forever; one direct connection fails fast with the cause.

    Raises:
        CliError: Cannot connect, the table is missing (with the command that creates it), or
            it is not an outbox table.
    """
    query = sql.SQL(_LIST).format(table=target.identifier)
    with connection(target) as conn:
        conn.execute(query, ([], 0))


def run_relay(
    target: Target,
    emit: Emit,
    *,
    redis_url: str,
    prefix: str,
    batch_size: int,
    transaction_pooling: bool = False,
) -> None:
    """Run an outbox relay until SIGTERM / SIGINT, publishing to BullMQ on ``redis_url``.

    With ``transaction_pooling`` the relay's pool sends no server-side prepared statement (the
    URL is a transaction-mode pooler such as PgBouncer) and the relay polls instead of LISTENing
    (a notification cannot reach it through such a pooler).

    Raises:
        CliError: The extra is missing, or the database / Redis cannot be reached at start, or
            the outbox table is missing.
    """
    try:
        from sdcore.queues import BullMQPublisher
    except ImportError as exc:
        raise CliError(f"the relay needs its extra: {exc}") from None
    from sdcore.outbox import OutboxRelay
    from sdcore.postgres import DatabaseConnectError, PoolSettings, create_pool, open_pool

    check_outbox(target)

    async def relay() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        outbox = Outbox(table=target.table, schema=target.schema)
        settings = PoolSettings(
            min_size=1,
            max_size=4,
            application_name="sdcore-relay",
            transaction_pooling=transaction_pooling,
            open_timeout_ms=OPEN_TIMEOUT_S * 1000,
        )
        pool = create_pool(target.dsn, settings)
        try:
            await open_pool(pool)
        except DatabaseConnectError as exc:
            raise CliError(f"cannot connect to the database: {exc.reason}") from None
        publisher = BullMQPublisher.from_url(redis_url, prefix=prefix)
        relay = OutboxRelay(
            pool,
            publisher,
            outbox=outbox,
            batch_size=batch_size,
            transaction_pooling=transaction_pooling,
        )
        async with pool, publisher, relay:
            emit(f"relaying {escape(target.shown)} to BullMQ ({escape(prefix)}); SIGTERM stops")
            await stop.wait()
            emit("stopping: finishing the batch in flight…")
        state = relay.state
        emit(f"stopped; published {state.published} message(s), {state.failed} failure(s)")

    try:
        asyncio.run(relay())
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None
