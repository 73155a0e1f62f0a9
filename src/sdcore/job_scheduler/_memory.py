"""``MemoryJobScheduler``: the lease port in process memory, the twin of ``JobSchedulerService``.

It follows the same contract as ``JobSchedulerService`` (one contract suite runs against both),
with ``clock`` playing the database clock: expiry is the owner's lease by that clock, fencing
tokens come from one counter per scheduler (as from the table's sequence), and leases carry a
client deadline by the real monotonic clock. Public as ``sdcore.testing.MemoryJobScheduler``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sdcore._json import dump_json_object
from sdcore.job_scheduler._attempts import (
    MAX_BACKOFF_MS,
    AttemptAcquireResult,
    AttemptBudget,
    TickRecord,
)
from sdcore.job_scheduler._base import BaseJobScheduler
from sdcore.job_scheduler._model import (
    JobAcquireResult,
    JobLease,
    JobNotAcquired,
    JobScheduler,
    JobSchedulerStatus,
    JobSchedulerType,
    _acquired,
    _check_lease,
    _check_lock_keys,
    _LeaseState,
)
from sdcore.job_scheduler._options import JobAcquireOptions, coerce_options

__all__ = ["MemoryJobScheduler"]


def _utcnow() -> datetime:
    return datetime.now(UTC)


class MemoryJobScheduler(BaseJobScheduler):
    """The job scheduler contract in process memory, for unit tests.

    Args:
        clock: The "database clock": returns aware datetimes. Defaults to the system clock.
        logger_name: Logger for run and heartbeat events.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], datetime] = _utcnow,
        logger_name: str = "sdcore.job_scheduler",
    ) -> None:
        super().__init__(logger_name=logger_name)
        self._clock = clock
        self._rows: dict[str, JobScheduler] = {}
        self._by_id: dict[str, str] = {}
        self._fencing = 0  # the table's fencing sequence
        # Scheduler attempt budgets (the ``attempts`` column); rows made by plain acquire count 1.
        self._attempts: dict[str, int] = {}
        # The reopen marks (columns ``released`` and ``given_back``), by lock key: never read
        # from a row's data. Every acquire clears them.
        self._released: dict[str, str] = {}
        self._given_back: dict[str, str] = {}
        self._initial_started: set[str] = set()  # initial jobs this "process" acquired

    def _next_fencing_token(self) -> int:
        self._fencing += 1
        return self._fencing

    def forget(self, job_id: str) -> bool:
        """Delete a row, as a prune would (its key may then be created anew).

        Returns:
            Whether a row was deleted.
        """
        key = self._by_id.pop(job_id, None)
        if key is None:
            return False
        del self._rows[key]
        self._attempts.pop(key, None)
        self._released.pop(key, None)
        self._given_back.pop(key, None)
        return True

    def rows(self) -> list[JobScheduler]:
        """Return every row, oldest first."""
        return sorted(self._rows.values(), key=lambda row: row.created_at)

    def get(self, job_id: str) -> JobScheduler | None:
        """Return the row with this id, if any."""
        key = self._by_id.get(job_id)
        return None if key is None else self._rows[key]

    async def acquire(self, options: JobAcquireOptions | Mapping[str, Any]) -> JobAcquireResult:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.acquire`."""
        opts = coerce_options(options)
        state = _LeaseState.for_lease(opts.lease_ms, time.monotonic())
        now = self._clock()
        token = str(uuid.uuid4())
        current = self._rows.get(opts.lock_key)
        if current is None:
            row = JobScheduler(
                id=str(uuid.uuid4()),
                lock_key=opts.lock_key,
                idempotency_key=opts.idempotency_key,
                code=opts.code,
                name=opts.name,
                type=JobSchedulerType(opts.type),
                run_key=opts.run_key,
                status=JobSchedulerStatus.RUNNING,
                owner_token=token,
                fencing_token=self._next_fencing_token(),
                data=None,
                created_at=now,
                modified_at=now,
                lease_ms=opts.lease_ms,
            )
            self._by_id[row.id] = row.lock_key
        else:
            # Expiry is the owner's lease (a row without one falls back to the contender's).
            owner_lease = current.lease_ms if current.lease_ms is not None else opts.lease_ms
            stale = current.status is JobSchedulerStatus.RUNNING and now - current.modified_at > (
                timedelta(milliseconds=owner_lease)
            )
            if not (current.status is JobSchedulerStatus.FAIL or stale):
                return JobNotAcquired()
            row = replace(
                current,
                status=JobSchedulerStatus.RUNNING,
                owner_token=token,
                fencing_token=self._next_fencing_token(),
                name=opts.name,
                data=None,
                modified_at=now,
                lease_ms=opts.lease_ms,
            )
        self._rows[row.lock_key] = row
        self._released.pop(row.lock_key, None)
        self._given_back.pop(row.lock_key, None)
        return _acquired(row, state)

    def attempts(self, lock_key: str) -> int | None:
        """Return the ``attempts`` of the row with this lock key, if any."""
        return self._attempts.get(lock_key, 1) if lock_key in self._rows else None

    async def acquire_attempt(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> AttemptAcquireResult:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.acquire_attempt`."""
        key = options.lock_key
        current = self._rows.get(key)
        fail = current is not None and current.status is JobSchedulerStatus.FAIL
        if options.type == JobSchedulerType.INITIAL and key not in self._initial_started:
            # A new start reopens a failed initial job with a new budget (reopen_initial).
            self._initial_started.add(key)
            if fail and key not in self._released and key not in self._given_back:
                self._released[key] = "restart"
        attempts = self._attempts.get(key, 1)
        released = fail and key in self._released
        returned = fail and key in self._given_back
        if current is not None and fail and not released and not returned:
            waited = self._clock() - current.modified_at
            backoff = (
                0 if attempts == 0 else min(budget.backoff_ms * 2 ** (attempts - 1), MAX_BACKOFF_MS)
            )
            if attempts >= budget.max_attempts or waited < timedelta(milliseconds=backoff):
                return AttemptAcquireResult(result=JobNotAcquired(), attempt=0)
        outcome = await self.acquire(options)
        if not outcome.acquired:
            return AttemptAcquireResult(result=outcome, attempt=0)
        if current is None or released:
            number = 1
        elif fail and returned:
            number = attempts  # given back unstarted: the same attempt, run now
        else:
            number = attempts + 1
        self._attempts[key] = number
        return AttemptAcquireResult(result=outcome, attempt=number)

    async def record_skipped(self, options: JobAcquireOptions, reason: str) -> bool:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.record_skipped`."""
        if options.lock_key in self._rows:
            return False
        outcome = await self.acquire(options)
        assert outcome.acquired  # noqa: S101 - no row, so the insert wins
        key = options.lock_key
        self._rows[key] = replace(
            self._rows[key], status=JobSchedulerStatus.FAIL, data={"skipped": reason}
        )
        self._attempts[key] = 0
        return True

    async def first_seen(self, code: str) -> datetime | None:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.first_seen`."""
        return min(
            (row.created_at for row in self._rows.values() if row.code == code), default=None
        )

    async def first_seen_many(self, codes: Sequence[str]) -> dict[str, datetime]:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.first_seen_many`."""
        wanted = set(_check_lock_keys(codes, "codes"))
        seen: dict[str, datetime] = {}
        for row in self._rows.values():
            if row.code in wanted and (row.code not in seen or row.created_at < seen[row.code]):
                seen[row.code] = row.created_at
        return seen

    async def tick_records(self, lock_keys: Sequence[str]) -> dict[str, TickRecord]:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.tick_records`."""
        records = {}
        for key in _check_lock_keys(lock_keys):
            row = self._rows.get(key)
            if row is None:
                continue
            attempts = self._attempts.get(key, 1)
            # The skip reason only from a skip record (0 attempts, which no finalize writes).
            skipped = None if row.data is None or attempts else row.data.get("skipped")
            fail = row.status is JobSchedulerStatus.FAIL
            reason = self._given_back.get(key) if fail else None
            records[key] = TickRecord(
                status=row.status,
                attempts=attempts,
                skipped=None if skipped is None else str(skipped),
                released=fail and key in self._released,
                age_ms=(self._clock() - row.modified_at) / timedelta(milliseconds=1),
                given_back=reason is not None,
                given_back_reason=reason,
            )
        return records

    def _owned(self, lease: JobLease) -> JobScheduler | None:
        job_id, token = _check_lease(lease)  # the validator PostgreSQL's backend uses
        row = self.get(job_id)
        if row is None or row.owner_token != token or row.status is not JobSchedulerStatus.RUNNING:
            return None
        return row

    async def statuses(self, lock_keys: Sequence[str]) -> dict[str, JobSchedulerStatus]:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.statuses`."""
        keys = _check_lock_keys(lock_keys)
        return {key: self._rows[key].status for key in keys if key in self._rows}

    async def status_of(self, lease: JobLease) -> JobSchedulerStatus | None:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.status_of`."""
        job_id, token = _check_lease(lease)
        row = self.get(job_id)
        if row is None or row.owner_token != token:
            return None
        return row.status

    async def heartbeat(self, lease: JobLease) -> bool:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.heartbeat`."""
        sent = time.monotonic()
        row = self._owned(lease)
        if row is None:
            return False
        self._rows[row.lock_key] = replace(row, modified_at=self._clock())
        state: _LeaseState | None = getattr(lease, "_state", None)
        if state is not None:
            state.confirm(sent)
        return True

    async def complete(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.complete`."""
        return self._finish(lease, JobSchedulerStatus.SUCCESS, data)

    async def fail(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        """See :meth:`sdcore.job_scheduler.JobSchedulerService.fail`."""
        return self._finish(lease, JobSchedulerStatus.FAIL, data)

    async def _reopen(
        self,
        lease: JobLease,
        data: Mapping[str, Any] | None,
        *,
        released: str | None = None,
        given_back: str | None = None,
    ) -> bool:
        """``fail`` with a reopen mark (``reopen`` in lease.sql)."""
        if not self._finish(lease, JobSchedulerStatus.FAIL, data):
            return False
        key = self._by_id[_check_lease(lease)[0]]
        if released is not None:
            self._released[key] = released
        if given_back is not None:
            self._given_back[key] = given_back
        return True

    def _finish(
        self, lease: JobLease, status: JobSchedulerStatus, data: Mapping[str, Any] | None
    ) -> bool:
        _check_lease(lease)  # the lease is checked before the data, as by PostgreSQL's backend
        text = dump_json_object(data)
        row = self._owned(lease)
        if row is None:
            return False
        stored = None if text is None else json.loads(text)
        self._rows[row.lock_key] = replace(
            row, status=status, data=stored, modified_at=self._clock()
        )
        return True
