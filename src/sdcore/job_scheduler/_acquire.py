"""The PostgreSQL lease's acquires: ``acquire``, ``acquire_many``, ``acquire_attempt`` and
``acquire_attempts``, one path for the four.

Each call sends one statement: ``acquire`` or ``acquire_many`` (``lease.sql``),
``acquire_attempt`` (``lease_ticks.sql``) or ``acquire_attempt_many`` (``ticks.sql``; the
scheduler's batch start sends it the ticks due in one turn of its event loop, see
:mod:`sdcore.scheduling._batch`). A batch locks rows and inserts keys in key order, so replicas
racing over overlapping keys never deadlock. Around the statement, the same client-side rules:

- each lease is valid on the client from the moment its statement was sent, for its own
  ``lease_ms`` less the clock margin; a won lease whose answer used more than half of that is
  confirmed with a heartbeat before it is reported (reported not acquired, and given back, if
  that fails);
- the statement is abandoned, and every key reported not acquired, if it does not answer within
  the shortest lease of the call (a row it wrote expires with its lease);
- a broken connection (an ambiguous commit): the rows that show our tokens are ours; a plain
  acquire sends the keys they do not show once more (nothing of ours committed there), a tick's
  are reported not acquired (the scheduler's retry offers and catch-up take them);
- a tick key whose insert met a row committed after the statement's snapshot is sent once more
  in a second statement: that row may be a busy replica's skip record, which this replica takes
  over and runs (``conflicted`` in ``ticks.sql``);
- a caller cancelled meanwhile, also during the recovery of a broken connection, gives back
  (``FAIL``, ``given_back``) every row its tokens turned out to win before the cancellation
  propagates: a cancelled acquire never leaves a ``RUNNING`` row with no owner.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import Any, cast

import psycopg

from sdcore._internal.identifiers import random_uuid, random_uuids
from sdcore._json import dump_json_object
from sdcore.job_scheduler._attempts import AttemptBudget, given_back
from sdcore.job_scheduler._core import RUNNING, LeaseEngine
from sdcore.job_scheduler._model import (
    JobAcquired,
    JobAcquireResult,
    JobLease,
    JobNotAcquired,
    JobScheduler,
    JobSchedulerError,
    JobSchedulerStatus,
    JobSchedulerType,
    _acquired,
    _check_lease,
    _LeaseState,
)
from sdcore.job_scheduler._options import JobAcquireOptions
from sdcore.job_scheduler._run import SLACK
from sdcore.job_scheduler._sql import identity_params, many_params, ticks_params
from sdcore.job_scheduler._watchdog import _Abandoned
from sdcore.postgres import redact_text

MAX_ITEMS = 10_000
NOT_ACQUIRED = JobNotAcquired()
Item = tuple[JobAcquireOptions, AttemptBudget | None]  # no budget: a plain acquire
Result = tuple[JobAcquireResult, int]  # and the row's attempt number (0: none)
# Won keys: lock key -> ((id, fencing_token, idempotency_key, created_at, modified_at
# [, attempts]), when the statement that won it was sent).
Hits = dict[str, tuple[tuple[Any, ...], float]]
_LOST: Result = (NOT_ACQUIRED, 0)

# Clean-ups of cancelled acquires still running after their caller stopped waiting.
_SETTLING: set[asyncio.Future[None]] = set()


async def settle(cleanup: Awaitable[None]) -> None:
    """Run a cancelled caller's clean-up (bounded by its own limits) to its end.

    It is shielded: a second cancellation of the caller stops the wait, never the clean-up,
    which then finishes in the background (a won row is still given back).
    """
    task = asyncio.ensure_future(cleanup)
    _SETTLING.add(task)
    task.add_done_callback(_SETTLING.discard)
    await asyncio.shield(task)


def won(opts: JobAcquireOptions, token: str, r: tuple[Any, ...], state: _LeaseState) -> JobAcquired:
    """The lease won by ``opts`` with owner ``token``, from what the acquire returned.

    ``r`` is ``(id, fencing_token, idempotency_key, created_at, modified_at)``: the rest of the
    row is what the caller sent (lease.sql says why).
    """
    return _acquired(
        JobScheduler(
            id=r[0],
            lock_key=opts.lock_key,
            idempotency_key=r[2],
            code=opts.code,
            name=opts.name,
            type=opts.type,  # type: ignore[arg-type]  # a JobSchedulerType after validation
            run_key=opts.run_key,
            status=JobSchedulerStatus.RUNNING,
            owner_token=token,
            fencing_token=r[1],
            data=None,
            created_at=r[3],
            modified_at=r[4],
            lease_ms=opts.lease_ms,
        ),
        state,
    )


def check_ticks(items: Sequence[tuple[JobAcquireOptions, AttemptBudget]]) -> list[Item]:
    """``acquire_attempts``'s items, checked before any SQL."""
    if not isinstance(items, (list, tuple)):
        raise ValueError("acquire_attempts takes a list or tuple of (options, budget) pairs")
    batch: list[Item] = list(items)
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


