"""``acquire_attempt`` for many ticks in one statement (``JobSchedulerService.acquire_attempts``).

The scheduler's batch start sends the ticks due in one turn of its event loop here together
(see :mod:`sdcore.scheduling._batch`). The statement (``acquire_attempt_many`` in
``sdcore/postgres/sql/ticks.sql``) applies the rules of the single-tick ``ACQUIRE_ATTEMPT`` to
every key, locking and inserting in key order so that replicas racing over the same burst never
deadlock. Around it, the same client-side rules as a single acquire:

- each lease is valid on the client from the moment the statement was sent, for its own
  ``lease_ms`` less the clock margin; a won lease whose answer used more than half of that is
  confirmed with a heartbeat before it is reported (and reported lost if that fails);
- the statement is abandoned, and every key reported not acquired, if it does not answer within
  the shortest lease of the batch (a row it wrote expires with its lease);
- a broken connection (an ambiguous commit): the rows that show our tokens are ours, the others
  are reported not acquired (the scheduler's retry offers and catch-up take it from there);
- a key whose insert met a row committed after the statement's snapshot is sent once more in
  a second statement: that row may be a busy replica's skip record, which this replica takes
  over and runs (``conflicted`` in ``ticks.sql``);
- a caller cancelled meanwhile, also during the recovery of a broken connection, gives back
  (``FAIL``) every row it turned out to own.

The confirmation of late leases and the give-back on cancellation are ``acquire_many``'s own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from sdcore._internal.identifiers import qualified, random_uuids
from sdcore.job_scheduler._attempts import AttemptBudget
from sdcore.job_scheduler._core import LOSER_ERRORS, NOT_ACQUIRED, RUNNING, settle, won
from sdcore.job_scheduler._model import JobAcquireResult, _LeaseState
from sdcore.job_scheduler._options import JobAcquireOptions
from sdcore.job_scheduler._service import JobSchedulerService
from sdcore.job_scheduler._sql import _Rendered
from sdcore.job_scheduler._watchdog import _Abandoned

MAX_ITEMS = 10_000


@dataclass(frozen=True, slots=True)
class TickBatchStatements(_Rendered):
    """The statements of ``ticks.sql`` rendered for one table."""

    FILE = "ticks"

    acquire_attempt_many: bytes
    read_owned_attempts: bytes


def _statements(service: JobSchedulerService) -> TickBatchStatements:
    # Rendered on first use, once per service (only the scheduler's batch start needs them).
    rendered: TickBatchStatements | None = service.__dict__.get("_tick_batch_sql")
    if rendered is None:
        rendered = TickBatchStatements.render(qualified(service._table, service._schema))
        service.__dict__["_tick_batch_sql"] = rendered
    return rendered


Item = tuple[JobAcquireOptions, AttemptBudget]
Result = tuple[JobAcquireResult, int]


def _check(items: Sequence[Item]) -> list[Item]:
    if not isinstance(items, (list, tuple)):
        raise ValueError("acquire_attempts takes a list or tuple of (options, budget) pairs")
    batch = list(items)
    if len(batch) > MAX_ITEMS:
        raise ValueError(f"acquire_attempts takes at most {MAX_ITEMS} items, got {len(batch)}")
    for index, item in enumerate(batch):
        if (
            not isinstance(item, tuple)
            or len(item) != 2
            or type(item[0]) is not JobAcquireOptions
            or type(item[1]) is not AttemptBudget
        ):
            raise ValueError(
                f"acquire_attempts item {index} must be (JobAcquireOptions, AttemptBudget)"
            )
    if len({options.lock_key for options, _ in batch}) != len(batch):
        raise ValueError("acquire_attempts: two items for one lock key")
    return batch


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


def _params(ordered: list[Item], tokens: list[str]) -> tuple[Any, ...]:
    """The parameters of ``acquire_attempt_many`` (items sorted by lock key)."""
    options = [o for o, _ in ordered]
    budgets = [b for _, b in ordered]
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


async def acquire_attempts(service: JobSchedulerService, items: Sequence[Item]) -> list[Result]:
    """See :meth:`JobSchedulerService.acquire_attempts`."""
    batch = _check(items)
    if not batch:
        return []
    await service._restart_initial([o for o, _ in batch])
    ordered = sorted(batch, key=lambda item: item[0].lock_key)
    tokens = random_uuids(len(ordered))
    statements = _statements(service)
    sent = time.monotonic()
    limit = _LeaseState.for_lease(min(o.lease_ms for o, _ in batch), sent).valid
    rows = await _send(service, statements, ordered, tokens, sent, limit)
    conflicted = {row[0] for row in rows if row[1] is None}
    sent_at = dict.fromkeys((o.lock_key for o, _ in ordered), sent)
    if conflicted:
        # A row of these keys appeared after the statement's snapshot (their inserts met it on
        # the unique index). If it is a skip record of a busy replica, this replica must run
        # the tick: one more statement, whose snapshot takes a skip row over without waiting.
        again = [(item, token) for item, token in zip(ordered, tokens, strict=True)]
        again = [(item, token) for item, token in again if item[0].lock_key in conflicted]
        resent = time.monotonic()
        redo = _LeaseState.for_lease(min(o.lease_ms for (o, _), _ in again), resent).valid
        rows = [row for row in rows if row[1] is not None]
        try:
            retried = await _send(
                service,
                statements,
                [item for item, _ in again],
                [token for _, token in again],
                resent,
                redo,
            )
        except asyncio.CancelledError:
            # The first statement's wins are ours to give back too.
            every = [o for o, _ in ordered]
            await settle(service._resolve_cancelled_many(every, tokens, sent, limit))
            raise
        rows += [row for row in retried if row[1] is not None]
        for won_again in retried:
            sent_at[won_again[0]] = resent
    # Rows: (lock_key, id, fencing_token, idempotency_key, created_at, modified_at, attempts).
    hits = {row[0]: row for row in rows}
    token_of = dict(zip((o.lock_key for o, _ in ordered), tokens, strict=True))
    results: list[Result] = []
    late: list[int] = []
    for options, _ in batch:
        row = hits.get(options.lock_key)
        if row is None:
            results.append((NOT_ACQUIRED, 0))
            continue
        state = _LeaseState.for_lease(options.lease_ms, sent_at[options.lock_key])
        result = won(options, token_of[options.lock_key], row[1:6], state)
        if state.time_left() < state.valid / 2:
            late.append(len(results))
        results.append((result, int(row[6])))
    if late:
        # Confirmed (or given back) as acquire_many's late leases are, in place.
        leases = [result for result, _ in results]
        await service._confirm_many([o for o, _ in batch], leases, late)
        for index in late:
            results[index] = (leases[index], results[index][1] if leases[index].acquired else 0)
    return results


async def _send(
    service: JobSchedulerService,
    statements: TickBatchStatements,
    ordered: list[Item],
    tokens: list[str],
    sent: float,
    limit: float,
) -> list[tuple[Any, ...]]:
    """One ``acquire_attempt_many``: its rows (a conflicted key has id ``None``), or those our
    tokens show after a broken connection. A caller cancelled at any point of it, the recovery
    included, gives back every row it turned out to own."""
    try:
        try:
            return await service._fetch_rows(
                statements.acquire_attempt_many, _params(ordered, tokens), limit
            )
        except LOSER_ERRORS:
            return []
        except _Abandoned:
            _log_abandoned(service, len(ordered))
            return []
        except psycopg.OperationalError as exc:
            if exc.sqlstate and not isinstance(exc, pg_errors.AdminShutdown):
                raise service._wrap(exc) from exc
            return await _owned(service, statements, ordered, tokens, sent, limit, exc)
        except psycopg.Error as exc:
            raise service._wrap(exc) from exc
    except asyncio.CancelledError:
        options = [o for o, _ in ordered]
        await settle(service._resolve_cancelled_many(options, tokens, sent, limit))
        raise


async def _owned(
    service: JobSchedulerService,
    statements: TickBatchStatements,
    ordered: list[Item],
    tokens: list[str],
    sent: float,
    limit: float,
    first: psycopg.Error,
) -> list[tuple[Any, ...]]:
    """The connection broke mid-statement: the rows that show our tokens are the ones we won."""
    await service._held.reset_idle()
    keys = [o.lock_key for o, _ in ordered]
    left = max(sent + limit - time.monotonic(), 0.0)
    try:
        rows = await service._fetch_rows(statements.read_owned_attempts, (keys, tokens), left)
    except _Abandoned:
        _log_abandoned(service, len(ordered))
        return []
    except psycopg.Error as exc:
        raise service._wrap(exc) from first
    # (lock_key, status, id, …, attempts) -> the shape of the acquire's rows.
    return [(row[0], *row[2:]) for row in rows if row[1] == RUNNING]


def _log_abandoned(service: JobSchedulerService, count: int) -> None:
    service._log.warning(
        "acquire_attempts of %d ticks did not answer within the shortest lease; connection "
        "abandoned",
        count,
        extra={"action": "statement_abandoned"},
    )
