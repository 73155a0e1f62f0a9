"""Reopen marks (released, given back) are lease state of their own, never the caller's data;
a skip record never costs a free replica its tick; failed initial jobs get a budget per start.
Run against the in-memory backend and real PostgreSQL alike."""

from __future__ import annotations

from typing import Any

import pytest

from sdcore.job_scheduler import AttemptBudget, JobAcquireOptions, JobSchedulerStatus
from sdcore.scheduling._catch_up import settled
from tests.contract._lease import Backend

# Every key named like a reopen mark, and the skip reason, at once: the caller's data only.
PAYLOAD: dict[str, Any] = {
    "released": True,
    "released_by": "operator",
    "given_back": "acquire answered too late",
    "skipped": "overlap",
}
BUDGET = AttemptBudget(max_attempts=1, backoff_ms=60_000)


def _tick(**extra: Any) -> JobAcquireOptions:
    return JobAcquireOptions(code="report", run_key="2026-07-20T03:00:00Z", **extra)


@pytest.mark.parametrize("outcome", ["fail", "complete"])
async def test_a_payload_never_reopens_a_tick(backend: Backend, outcome: str) -> None:
    jobs = backend.service
    key = _tick().lock_key
    got, attempt = await jobs.acquire_attempt(_tick(), BUDGET)
    assert (got.acquired, attempt) == (True, 1)
    assert got.acquired
    finish = jobs.fail if outcome == "fail" else jobs.complete
    assert await finish(got.lease, PAYLOAD)
    assert (await backend.read(got.id))["data"] == PAYLOAD  # stored as given
    record = (await jobs.tick_records([key]))[key]
    assert (record.attempts, record.released, record.given_back, record.skipped) == (
        1,
        False,
        False,
        None,
    )
    assert settled(record)
    # The budget (one attempt) is spent: nobody retakes the tick, however often asked.
    for _ in range(2):
        again, number = await jobs.acquire_attempt(_tick(), BUDGET)
        assert (again.acquired, number) == (False, 0)
    [(batched, number)] = await jobs.acquire_attempts([(_tick(), BUDGET)])
    assert (batched.acquired, number) == (False, 0)


async def test_give_back_is_taken_at_once_with_the_same_attempt(backend: Backend) -> None:
    jobs = backend.service
    key = _tick().lock_key
    got, _ = await jobs.acquire_attempt(_tick(), BUDGET)
    assert got.acquired
    assert await jobs.give_back(got.lease, "cancelled")
    record = (await jobs.tick_records([key]))[key]
    assert (record.status, record.attempts, record.given_back, record.given_back_reason) == (
        JobSchedulerStatus.FAIL,
        1,
        True,
        "cancelled",
    )
    assert not settled(record)
    taken, attempt = await jobs.acquire_attempt(_tick(), BUDGET)
    assert (taken.acquired, attempt) == (True, 1)
    record = (await jobs.tick_records([key]))[key]
    assert (record.given_back, record.given_back_reason) == (False, None)  # cleared by takeover
    # The plain fail that follows is an ordinary failure again.
    assert taken.acquired
    assert await jobs.fail(taken.lease, {"given_back": "not really"})
    assert not (await jobs.acquire_attempt(_tick(), BUDGET))[0].acquired


async def test_release_starts_a_new_budget_and_keeps_the_callers_data(backend: Backend) -> None:
    jobs = backend.service
    got, _ = await jobs.acquire_attempt(_tick(), BUDGET)
    assert got.acquired
    assert await jobs.release(got.lease, {"note": "shutting down"})
    assert (await backend.read(got.id))["data"] == {"note": "shutting down"}
    assert (await jobs.tick_records([_tick().lock_key]))[_tick().lock_key].released
    taken, attempt = await jobs.acquire_attempt(_tick(), BUDGET)
    assert (taken.acquired, attempt) == (True, 1)


async def test_give_back_needs_a_reason(backend: Backend) -> None:
    got, _ = await backend.service.acquire_attempt(_tick(), BUDGET)
    assert got.acquired
    with pytest.raises(ValueError, match="reason"):
        await backend.service.give_back(got.lease, "")


async def test_first_seen_many_answers_first_seen_of_each_code_with_a_row(backend: Backend) -> None:
    """One call for many schedules: each code with a row maps to its oldest row's creation,
    as ``first_seen`` says; codes without a row and repeats are left out or merged."""
    jobs = backend.service
    for code, keys in {"a": 3, "b": 1}.items():
        for i in range(keys):
            got = await jobs.acquire(
                JobAcquireOptions(code=code, run_key=f"2026-07-20T03:00:0{i}Z")
            )
            assert got.acquired
            assert await jobs.complete(got.lease)
    many = await jobs.first_seen_many(["a", "b", "never", "a"])
    assert many == {"a": await jobs.first_seen("a"), "b": await jobs.first_seen("b")}
    assert None not in many.values()
    assert await jobs.first_seen_many([]) == {}
    with pytest.raises(ValueError, match="codes must be a sequence of str"):
        await jobs.first_seen_many("a")
    with pytest.raises(ValueError, match="at most 10000 codes per call"):
        await jobs.first_seen_many([f"c{i}" for i in range(10_001)])
    with pytest.raises(ValueError, match="codes must not contain NUL"):
        await jobs.first_seen_many(["a\x00"])
