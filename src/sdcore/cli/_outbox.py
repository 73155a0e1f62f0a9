"""``sdcore outbox list|retry`` and ``sdcore relay``."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import psycopg

from sdcore.cli._format import emit, escape, json_line, one_line, render_table, utc_iso
from sdcore.cli._options import (
    DEFAULT_LIST_LIMIT,
    TRANSACTION_POOLING_ENV,
    UsageError,
    add_command,
    add_group,
    check_queue_prefix,
    connection_options,
    int_in,
    json_option,
    limit_option,
    outbox_table_option,
    transaction_pooling,
)
from sdcore.cli._target import CliError, Target, connect_async, describe_error, target_of
from sdcore.outbox import (
    DEFAULT_RELAY_BATCH_BYTES,
    DEFAULT_RELAY_BATCH_SIZE,
    Outbox,
    OutboxAdmin,
    OutboxDatabaseError,
    RelaySettings,
)
from sdcore.postgres import PoolSettings, redact_text

Emit = Callable[[str], None]

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
WIDTHS = {"name": 24, "idempotency_key": 28, "last_error": 60}
RELAY_POOL_SIZE = 4
STATUSES = ("PENDING", "DEAD", "PUBLISHED")
DEFAULT_STATUSES = ("PENDING", "DEAD")
JSON_KEYS = (
    "id",
    "status",
    "queue",
    "name",
    "attempts",
    "max_attempts",
    "next_attempt_at",
    "idempotency_key",
    "job_id",
    "last_error",
    "created_at",
    "published_at",
)
T = TypeVar("T")
AsyncConn = psycopg.AsyncConnection[Any]


def _admin_run(target: Target, operation: Callable[[OutboxAdmin, AsyncConn], Awaitable[T]]) -> T:
    """Run one :class:`~sdcore.outbox.OutboxAdmin` operation on a fresh autocommit connection.

    Raises:
        CliError: The database cannot be reached, the table is missing or not an outbox table,
            or a statement failed (one redacted line, with the fix when there is one).
    """

    async def run() -> T:
        admin = OutboxAdmin(Outbox(table=target.table, schema=target.schema))
        async with await connect_async(target) as conn:
            return await operation(admin, conn)

    try:
        return asyncio.run(run())
    except OutboxDatabaseError as exc:
        if isinstance(exc.__cause__, psycopg.Error):
            raise describe_error(exc.__cause__, target) from None
        raise CliError(one_line(redact_text(str(exc), target.dsn))) from None


def list_outbox(
    target: Target, emit: Emit, *, statuses: list[str], limit: int, as_json: bool
) -> None:
    """Print outbox rows newest first (``target.table`` is the outbox table).

    Raises:
        CliError: Database unreachable or table missing.
    """
    rows = _admin_run(
        target, lambda admin, conn: admin.list_rows(conn, statuses=statuses, limit=limit)
    )
    if as_json:
        for row in rows:
            shown: dict[str, Any] = {key: getattr(row, key) for key in JSON_KEYS}
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
            str(row.id),
            row.status,
            row.queue,
            row.name,
            f"{row.attempts}/{row.max_attempts}",
            utc_iso(row.next_attempt_at),
            row.idempotency_key,
            "-" if row.last_error is None else row.last_error,
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
    if not _admin_run(target, lambda admin, conn: admin.retry(conn, row_id)):
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
    _admin_run(target, lambda admin, conn: admin.check_table(conn))


def run_relay(
    target: Target,
    emit: Emit,
    *,
    redis_url: str,
    prefix: str,
    batch_size: int,
    batch_bytes: int = DEFAULT_RELAY_BATCH_BYTES,
    transaction_pooling: bool = False,
) -> None:
    """Run an outbox relay until SIGTERM / SIGINT, publishing to BullMQ on ``redis_url``.

    The relay is a :class:`~sdcore.runtime.Runtime` with only its relay on (no scheduler, no
    processors, no migrations): one pool, wired as every other entry point wires it. With
    ``transaction_pooling`` the pool sends no server-side prepared statement (the URL is a
    transaction-mode pooler such as PgBouncer) and the relay polls instead of LISTENing (a
    notification cannot reach it through such a pooler).

    Raises:
        CliError: The extra is missing, or the database / Redis cannot be reached at start, or
            the outbox table is missing.
    """
    try:
        import sdcore.queues  # noqa: F401 - the extra's check, before any connection
    except ImportError as exc:
        raise CliError(f"the relay needs its extra: {exc}") from None
    from sdcore.runtime import Runtime

    check_outbox(target)
    runtime = Runtime(
        database_url=target.dsn,
        redis_url=redis_url,
        queue_prefix=prefix,
        outbox=Outbox(table=target.table, schema=target.schema),
        pool=PoolSettings(
            transaction_pooling=transaction_pooling,
            max_size=RELAY_POOL_SIZE,
            application_name="sdcore-relay",
        ),
        relay=RelaySettings(batch_size=batch_size, batch_bytes=batch_bytes),
        scheduling=None,
        ensure_schema=False,
        logger_name="sdcore.cli.relay",
    )

    async def relay() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await runtime.start()
        except Exception as exc:  # noqa: BLE001 - one redacted line (pool timeout, Redis…)
            detail = one_line(redact_text(str(exc) or type(exc).__name__, target.dsn))
            raise CliError(f"the relay did not start: {detail}") from None
        relay = runtime.relay
        try:
            emit(f"relaying {escape(target.shown)} to BullMQ ({escape(prefix)}); SIGTERM stops")
            await stop.wait()
            emit("stopping: finishing the batch in flight…")
        finally:
            await runtime.stop()
        if relay is not None:
            state = relay.state
            emit(f"stopped; published {state.published} message(s), {state.failed} failure(s)")

    try:
        asyncio.run(relay())
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None


def register(subparsers: Any) -> None:
    """Add ``sdcore outbox list|retry`` and ``sdcore relay``."""
    commands = add_group(subparsers, "outbox", "inspect and retry transactional outbox rows")
    listing = add_command(commands, "list", _list, help="pending and dead rows, newest first")
    retry = add_command(commands, "retry", _retry, help="make a DEAD row due again")
    relay = add_command(subparsers, "relay", _relay, help="run the outbox relay until SIGTERM")
    for command in (listing, retry, relay):
        connection_options(command)
        outbox_table_option(command)
    listing.add_argument(
        "--status",
        type=str.upper,
        choices=(*STATUSES, "ALL"),
        action="append",
        help="repeatable; default: PENDING and DEAD",
    )
    limit_option(
        listing, DEFAULT_LIST_LIMIT, f"at most this many rows (default: {DEFAULT_LIST_LIMIT})"
    )
    json_option(listing)
    retry.add_argument("id", type=int_in(1, 2**63 - 1), help="outbox row id")
    relay.add_argument("--redis-url", metavar="URL", help="Redis URL (default: $REDIS_URL)")
    relay.add_argument(
        "--transaction-pooling",
        action="store_true",
        default=None,
        help="the database URL is a transaction-mode pooler such as PgBouncer: no server-side "
        f"prepared statements (default: ${TRANSACTION_POOLING_ENV}=1)",
    )
    relay.add_argument("--prefix", default="bull", help="BullMQ key prefix (default: bull)")
    relay.add_argument(
        "--batch-size",
        type=int_in(1, 10_000),
        default=DEFAULT_RELAY_BATCH_SIZE,
        metavar="N",
        help=f"rows per claim (default: {DEFAULT_RELAY_BATCH_SIZE})",
    )
    relay.add_argument(
        "--batch-bytes",
        type=int_in(1, 2**31 - 1),
        default=DEFAULT_RELAY_BATCH_BYTES,
        metavar="BYTES",
        help="payload bytes per claim, as jsonb text; a larger row is claimed alone"
        f" (default: {DEFAULT_RELAY_BATCH_BYTES})",
    )


def _outbox_target(args: argparse.Namespace, environ: Mapping[str, str]) -> Target:
    lease = target_of(args, environ)
    return Target(dsn=lease.dsn, table=args.outbox_table, schema=lease.schema, outbox=True)


def _list(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    chosen = args.status or DEFAULT_STATUSES
    statuses = list(STATUSES) if "ALL" in chosen else sorted(set(chosen))
    target = _outbox_target(args, environ)
    list_outbox(target, emit, statuses=statuses, limit=args.limit, as_json=args.json)


def _retry(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    retry_outbox(_outbox_target(args, environ), emit, args.id)


def _relay(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    target = _outbox_target(args, environ)
    url = args.redis_url or environ.get("REDIS_URL")
    if not url:
        raise UsageError("the relay needs Redis: --redis-url or REDIS_URL")
    check_queue_prefix("--prefix", url, args.prefix)
    run_relay(
        target,
        emit,
        redis_url=url,
        prefix=args.prefix,
        batch_size=args.batch_size,
        batch_bytes=args.batch_bytes,
        transaction_pooling=transaction_pooling(args.transaction_pooling, environ),
    )