def _key(item: Item) -> str:
    return item[0].lock_key


def _shortest(items: list[Item]) -> int:
    """The shortest ``lease_ms`` of ``items``: how long their statement may take."""
    return items[0][0].lease_ms if len(items) == 1 else min(o.lease_ms for o, _ in items)


class Acquirer:
    """The acquires of one ``JobSchedulerService`` (see the module), over its engine."""

    def __init__(self, engine: LeaseEngine) -> None:
        self._engine = engine
        self._log = engine.log
        self._initial_started: set[str] = set()  # initial jobs this service acquired once

    async def one(self, opts: JobAcquireOptions, budget: AttemptBudget | None) -> Result:
        """``acquire`` (no ``budget``) or ``acquire_attempt``: the result and the row's attempt."""
        if budget is not None:
            await self._restart_initial([opts])
        token = random_uuid()
        hit = (await self._won([(opts, budget)], [token], many=False)).get(opts.lock_key)
        if hit is None:
            return _LOST
        row, sent = hit
        state = _LeaseState.for_lease(opts.lease_ms, sent)
        result = await self._confirmed(opts, won(opts, token, row, state))
        if not result.acquired:
            return _LOST
        return result, 0 if budget is None else int(row[5])

    async def many(self, batch: list[Item]) -> list[Result]:
        """``acquire_many`` (no budgets) or ``acquire_attempts``: one result per item, in order."""
        if not batch:
            return []
        if batch[0][1] is not None:
            await self._restart_initial([o for o, _ in batch])
        ordered = sorted(batch, key=_key)
        tokens = random_uuids(len(ordered))
        hits = await self._won(ordered, tokens, many=True)
        token_of = dict(zip((o.lock_key for o, _ in ordered), tokens, strict=True))
        results: list[Result] = []
        late: list[int] = []
        for opts, budget in batch:
            hit = hits.get(opts.lock_key)
            if hit is None:
                results.append(_LOST)
                continue
            row, sent = hit
            state = _LeaseState.for_lease(opts.lease_ms, sent)
            if state.time_left() < state.valid / 2:
                late.append(len(results))
            result = won(opts, token_of[opts.lock_key], row, state)
            results.append((result, 0 if budget is None else int(row[5])))
        if late:
            await self._confirm_many(batch, results, late)
        return results

    async def _won(self, ordered: list[Item], tokens: list[str], *, many: bool) -> Hits:
        """Send the acquire of ``ordered`` (in key order) with our ``tokens``: the keys won."""
        sent = time.monotonic()
        limit = _LeaseState.for_lease(_shortest(ordered), sent).valid
        try:
            hits = await self._send(ordered, tokens, sent, limit, many)
            if many and any(row[0] is None for row, _ in hits.values()):
                hits = await self._conflicted(ordered, tokens, hits)
        except asyncio.CancelledError:
            await settle(self._give_back(ordered, tokens, sent, limit))
            raise
        return hits

    async def _conflicted(self, ordered: list[Item], tokens: list[str], hits: Hits) -> Hits:
        """A row of the keys whose id is ``None`` appeared after the statement's snapshot (their
        inserts met it on the unique index). If it is a skip record of a busy replica, this
        replica must run the tick: one more statement, whose snapshot takes a skip row over
        without waiting."""
        conflicted = {key for key, (row, _) in hits.items() if row[0] is None}
        again = [i for i, (o, _) in enumerate(ordered) if o.lock_key in conflicted]
        items = [ordered[i] for i in again]
        resent = time.monotonic()
        limit = _LeaseState.for_lease(_shortest(items), resent).valid
        retried = await self._send(items, [tokens[i] for i in again], resent, limit, True)
        merged = {key: hit for key, hit in hits.items() if hit[0][0] is not None}
        merged.update((key, hit) for key, hit in retried.items() if hit[0][0] is not None)
        return merged

    def _send(
        self, items: list[Item], tokens: list[str], sent: float, limit: float, many: bool
    ) -> Awaitable[Hits]:
        """One acquire statement, its failures settled by the engine (see ``_core.py``)."""
        return self._engine.statement(
            self._hits(items, tokens, sent, limit, many),
            resolve=lambda: self._owned(items, tokens, sent, limit, many),
            unanswered=lambda: self._abandoned(items),
            lost={},
        )

    async def _hits(
        self, items: list[Item], tokens: list[str], sent: float, limit: float, many: bool
    ) -> Hits:
        """Send the statement for ``items`` (key order): the keys it won, sent at ``sent``."""
        engine = self._engine
        if many:
            options = [o for o, _ in items]
            if items[0][1] is None:
                query, params = engine.sql.acquire_many, many_params(options, tokens)
            else:
                budgets = [cast("AttemptBudget", b) for _, b in items]
                query = engine.batch_sql.acquire_attempt_many
                params = ticks_params(options, budgets, tokens)
            # (lock_key, id, fencing_token, idempotency_key, created_at, modified_at[, attempts])
            return {row[0]: (row[1:], sent) for row in await engine.rows(query, params, limit)}
        opts, budget = items[0]
        params = (*identity_params(opts, tokens[0]), opts.lease_ms)
        if budget is None:
            rows = await engine.rows(engine.sql.acquire, params, limit)
        else:
            params = (*params, budget.max_attempts, budget.backoff_ms)
            rows = await engine.rows(engine.tick_sql.acquire_attempt, params, limit)
        return {opts.lock_key: (rows[0], sent)} if rows else {}

    async def _owned(
        self, items: list[Item], tokens: list[str], sent: float, limit: float, many: bool
    ) -> Hits:
        """After an ambiguous commit: the keys our tokens show ``RUNNING`` are won. A plain
        acquire sends the keys they do not show once more (a fresh attempt, its lease from
        then); a tick's are not acquired."""
        engine = self._engine
        keys = [o.lock_key for o, _ in items]
        ticks = items[0][1] is not None
        query = engine.batch_sql.read_owned_attempts if ticks else engine.sql.read_owned_many
        left = max(sent + limit - time.monotonic(), 0.0)
        # (lock_key, status, id, fencing_token, idempotency_key, created_at, modified_at[, …])
        rows = await engine.rows(query, (keys, tokens), left)
        hits = {row[0]: (row[2:], sent) for row in rows if row[1] == RUNNING}
        # A key our token shows did commit: its row's status is the outcome, never sent again.
        seen = {row[0] for row in rows}
        rest = [i for i, key in enumerate(keys) if key not in seen]
        if ticks or not rest:
            return hits
        again = [items[i] for i in rest]
        retried = await engine.statement(
            self._hits(again, [tokens[i] for i in rest], time.monotonic(), limit, many),
            unanswered=lambda: self._abandoned(items),
            lost={},
        )
        hits.update(retried)
        return hits

    def _abandoned(self, items: list[Item]) -> Hits:
        what = "did not answer within its lease; connection abandoned"
        self._warn(items, what, "statement_abandoned")
        return {}

    async def _give_back(
        self, items: list[Item], tokens: list[str], sent: float, limit: float
    ) -> None:
        """Cancelled mid-acquire: find the keys our tokens won, and give each of them back."""
        keys = [o.lock_key for o, _ in items]
        read = self._engine.sql.read_owned_many
        try:
            left = max(sent + limit - time.monotonic(), 0.0) + SLACK
            rows = await self._engine.rows(read, (keys, tokens), left)
        except (psycopg.Error, _Abandoned) as exc:
            what = "cancelled with an unknown outcome (a row it wrote expires with its lease)"
            self._warn(items, what, "acquire_cancelled_unknown", exc)
            return
        # As long as a row's lease may still hold it: given back, another replica takes the
        # run now instead of when the lease passes.
        left = max(sent + limit - time.monotonic(), 0.0) + SLACK
        index = {key: i for i, key in enumerate(keys)}
        await asyncio.gather(
            *(
                self._fail_quietly(
                    JobLease(id=row[2], owner_token=tokens[index[row[0]]]),
                    items[index[row[0]]][0],
                    "cancelled",
                    left,
                )
                for row in rows
                if row[1] == RUNNING
            )
        )

    async def _confirmed(self, opts: JobAcquireOptions, won: JobAcquired) -> JobAcquireResult:
        """Report ``won`` only with at least half its client lease left; else confirm it."""
        state = won._state
        if state.time_left() >= state.valid / 2:
            return won
        # The round trip used up more than half the lease (a slow commit, a stalled network):
        # the row may be about to expire, or have expired already. A fenced heartbeat renews it
        # from the moment it is sent, or proves it was lost.
        try:
            ok = await self._engine.heartbeat(won.lease)
        except JobSchedulerError:
            ok = False
        except asyncio.CancelledError:
            await self._fail_quietly(won.lease, opts, "cancelled")
            raise
        if ok and state.time_left() >= state.valid / 2:
            return won
        what = "answered too late to keep its lease; not acquired"
        self._warn([(opts, None)], what, "acquire_too_late")
        await self._fail_quietly(won.lease, opts, "acquire answered too late")
        return NOT_ACQUIRED

    async def _confirm_many(
        self, batch: list[Item], results: list[Result], late: list[int]
    ) -> None:
        """Confirm the won leases at ``late`` (see :meth:`_confirmed`), in place."""
        try:
            confirmed = await asyncio.gather(
                *(self._confirmed(batch[i][0], cast("JobAcquired", results[i][0])) for i in late)
            )
        except asyncio.CancelledError:
            # The late ones give themselves back in _confirmed; the others are ours to return.
            await asyncio.gather(
                *(
                    self._fail_quietly(result.lease, batch[i][0], "cancelled")
                    for i, (result, _) in enumerate(results)
                    if result.acquired and i not in late
                ),
                return_exceptions=True,
            )
            raise
        for i, result in zip(late, confirmed, strict=True):
            results[i] = (result, results[i][1]) if result.acquired else _LOST

    async def _fail_quietly(
        self, lease: JobLease, opts: JobAcquireOptions, reason: str, limit: float = SLACK
    ) -> None:
        """Give back a row this acquire owns but will not report, within ``limit``.

        ``FAIL`` with ``given_back = reason`` (a column, never the caller's data): a plain
        ``acquire`` takes a ``FAIL`` row at once, and a scheduled tick's ``acquire_attempt``
        takes a given-back one at once with the same attempt number (the run never started,
        so it must not use up the tick's budget).
        """
        try:
            job_id, token = _check_lease(lease)
            params = (dump_json_object(given_back(reason)), None, reason, job_id, token)
            await self._engine.rowcount(self._engine.sql.reopen, params, limit)
        except (psycopg.Error, _Abandoned) as exc:
            what = "not reported, and not given back (its row expires with its lease)"
            self._warn([(opts, None)], what, "acquire_release_failed", exc)

    async def _restart_initial(self, items: Sequence[JobAcquireOptions]) -> None:
        """Reopen each failed initial job of ``items`` the first time this service acquires it.

        An initial job runs once per cluster, and one that failed is retried at the next start
        of any replica, with a new attempt budget (``released = 'restart'``): its budget counts
        the attempts of one start. A start is a service's first acquire of the job; later
        acquires (its retries) follow the budget.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        engine = self._engine
        for options in items:
            if (
                options.type != JobSchedulerType.INITIAL
                or options.lock_key in self._initial_started
            ):
                continue
            await engine.statement(
                engine.rowcount(engine.tick_sql.reopen_initial, (options.lock_key,))
            )
            self._initial_started.add(options.lock_key)

    def _warn(
        self, items: list[Item], what: str, action: str, exc: BaseException | None = None
    ) -> None:
        """Log a problem of the acquire of ``items`` (its keys are not acquired)."""
        detail = "" if exc is None else f": {redact_text(str(exc))}"
        if len(items) != 1:
            self._log.warning(
                "acquire of %d runs %s%s", len(items), what, detail, extra={"action": action}
            )
            return
        opts = items[0][0]
        self._log.warning(
            "job %r run %r: acquire %s%s",
            opts.code,
            opts.run_key,
            what,
            detail,
            extra={"action": action, "job_code": opts.code, "run_key": opts.run_key},
        )
