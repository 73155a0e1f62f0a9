"""The scheduler's tick operations (attempt budget, skipped ticks, tick records, first row), run
against PostgreSQL and the in-memory store alike (the same contract)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sdcore.job_scheduler import (
    BaseJobScheduler,
    JobAcquireOptions,
    JobSchedulerService,
    JobSchedulerStatus,
)
from sdcore.job_scheduler._attempts import AttemptBudget
from sdcore.scheduling._catch_up import settled
from sdcore.testing import MemoryJobScheduler


@pytest.fixture(params=["postgres", "memory"])
def store(request: pytest.FixtureRequest) -> BaseJobScheduler:
    if request.param == "memory":
        return MemoryJobScheduler()
    service: JobSchedulerService = request.getfixturevalue("jobs")
    return service


def _tick(run_key: str = "2026-07-20T03:00:00Z", **extra: Any) -> JobAcquireOptions:
    return JobAcquireOptions(code="report", run_key=run_key, **extra)


async def _fail_attempt(store: BaseJobScheduler, budget: AttemptBudget) -> int:
    ticked = await store.acquire_attempt(_tick(), budget)
    got = ticked.result
    assert got.acquired
    assert await store.fail(got.lease, {"error": "boom"})
    return ticked.attempt


async def test_retries_zero_makes_fail_final_for_ticks_but_not_for_the_plain_lease(
    store: BaseJobScheduler,
) -> None:
    budget = AttemptBudget(max_attempts=1, backoff_ms=1)
    assert await _fail_attempt(store, budget) == 1
    await asyncio.sleep(0.05)
    again, attempt = await store.acquire_attempt(_tick(), budget)
    assert (again.acquired, attempt) == (False, 0)
    # The plain lease API has no attempt budget: a FAIL row is taken at once.
    plain = await store.acquire(_tick())
    assert plain.acquired


async def test_budget_and_doubling_backoff_by_the_database_clock(store: BaseJobScheduler) -> None:
    budget = AttemptBudget(max_attempts=3, backoff_ms=300)
    assert await _fail_attempt(store, budget) == 1
    early, _ = await store.acquire_attempt(_tick(), budget)
    assert not early.acquired, "taken before its backoff"
    await asyncio.sleep(0.35)
    assert await _fail_attempt(store, budget) == 2
    await asyncio.sleep(0.35)  # the second backoff is 600 ms
    early, _ = await store.acquire_attempt(_tick(), budget)
    assert not early.acquired, "the backoff did not double"
    await asyncio.sleep(0.35)
    assert await _fail_attempt(store, budget) == 3
    await asyncio.sleep(1.3)
    done, _ = await store.acquire_attempt(_tick(), budget)
    assert not done.acquired, "a fourth run with max_attempts=3"
    key = _tick().lock_key
    record = (await store.tick_records([key]))[key]
    assert (record.status, record.attempts, record.released) == (JobSchedulerStatus.FAIL, 3, False)


async def test_release_reopens_an_exhausted_tick(store: BaseJobScheduler) -> None:
    budget = AttemptBudget(max_attempts=1, backoff_ms=1)
    got, _ = await store.acquire_attempt(_tick(), budget)
    assert got.acquired
    assert await store.release(got.lease)
    key = _tick().lock_key
    assert (await store.tick_records([key]))[key].released
    again, attempt = await store.acquire_attempt(_tick(), budget)
    assert (again.acquired, attempt) == (True, 1)


async def test_an_abandoned_attempt_is_taken_over_whatever_the_budget(
    store: BaseJobScheduler,
) -> None:
    budget = AttemptBudget(max_attempts=1, backoff_ms=1)
    options = _tick(lease_ms=200)
    first, _ = await store.acquire_attempt(options, budget)
    assert first.acquired
    live, _ = await store.acquire_attempt(options, budget)
    assert not live.acquired
    await asyncio.sleep(0.3)
    taken, attempt = await store.acquire_attempt(options, budget)
    assert (taken.acquired, attempt) == (True, 2)
    assert taken.acquired
    assert first.acquired
    assert taken.fencing_token > first.fencing_token  # from the table's sequence


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
async def test_a_run_given_back_unstarted_keeps_its_attempt_for_the_next_taker(
    store: BaseJobScheduler, batch: bool
) -> None:
    # An acquire that won a tick but will not run it (its answer came too late to keep the
    # lease, or its caller was cancelled) gives it back. With retries=0 the tick must still run
    # once: any replica takes it at once with the same attempt number, and catch-up does not
    # count it settled. (A plain FAIL instead would exhaust the budget: a lost tick.)
    budget = AttemptBudget(max_attempts=1, backoff_ms=60_000)
    key = _tick().lock_key
    got, attempt = await store.acquire_attempt(_tick(), budget)
    assert (got.acquired, attempt) == (True, 1)
    assert got.acquired
    assert await store.give_back(got.lease, "acquire answered too late")
    record = (await store.tick_records([key]))[key]
    assert (record.status, record.attempts, record.given_back) == (
        JobSchedulerStatus.FAIL,
        1,
        True,
    )
    assert not record.released
    assert not settled(record)
    if batch:
        [(taken, attempt)] = await store.acquire_attempts([(_tick(), budget)])
    else:
        taken, attempt = await store.acquire_attempt(_tick(), budget)
    assert (taken.acquired, attempt) == (True, 1)
    assert taken.acquired
    assert taken.fencing_token > got.fencing_token
    record = (await store.tick_records([key]))[key]
    assert (record.status, record.given_back) == (JobSchedulerStatus.RUNNING, False)
    # Once it has run and failed, the budget holds as for any other tick.
    assert await store.fail(taken.lease, {"error": "boom"})
    again, _ = await store.acquire_attempt(_tick(), budget)
    assert not again.acquired
    assert settled((await store.tick_records([key]))[key])


async def test_a_takeover_given_back_unstarted_stays_a_takeover(store: BaseJobScheduler) -> None:
    # The dead owner's attempt 1 is taken over as attempt 2 (whatever the budget); if that
    # takeover is given back unstarted, the next taker still re-runs it as attempt 2.
    budget = AttemptBudget(max_attempts=1, backoff_ms=60_000)
    options = _tick(lease_ms=200)
    first, _ = await store.acquire_attempt(options, budget)
    assert first.acquired
    await asyncio.sleep(0.3)
    taken, attempt = await store.acquire_attempt(options, budget)
    assert (taken.acquired, attempt) == (True, 2)
    assert taken.acquired
    assert await store.give_back(taken.lease, "cancelled")
    again, attempt = await store.acquire_attempt(options, budget)
    assert (again.acquired, attempt) == (True, 2)


async def test_skipped_ticks_are_recorded_once_and_stay_takeable(store: BaseJobScheduler) -> None:
    key = _tick().lock_key
    assert await store.record_skipped(_tick(), "overlap")
    assert not await store.record_skipped(_tick(), "overlap")
    record = (await store.tick_records([key]))[key]
    assert (record.status, record.attempts, record.skipped) == (
        JobSchedulerStatus.FAIL,
        0,
        "overlap",
    )
    taken, attempt = await store.acquire_attempt(
        _tick(), AttemptBudget(max_attempts=1, backoff_ms=1)
    )
    assert (taken.acquired, attempt) == (True, 1)
    # A tick that already has a row is never overwritten by a skip record.
    other = _tick("2026-07-20T04:00:00Z")
    got = await store.acquire(other)
    assert got.acquired
    assert not await store.record_skipped(other, "overlap")
    assert (await store.statuses([other.lock_key]))[other.lock_key] is JobSchedulerStatus.RUNNING


async def test_first_seen_is_the_oldest_row_of_the_code(store: BaseJobScheduler) -> None:
    assert await store.first_seen("report") is None
    got = await store.acquire(_tick())
    assert got.acquired
    first = await store.first_seen("report")
    assert first is not None
    assert first == got.row.created_at
    assert await store.first_seen("other") is None


def test_budget_is_range_checked() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        AttemptBudget(max_attempts=0, backoff_ms=1)
    with pytest.raises(TypeError, match="backoff_ms"):
        AttemptBudget(max_attempts=1, backoff_ms=1.5)  # type: ignore[arg-type]
