"""``acquire_many``: many run keys in one statement (``acquire_many`` in ``lease.sql``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import psycopg
from psycopg import errors as pg_errors

from sdcore._internal.identifiers import random_uuids
from sdcore.job_scheduler._core import (
    LOSER_ERRORS,
    NOT_ACQUIRED,
    RUNNING,
    _LeaseCore,
    settle,
    won,
)
from sdcore.job_scheduler._model import JobAcquired, JobAcquireResult, JobLease, _LeaseState
from sdcore.job_scheduler._options import JobAcquireOptions, coerce_batch
from sdcore.job_scheduler._run import SLACK
from sdcore.job_scheduler._watchdog import _Abandoned
from sdcore.postgres import redact_text


def _by_lock_key(opts: JobAcquireOptions) -> str:
    return opts.lock_key


def _many_params(ordered: list[JobAcquireOptions], tokens: list[str]) -> tuple[list[Any], ...]:
    """The column arrays of ``acquire_many`` (items sorted by lock key)."""
    return (
        [o.lock_key for o in ordered],
        [o.idempotency_key for o in ordered],
        [o.code for o in ordered],
        [o.name for o in ordered],
        [str(o.type) for o in ordered],
        [o.run_key for o in ordered],
        tokens,
        [o.lease_ms for o in ordered],
    )


class _BatchOperations(_LeaseCore):
    """``JobSchedulerService.acquire_many`` and how it resolves the unclear outcomes."""

    async def acquire_many(
        self, options: Sequence[JobAcquireOptions | Mapping[str, Any]]
    ) -> list[JobAcquireResult]:
        """``acquire`` for many runs in one statement; one result per item, in the input order.

        Each key follows the rules of :meth:`acquire` and is won by exactly one caller, however
        many replicas race over overlapping sets of keys (the statement locks rows and inserts
        keys in key order, so two batches never deadlock). Every item is validated before any
        SQL. Each lease is valid on the client from the moment the statement was sent, for its
        own ``lease_ms`` less the clock margin; a won lease whose answer used more than half of
        that is confirmed with a heartbeat (as by :meth:`acquire`) before it is reported, and
        reported not acquired if that fails. The statement is abandoned, and every item
        reported not acquired, if it does not answer within the shortest lease of the batch.
        A caller cancelled meanwhile marks the rows it turned out to own ``FAIL`` first.

        Args:
            options: At most 10,000 ``JobAcquireOptions`` or mappings, each a different run.

        Returns:
            ``JobAcquired`` or ``JobNotAcquired`` for each item, in the order given.

        Raises:
            InvalidJobIdentityOptionsError: Not a sequence, too many items, two items for one
                run, or an item with a bad identity (named by its index), before any SQL.
            InvalidJobLeaseOptionsError: An item with bad timing, before any SQL.
            JobSchedulerUnavailableError: The outcome could not be established.
            JobSchedulerDatabaseError: The database refused the statement.
        """
        batch = coerce_batch(options)
        if not batch:
            return []
        ordered = sorted(batch, key=_by_lock_key)
        tokens = random_uuids(len(ordered))
        params = _many_params(ordered, tokens)
        sent = time.monotonic()
        limit = _LeaseState.for_lease(min(o.lease_ms for o in batch), sent).valid
        hits: dict[str, tuple[tuple[Any, ...], float]] = {}
        # A cancellation anywhere, the recovery of a broken connection included, gives back
        # every row our tokens turn out to hold (the recovery re-sends with the same tokens).
        try:
            try:
                rows = await self._fetch_rows(self._sql.acquire_many, params, limit)
            except LOSER_ERRORS:
                rows = []
            except _Abandoned:
                self._log_abandoned_many(len(batch))
                rows = []
            except psycopg.OperationalError as exc:
                if exc.sqlstate and not isinstance(exc, pg_errors.AdminShutdown):
                    raise self._wrap(exc) from exc
                hits = await self._acquire_many_again(ordered, tokens, sent, limit, exc)
                rows = []
            except psycopg.Error as exc:
                raise self._wrap(exc) from exc
        except asyncio.CancelledError:
            await settle(self._resolve_cancelled_many(ordered, tokens, sent, limit))
            raise
        # Rows: (lock_key, id, fencing_token, idempotency_key, created_at, modified_at).
        for row in rows:
            hits[row[0]] = (row[1:], sent)
        token_of = dict(zip((o.lock_key for o in ordered), tokens, strict=True))
        results: list[JobAcquireResult] = []
        late: list[int] = []
        for opts in batch:
            hit = hits.get(opts.lock_key)
            if hit is None:
                results.append(NOT_ACQUIRED)
                continue
            state = _LeaseState.for_lease(opts.lease_ms, hit[1])
            result = won(opts, token_of[opts.lock_key], hit[0], state)
            if result._state.time_left() < result._state.valid / 2:
                late.append(len(results))
            results.append(result)
        if late:
            await self._confirm_many(batch, results, late)
        return results

    async def _confirm_many(
        self, batch: list[JobAcquireOptions], results: list[JobAcquireResult], late: list[int]
    ) -> None:
        """Confirm the won leases at ``late`` (see :meth:`_confirmed`), in place."""
        try:
            confirmed = await asyncio.gather(
                *(self._confirmed(batch[i], cast("JobAcquired", results[i])) for i in late)
            )
        except asyncio.CancelledError:
            # The late ones give themselves back in _confirmed; the others are ours to return.
            await asyncio.gather(
                *(
                    self._fail_quietly(result.lease, batch[i], "cancelled")
                    for i, result in enumerate(results)
                    if result.acquired and i not in late
                ),
                return_exceptions=True,
            )
            raise
        for i, result in zip(late, confirmed, strict=True):
            results[i] = result

    async def _acquire_many_again(
        self,
        ordered: list[JobAcquireOptions],
        tokens: list[str],
        sent: float,
        limit: float,
        first: psycopg.Error,
    ) -> dict[str, tuple[tuple[Any, ...], float]]:
        """The batch's connection broke: keep the keys our tokens show, try the others again."""
        await self._held.reset_idle()
        keys = [o.lock_key for o in ordered]
        hits: dict[str, tuple[tuple[Any, ...], float]] = {}
        try:
            left = max(sent + limit - time.monotonic(), 0.0)
            for row in await self._fetch_rows(self._sql.read_owned_many, (keys, tokens), left):
                # (lock_key, status, id, fencing_token, idempotency_key, created_at, modified_at)
                if row[1] == RUNNING:
                    hits[row[0]] = (row[2:], sent)
            rest = [i for i, key in enumerate(keys) if key not in hits]
            if rest:
                again = [ordered[i] for i in rest]
                params = _many_params(again, [tokens[i] for i in rest])
                resent = time.monotonic()
                for row in await self._fetch_rows(self._sql.acquire_many, params, limit):
                    hits[row[0]] = (row[1:], resent)
        except LOSER_ERRORS:
            pass
        except _Abandoned:
            self._log_abandoned_many(len(ordered))
        except psycopg.Error as exc:
            raise self._wrap(exc) from first
        return hits

    async def _resolve_cancelled_many(
        self, ordered: list[JobAcquireOptions], tokens: list[str], sent: float, limit: float
    ) -> None:
        """Cancelled mid-batch: find the keys we won, and give each of them back."""
        keys = [o.lock_key for o in ordered]
        left = max(sent + limit - time.monotonic(), 0.0) + SLACK
        try:
            rows = await self._fetch_rows(self._sql.read_owned_many, (keys, tokens), left)
        except (psycopg.Error, _Abandoned) as exc:
            self._log.warning(
                "acquire_many of %d runs cancelled with an unknown outcome (rows it wrote "
                "expire with their leases): %s",
                len(keys),
                redact_text(str(exc)),
                extra={"action": "acquire_cancelled_unknown"},
            )
            return
        index = {o.lock_key: i for i, o in enumerate(ordered)}
        await asyncio.gather(
            *(
                self._fail_quietly(
                    JobLease(id=row[2], owner_token=tokens[index[row[0]]]),
                    ordered[index[row[0]]],
                    "cancelled",
                )
                for row in rows
                if row[1] == RUNNING
            )
        )

    def _log_abandoned_many(self, count: int) -> None:
        self._log.warning(
            "acquire_many of %d runs did not answer within the shortest lease; connection "
            "abandoned",
            count,
            extra={"action": "statement_abandoned"},
        )
