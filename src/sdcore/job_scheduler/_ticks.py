"""Scheduler tick operations on PostgreSQL (``lease_ticks.sql``; rules in ``_attempts.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import datetime

import psycopg
from psycopg import errors as pg_errors

from sdcore._internal.identifiers import random_uuid
from sdcore._json import dump_json_object
from sdcore.job_scheduler._attempts import AttemptBudget, TickRecord
from sdcore.job_scheduler._core import (
    NOT_ACQUIRED,
    RUNNING,
    STATUS,
    _LeaseCore,
    identity_params,
    settle,
    won,
)
from sdcore.job_scheduler._model import (
    JobAcquireResult,
    JobSchedulerType,
    _check_lock_keys,
    _LeaseState,
)
from sdcore.job_scheduler._options import JobAcquireOptions
from sdcore.job_scheduler._watchdog import _Abandoned


class _TickOperations(_LeaseCore):
    """The tick operations ``sdcore.scheduling`` runs on the lease table."""

    async def acquire_attempt(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> tuple[JobAcquireResult, int]:
        """``acquire`` within a tick's attempt budget (needs migration ``lease/0003``).

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
            JobSchedulerDatabaseError: The database refused the statement (e.g. no
                ``attempts`` column: run ``sdcore db upgrade``).
        """
        await self._restart_initial([options])
        token = random_uuid()
        params = (
            *identity_params(options, token),
            options.lease_ms,
            budget.max_attempts,
            budget.backoff_ms,
        )
        sent = time.monotonic()
        state = _LeaseState.for_lease(options.lease_ms, sent)
        # A cancellation anywhere, the recovery of a broken connection included, resolves the
        # outcome by our token and gives back a row we won (never RUNNING with no owner).
        try:
            try:
                query = self._tick_sql.acquire_attempt
                row = await self._acquire_row(options, query, params, state.valid)
            except psycopg.OperationalError as exc:
                if exc.sqlstate and not isinstance(exc, pg_errors.AdminShutdown):
                    raise self._wrap(exc) from exc
                return await self._attempt_again(options, token, state, exc)
            except psycopg.Error as exc:
                raise self._wrap(exc) from exc
        except asyncio.CancelledError:
            await settle(self._resolve_cancelled(options, token, state))
            raise
        if row is None:
            return NOT_ACQUIRED, 0
        result = await self._confirmed(options, won(options, token, row[:-1], state))
        return (result, int(row[-1])) if result.acquired else (NOT_ACQUIRED, 0)

    async def _attempt_again(
        self, options: JobAcquireOptions, token: str, state: _LeaseState, first: psycopg.Error
    ) -> tuple[JobAcquireResult, int]:
        """Ambiguous commit: our token is in the row only if the statement committed."""
        await self._held.reset_idle()
        try:
            owned = await self._fetch(
                self._sql.read_owned, (options.lock_key, token), max(state.time_left(), 0.0)
            )
        except _Abandoned:
            return NOT_ACQUIRED, 0
        except psycopg.Error as again:
            raise self._wrap(again) from first
        if owned is None or owned[0] != RUNNING:
            return NOT_ACQUIRED, 0
        records = await self.tick_records([options.lock_key])
        record = records.get(options.lock_key)
        result = await self._confirmed(options, won(options, token, owned[1:], state))
        if not result.acquired:
            return NOT_ACQUIRED, 0
        return result, 1 if record is None else record.attempts

    async def _restart_initial(self, items: Sequence[JobAcquireOptions]) -> None:
        """Reopen each failed initial job of ``items`` the first time this service acquires it.

        An initial job runs once per cluster, and one that failed is retried at the next start
        of any replica, with a new attempt budget (``released = 'restart'``): its budget counts
        the attempts of one start. A start is a service's first acquire of the job; later
        acquires (its retries) follow the budget.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        started: set[str] = self.__dict__.setdefault("_initial_started", set())
        for options in items:
            if options.type != JobSchedulerType.INITIAL or options.lock_key in started:
                continue
            try:
                await self._rowcount(self._tick_sql.reopen_initial, (options.lock_key,))
            except psycopg.Error as exc:
                raise self._wrap(exc) from exc
            started.add(options.lock_key)

    async def record_skipped(self, options: JobAcquireOptions, reason: str) -> bool:
        """Record a tick as skipped (``FAIL``, 0 attempts) if it has no row; ``True`` if written.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        params = (
            *identity_params(options, random_uuid()),
            dump_json_object({"skipped": reason}),
        )
        try:
            return await self._rowcount(self._tick_sql.record_skipped, params) == 1
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc

    async def first_seen(self, code: str) -> datetime | None:
        """Return when the oldest row of ``code`` was created, if any.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        try:
            row = await self._fetch(self._tick_sql.first_seen, (code,))
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc
        return None if row is None else row[0]

    async def tick_records(self, lock_keys: Sequence[str]) -> dict[str, TickRecord]:
        """Return what the table says about each tick that has a row, by ``lock_key``.

        Raises:
            ValueError: As for :meth:`statuses` (the same check, before any SQL).
            JobSchedulerUnavailableError: The database could not be reached.
        """
        keys = _check_lock_keys(lock_keys)
        if not keys:
            return {}
        rows = await self._fetch_all(self._tick_sql.tick_records, (keys,))
        return {
            key: TickRecord(
                status=STATUS[status],
                attempts=attempts,
                skipped=skipped,
                released=bool(released),
                age_ms=float(age),
                given_back=bool(returned),
                given_back_reason=reason if returned else None,
            )
            for key, status, attempts, skipped, released, age, returned, reason in rows
        }
