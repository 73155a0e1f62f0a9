"""run_exclusive under faults, with the in-memory backend and injected failures (no sockets)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Mapping
from typing import Any

import pytest

from sdcore._internal.threads import PLAIN_CALLS
from sdcore.job_scheduler import (
    JobExecutionLease,
    JobLease,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
    LostJobLeaseError,
)
from sdcore.testing import MemoryJobScheduler
from tests.unit._looptime import in_loop_time


class Flaky(MemoryJobScheduler):
    """Heartbeats and finalizes that fail or stall on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.heartbeat_failures = 0
        self.heartbeats = 0
        self.complete_failures = 0
        self.complete_delay = 0.0

    async def heartbeat(self, lease: JobLease) -> bool:
        self.heartbeats += 1
        if self.heartbeat_failures:
            self.heartbeat_failures -= 1
            raise JobSchedulerUnavailableError("injected: database unreachable")
        return await super().heartbeat(lease)

    async def complete(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        if self.complete_failures:
            self.complete_failures -= 1
            raise JobSchedulerUnavailableError("injected: connection lost")
        await asyncio.sleep(self.complete_delay)
        return await super().complete(lease, data)


def _status(service: MemoryJobScheduler) -> JobSchedulerStatus:
    (row,) = service.rows()
    return row.status


@in_loop_time
async def test_transient_heartbeat_errors_are_logged_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = Flaky()
    service.heartbeat_failures = 2

    async def work(lease: JobExecutionLease) -> str:
        await asyncio.sleep(0.5)
        return "ok"

    with caplog.at_level(logging.WARNING, logger="sdcore.job_scheduler"):
        outcome = await service.run_exclusive(
            {"code": "c", "run_key": "r", "lease_ms": 2000, "heartbeat_ms": 50}, work
        )
    assert outcome.result == "ok"
    assert service.heartbeats >= 3
    assert _status(service) is JobSchedulerStatus.SUCCESS
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("heartbeat_error") == 2
    assert all("owner_token" not in r.getMessage() for r in caplog.records)


async def test_database_unreachable_longer_than_the_lease_counts_as_lost() -> None:
    service = Flaky()
    service.heartbeat_failures = 10**6
    reached_end = False

    async def work(lease: JobExecutionLease) -> None:
        nonlocal reached_end
        await asyncio.sleep(5)
        reached_end = True

    with pytest.raises(LostJobLeaseError, match="unreachable"):
        await asyncio.wait_for(
            service.run_exclusive(
                {"code": "c", "run_key": "r", "lease_ms": 300, "heartbeat_ms": 50}, work
            ),
            5,
        )
    assert not reached_end


@in_loop_time
async def test_finalize_is_retried_while_the_lease_may_still_hold() -> None:
    service = Flaky()
    service.complete_failures = 3
    outcome = await service.run_exclusive(
        {"code": "c", "run_key": "r", "lease_ms": 5000}, lambda lease: 7
    )
    assert outcome.result == 7
    assert _status(service) is JobSchedulerStatus.SUCCESS


@in_loop_time
async def test_finalize_that_cannot_be_recorded_before_expiry_is_a_loss() -> None:
    service = Flaky()
    service.complete_failures = 10**6
    with pytest.raises(LostJobLeaseError, match="could not be recorded"):
        await service.run_exclusive({"code": "c", "run_key": "r", "lease_ms": 300}, lambda lease: 7)
    assert _status(service) is JobSchedulerStatus.RUNNING  # it will expire; never a false SUCCESS


@in_loop_time
async def test_finalize_survives_repeated_cancellation() -> None:
    service = Flaky()
    service.complete_delay = 0.3
    finished = asyncio.Event()

    async def work(lease: JobExecutionLease) -> str:
        finished.set()
        return "ok"

    task = asyncio.create_task(service.run_exclusive({"code": "c", "run_key": "r"}, work))
    await finished.wait()
    await asyncio.sleep(0.05)  # now inside the slow complete
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The work finished and its outcome was recorded despite two cancellations.
    assert _status(service) is JobSchedulerStatus.SUCCESS


@in_loop_time
async def test_heartbeat_interval_follows_the_options() -> None:
    service = Flaky()

    async def work(lease: JobExecutionLease) -> None:
        await asyncio.sleep(0.55)

    await service.run_exclusive(
        {"code": "c", "run_key": "r", "lease_ms": 1000, "heartbeat_ms": 100}, work
    )
    assert 3 <= service.heartbeats <= 6


@in_loop_time
async def test_a_run_shorter_than_the_heartbeat_interval_has_no_heartbeat_task() -> None:
    """The heartbeat task starts only when the first heartbeat is due (a burst's ticks end
    before that); a longer run gets it at that moment, an interval after the acquire."""
    service = Flaky()
    seen: list[set[str]] = []

    def heartbeat_tasks() -> set[str]:
        return {
            t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("sdcore-heartbeat")
        }

    async def short(lease: JobExecutionLease) -> None:
        await asyncio.sleep(0.09)
        seen.append(heartbeat_tasks())

    async def long(lease: JobExecutionLease) -> None:
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(0.09)
        seen.append(heartbeat_tasks())
        await asyncio.sleep(0.02)
        seen.append(heartbeat_tasks())
        await asyncio.sleep(0.2)
        assert asyncio.get_running_loop().time() - started >= 0.3

    options = {"code": "c", "lease_ms": 1000, "heartbeat_ms": 100}
    await service.run_exclusive({**options, "run_key": "short"}, short)
    assert service.heartbeats == 0
    await service.run_exclusive({**options, "run_key": "long"}, long)
    assert seen == [set(), set(), {"sdcore-heartbeat:c"}]
    assert 2 <= service.heartbeats <= 4
    assert not heartbeat_tasks()  # stopped with the run


@in_loop_time
async def test_heartbeat_zero_disables_it() -> None:
    service = Flaky()

    async def work(lease: JobExecutionLease) -> None:
        await asyncio.sleep(0.2)

    await service.run_exclusive(
        {"code": "c", "run_key": "r", "lease_ms": 400, "heartbeat_ms": 0}, work
    )
    assert service.heartbeats == 0


async def test_without_heartbeat_the_lease_is_the_longest_run() -> None:
    # No heartbeat renews the lease: once it runs out on the client another replica may take the
    # run, so the callable is cancelled at the client deadline instead of running on.
    service = Flaky()
    reached_end = False

    async def work(lease: JobExecutionLease) -> None:
        nonlocal reached_end
        await asyncio.sleep(2)
        reached_end = True

    with pytest.raises(LostJobLeaseError, match="ran out on the client"):
        await asyncio.wait_for(
            service.run_exclusive(
                {"code": "c", "run_key": "r", "lease_ms": 200, "heartbeat_ms": 0}, work
            ),
            5,
        )
    assert not reached_end
    assert service.heartbeats == 0
    assert _status(service) is JobSchedulerStatus.FAIL


async def test_blocked_event_loop_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    service = Flaky()

    async def work(lease: JobExecutionLease) -> None:
        await asyncio.sleep(0.06)
        import time

        time.sleep(0.4)  # a blocking call inside async code (AS-01)
        await asyncio.sleep(0.06)

    with caplog.at_level(logging.WARNING, logger="sdcore.job_scheduler"):
        await service.run_exclusive(
            {"code": "c", "run_key": "r", "lease_ms": 3000, "heartbeat_ms": 100}, work
        )
    assert any(getattr(r, "action", None) == "heartbeat_late" for r in caplog.records)


async def test_fn_must_be_callable() -> None:
    service = MemoryJobScheduler()
    with pytest.raises(TypeError, match="callable"):
        await service.run_exclusive({"code": "c", "run_key": "r"}, "not callable")  # type: ignore[call-overload]
    assert service.rows() == []


async def test_fencing_tokens_grow_across_re_creation_in_memory() -> None:
    service = MemoryJobScheduler()
    options = {"code": "c", "run_key": "r", "lease_ms": 60_000}
    first = await service.acquire(options)
    assert first.acquired
    assert await service.complete(first.lease)
    assert service.forget(first.id)
    again = await service.acquire(options)
    assert again.acquired
    assert again.fencing_token > first.fencing_token


async def test_the_lease_carries_its_client_deadline_in_memory() -> None:
    service = MemoryJobScheduler()
    won = await service.acquire({"code": "c", "run_key": "r", "lease_ms": 1_000})
    assert won.acquired
    lease = won.lease
    assert 0.9 < lease.time_left <= 0.98
    await asyncio.sleep(0.05)
    assert await service.heartbeat(lease)
    assert lease.time_left > 0.95
    assert won.lease.deadline == lease.deadline
    # A lease built by hand knows no deadline and never runs out on the client.
    manual = JobExecutionLease(
        id=lease.id, owner_token=lease.owner_token, idempotency_key="k", fencing_token=1
    )
    assert manual.time_left == float("inf")
    assert manual.is_held


async def test_a_plain_function_cancelled_while_it_waits_for_a_thread_never_starts() -> None:
    # A full pool (one thread, busy): the run is cancelled (a stop) while its function waits
    # for the thread; once the thread frees, the function must not start on the lost lease.
    service = MemoryJobScheduler()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    busy = threading.Event()
    pool.submit(busy.wait, 10)
    started: list[JobExecutionLease] = []

    def work(lease: JobExecutionLease) -> None:
        started.append(lease)

    token = PLAIN_CALLS.set(pool)
    try:
        run = asyncio.ensure_future(service.run_exclusive({"code": "queued", "run_key": "1"}, work))
    finally:
        PLAIN_CALLS.reset(token)
    for _ in range(50):  # until the function is queued behind the busy thread
        await asyncio.sleep(0.01)
    run.cancel()
    for _ in range(5):  # the task takes its cancellation (marks the lease lost) first
        await asyncio.sleep(0)
    busy.set()
    with pytest.raises(asyncio.CancelledError):
        await run
    pool.shutdown(wait=True)
    assert started == []
    assert _status(service) is JobSchedulerStatus.FAIL
