"""The job scheduler contract, run against the in-memory backend and real PostgreSQL alike."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest

from sdcore.job_scheduler import (
    JobAcquired,
    JobAcquireOptions,
    JobExecutionLease,
    JobLease,
    JobSchedulerStatus,
    JobSchedulerType,
    JsonTypeError,
    JsonValueError,
    LostJobLeaseError,
)
from tests.contract._lease import Backend, _acquire, _opts


async def test_first_acquire_inserts_a_running_row(backend: Backend) -> None:
    options = _opts(name="Sync orders")
    result = await backend.service.acquire(options)
    assert isinstance(result, JobAcquired)
    assert result.fencing_token == backend.base + 1
    assert result.idempotency_key == options.idempotency_key
    assert uuid.UUID(result.owner_token).version == 4
    assert result.row.status is JobSchedulerStatus.RUNNING
    assert result.row.lock_key == options.lock_key
    assert result.row.type is JobSchedulerType.SCHEDULE
    assert result.row.name == "Sync orders"
    assert result.row.created_at.tzinfo is not None
    assert result.owner_token not in repr(result)
    assert result.owner_token not in repr(result.row)
    assert result.owner_token not in repr(result.lease)


async def test_a_second_contender_gets_not_acquired_with_nothing_else(backend: Backend) -> None:
    await _acquire(backend)
    loser = await backend.service.acquire(_opts())
    assert loser.acquired is False
    for attribute in ("row", "id", "owner_token", "idempotency_key", "fencing_token"):
        assert not hasattr(loser, attribute)
    assert await backend.count() == 1


async def test_heartbeat_only_for_the_current_running_owner(backend: Backend) -> None:
    won = await _acquire(backend)
    assert await backend.service.heartbeat(won.lease)
    stranger = JobLease(id=won.id, owner_token=str(uuid.uuid4()))
    assert not await backend.service.heartbeat(stranger)
    assert not await backend.service.heartbeat(
        JobLease(id=str(uuid.uuid4()), owner_token=won.owner_token)
    )


async def test_complete_records_success_and_data_once(backend: Backend) -> None:
    won = await _acquire(backend)
    assert await backend.service.complete(won.lease, {"rows": 42, "note": "ok"})
    row = await backend.read(won.id)
    assert row["status"] == "SUCCESS"
    assert row["data"] == {"rows": 42, "note": "ok"}
    assert not await backend.service.complete(won.lease)
    assert not await backend.service.heartbeat(won.lease)
    assert not await backend.service.fail(won.lease)


async def test_finalize_soon_records_the_outcome_it_names(backend: Backend) -> None:
    """``finalize_soon`` is ``complete`` for SUCCESS and ``fail`` for FAIL, on every backend."""
    won = await _acquire(backend)
    with pytest.raises(ValueError, match="SUCCESS or FAIL"):
        backend.service.finalize_soon(won.lease, JobSchedulerStatus.RUNNING)
    assert (await backend.read(won.id))["status"] == "RUNNING"
    assert await backend.service.finalize_soon(won.lease, JobSchedulerStatus.FAIL, {"e": 1})
    row = await backend.read(won.id)
    assert (row["status"], row["data"]) == ("FAIL", {"e": 1})
    again = await _acquire(backend)  # takes the FAIL row over: the first lease is fenced out
    assert await backend.service.finalize_soon(again.lease, JobSchedulerStatus.SUCCESS)
    assert (await backend.read(again.id))["status"] == "SUCCESS"
    assert not await backend.service.finalize_soon(won.lease, JobSchedulerStatus.SUCCESS)


async def test_success_is_never_taken_over(backend: Backend) -> None:
    won = await _acquire(backend, lease_ms=1000)
    assert await backend.service.complete(won.lease)
    await backend.age(won.id, 10**9)
    assert not (await backend.service.acquire(_opts(lease_ms=3))).acquired
    assert (await backend.read(won.id))["status"] == "SUCCESS"


async def test_fail_row_is_taken_over_at_once_with_rotated_tokens(backend: Backend) -> None:
    first = await _acquire(backend)
    assert await backend.service.fail(first.lease, {"error": "boom"})
    second = await _acquire(backend)
    assert second.id == first.id
    assert second.owner_token != first.owner_token
    assert second.fencing_token == first.fencing_token + 1 == backend.base + 2
    assert second.idempotency_key == first.idempotency_key
    row = await backend.read(second.id)
    assert row["data"] is None
    assert row["status"] == "RUNNING"
    # Every call with the old token is refused, and changes nothing.
    assert not await backend.service.heartbeat(first.lease)
    assert not await backend.service.complete(first.lease, {"zombie": True})
    assert not await backend.service.fail(first.lease)
    assert not await backend.service.release(first.lease)
    row = await backend.read(second.id)
    assert (row["status"], row["owner_token"], row["data"]) == ("RUNNING", second.owner_token, None)


async def test_running_row_is_taken_over_only_after_the_lease(backend: Backend) -> None:
    first = await _acquire(backend, lease_ms=60_000)
    await backend.age(first.id, 30_000)
    assert not (await backend.service.acquire(_opts(lease_ms=60_000))).acquired
    await backend.age(first.id, 30_001)
    second = await _acquire(backend, lease_ms=60_000)
    assert second.fencing_token == backend.base + 2
    assert not await backend.service.complete(first.lease)


async def test_expiry_is_the_owners_lease_not_the_contenders(backend: Backend) -> None:
    first = await _acquire(backend, lease_ms=60_000)
    await backend.age(first.id, 2_000)
    # A contender asking a shorter lease cannot take over inside the owner's lease ...
    assert not (await backend.service.acquire(_opts(lease_ms=1_000))).acquired
    await backend.age(first.id, 58_001)
    # ... and one asking a longer lease does not wait longer than the owner's lease.
    second = await _acquire(backend, lease_ms=3_600_000)
    assert second.fencing_token > first.fencing_token
    assert second.row.lease_ms == 3_600_000
    await backend.age(second.id, 120_000)
    assert not (await backend.service.acquire(_opts(lease_ms=60_000))).acquired


async def test_heartbeat_keeps_a_running_row(backend: Backend) -> None:
    first = await _acquire(backend, lease_ms=60_000)
    await backend.age(first.id, 59_000)
    assert await backend.service.heartbeat(first.lease)
    if backend.name == "memory":
        await backend.age(first.id, 2_000)  # the fake clock moved for everyone
    assert not (await backend.service.acquire(_opts(lease_ms=60_000))).acquired


async def test_release_lets_the_next_acquire_take_the_row(backend: Backend) -> None:
    first = await _acquire(backend)
    assert await backend.service.release(first.lease)
    assert (await backend.read(first.id))["data"] == {"released": True}
    second = await _acquire(backend)
    assert second.fencing_token == backend.base + 2


async def test_initial_runs_once_per_code(backend: Backend) -> None:
    options = JobAcquireOptions(code="seed", type="INITIAL")
    first = await backend.service.acquire(options)
    assert first.acquired
    assert first.row.run_key is None
    assert first.row.type is JobSchedulerType.INITIAL
    assert await backend.service.complete(first.lease)
    assert not (await backend.service.acquire({"code": "seed", "type": "INITIAL"})).acquired
    assert (await backend.service.acquire({"code": "seed", "run_key": "r"})).acquired


HOSTILE = [
    "'; DROP TABLE job_scheduler;--",
    "$1 %s %(x)s {} \\ E'\\x27'",
    "line\nbreak\x1b[31m",
    "\u202eevil",
    "🙂" * 60,
]


@pytest.mark.parametrize("text", HOSTILE, ids=["sql", "placeholders", "control", "bidi", "emoji"])
async def test_hostile_strings_are_stored_verbatim(backend: Backend, text: str) -> None:
    won = await _acquire(backend, code=text[:64], run_key=text, name=text)
    assert await backend.service.complete(won.lease, {text: text})
    row = await backend.read(won.id)
    assert (row["code"], row["run_key"], row["name"]) == (text[:64].strip(), text, text)
    assert row["data"] == {text: text}
    assert await backend.count() == 1


BAD_DATA: list[tuple[Any, type[Exception]]] = [
    ({"x": float("nan")}, JsonValueError),
    ({"x": float("inf")}, JsonValueError),
    ({"x": "\u0000"}, JsonValueError),
    ({1: "a", "1": "b"}, JsonTypeError),
    ({"x": {1, 2}}, JsonTypeError),
    (["not", "an", "object"], JsonTypeError),
]


@pytest.mark.parametrize(
    ("data", "error"), BAD_DATA, ids=["nan", "inf", "nul", "int-key", "set", "list"]
)
async def test_bad_data_is_refused_and_nothing_is_written(
    backend: Backend, data: Any, error: type[Exception]
) -> None:
    won = await _acquire(backend)
    for method in (backend.service.complete, backend.service.fail, backend.service.release):
        with pytest.raises(error):
            await method(won.lease, data)
    row = await backend.read(won.id)
    assert (row["status"], row["data"]) == ("RUNNING", None)
    assert await backend.service.complete(won.lease, {"fine": True})


@pytest.mark.parametrize(
    "lease",
    [
        JobLease(id="not-a-uuid", owner_token=str(uuid.uuid4())),
        JobLease(id=str(uuid.uuid4()), owner_token="x'; --"),
        JobLease(id=str(uuid.uuid4()), owner_token=None),  # type: ignore[arg-type]
        {"id": "x", "owner_token": "y"},
    ],
    ids=["bad-id", "bad-token", "none-token", "dict"],
)
async def test_malformed_leases_are_refused_before_sql(backend: Backend, lease: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        await backend.service.heartbeat(lease)
    with pytest.raises((TypeError, ValueError)):
        await backend.service.complete(lease)


# --- run_exclusive ---------------------------------------------------------------------------


def _no_other_tasks(before: set[asyncio.Task[Any]]) -> bool:
    """No task is left over but those that existed before (the connection pool's workers)."""
    return asyncio.all_tasks() <= before


async def test_run_exclusive_runs_an_async_function_and_completes(backend: Backend) -> None:
    before = asyncio.all_tasks()
    seen: list[JobExecutionLease] = []

    async def work(lease: JobExecutionLease) -> str:
        seen.append(lease)
        assert lease.is_held
        return "done"

    outcome = await backend.service.run_exclusive(_opts(), work)
    assert (outcome.acquired, outcome.result) == (True, "done")
    assert (await backend.read(seen[0].id))["status"] == "SUCCESS"
    again = await backend.service.run_exclusive(_opts(), work)
    assert (again.acquired, again.result) == (False, None)
    assert len(seen) == 1
    assert _no_other_tasks(before)


async def test_run_exclusive_runs_a_plain_function_in_a_worker_thread(backend: Backend) -> None:
    main = threading.get_ident()

    def work(lease: JobExecutionLease) -> int:
        assert threading.get_ident() != main
        return lease.fencing_token

    outcome = await backend.service.run_exclusive({"code": "sync", "run_key": "r"}, work)
    assert outcome.result == backend.base + 1


async def test_run_exclusive_awaits_an_awaitable_returned_by_a_plain_callable(
    backend: Backend,
) -> None:
    async def later(value: int) -> int:
        await asyncio.sleep(0)
        return value * 2

    outcome = await backend.service.run_exclusive(_opts(), lambda lease: later(21))
    assert outcome.result == 42


async def test_run_exclusive_marks_fail_and_reraises(backend: Backend) -> None:
    before = asyncio.all_tasks()
    ids: list[str] = []

    async def work(lease: JobExecutionLease) -> None:
        ids.append(lease.id)
        raise RuntimeError("boom\x00with NUL and \ud800 surrogate")

    with pytest.raises(RuntimeError, match="boom"):
        await backend.service.run_exclusive(_opts(), work)
    row = await backend.read(ids[0])
    assert row["status"] == "FAIL"
    assert row["data"]["error"].startswith("RuntimeError: boom")
    # FAIL may be retried at once by anyone.
    assert (
        await backend.service.run_exclusive(_opts(), lambda lease: "retried")
    ).result == "retried"
    assert _no_other_tasks(before)


class _Abort(BaseException):
    pass


async def test_base_exceptions_also_mark_fail(backend: Backend) -> None:
    ids: list[str] = []

    def work(lease: JobExecutionLease) -> None:
        ids.append(lease.id)
        raise _Abort

    with pytest.raises(_Abort):
        await backend.service.run_exclusive(_opts(), work)
    assert (await backend.read(ids[0]))["status"] == "FAIL"


async def test_cancellation_marks_fail_and_propagates(backend: Backend) -> None:
    before = asyncio.all_tasks()
    started = asyncio.Event()
    ids: list[str] = []

    async def work(lease: JobExecutionLease) -> None:
        ids.append(lease.id)
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(backend.service.run_exclusive(_opts(lease_ms=3000), work))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    row = await backend.read(ids[0])
    assert row["status"] == "FAIL"
    assert row["data"] == {"error": "cancelled"}
    assert _no_other_tasks(before)


async def test_cancelling_a_thread_run_waits_for_the_thread_and_signals_it(
    backend: Backend,
) -> None:
    started = threading.Event()
    finished = threading.Event()
    ids: list[str] = []

    def work(lease: JobExecutionLease) -> None:
        ids.append(lease.id)
        started.set()
        while lease.is_held:
            threading.Event().wait(0.01)
        finished.set()

    task = asyncio.create_task(backend.service.run_exclusive(_opts(lease_ms=3000), work))
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()
    assert (await backend.read(ids[0]))["status"] == "FAIL"


async def test_loss_seen_by_the_heartbeat_cancels_an_async_function(backend: Backend) -> None:
    before = asyncio.all_tasks()
    reached_end = False
    ids: list[str] = []

    async def work(lease: JobExecutionLease) -> None:
        nonlocal reached_end
        ids.append(lease.id)
        assert await backend.service.release(lease)  # as an operator would
        await _acquire(backend, lease_ms=3000)  # another replica takes the run
        await asyncio.sleep(10)
        reached_end = True

    with pytest.raises(LostJobLeaseError):
        await asyncio.wait_for(
            backend.service.run_exclusive(_opts(lease_ms=300, heartbeat_ms=50), work), 5
        )
    assert not reached_end
    row = await backend.read(ids[0])
    assert (row["status"], row["fencing_token"]) == ("RUNNING", backend.base + 2)
    assert _no_other_tasks(before)


async def test_loss_is_visible_to_a_thread_through_the_lease(backend: Backend) -> None:
    loop = asyncio.get_running_loop()

    def work(lease: JobExecutionLease) -> str:
        asyncio.run_coroutine_threadsafe(backend.service.release(lease), loop).result(5)
        for _ in range(500):
            if not lease.is_held:
                with pytest.raises(LostJobLeaseError):
                    lease.raise_if_lost()
                return "stopped"
            threading.Event().wait(0.01)
        return "never noticed"

    with pytest.raises(LostJobLeaseError):
        await backend.service.run_exclusive(_opts(lease_ms=300, heartbeat_ms=50), work)


async def test_returning_after_a_silent_loss_is_not_success(backend: Backend) -> None:
    async def work(lease: JobExecutionLease) -> str:
        assert await backend.service.release(lease)
        await _acquire(backend)
        return "result of a fenced-out owner"

    with pytest.raises(LostJobLeaseError):
        await backend.service.run_exclusive(_opts(heartbeat_ms=0), work)


async def test_a_failing_fenced_out_owner_gets_lost_error_with_the_cause(backend: Backend) -> None:
    async def work(lease: JobExecutionLease) -> None:
        assert await backend.service.release(lease)
        await _acquire(backend)
        raise ValueError("late failure")

    with pytest.raises(LostJobLeaseError) as info:
        await backend.service.run_exclusive(_opts(heartbeat_ms=0), work)
    assert isinstance(info.value.__cause__, ValueError)


async def test_two_coroutines_of_one_process_do_not_share_ownership(backend: Backend) -> None:
    gate = asyncio.Event()

    async def work(lease: JobExecutionLease) -> str:
        await gate.wait()
        return lease.id

    first = asyncio.create_task(backend.service.run_exclusive(_opts(), work))
    await asyncio.sleep(0.05)
    second = await backend.service.run_exclusive(_opts(), work)
    gate.set()
    assert (await first).acquired
    assert not second.acquired


async def test_invalid_options_raise_before_anything_is_written(backend: Backend) -> None:
    called = False

    def work(lease: JobExecutionLease) -> None:
        nonlocal called
        called = True

    with pytest.raises(ValueError, match="run_key"):
        await backend.service.run_exclusive({"code": "c", "runKey": "r"}, work)
    with pytest.raises(ValueError, match="lease_ms"):
        await backend.service.run_exclusive({"code": "c", "run_key": "r", "lease_ms": None}, work)
    assert not called
    assert await backend.count() == 0


async def test_statuses_by_lock_key(backend: Backend) -> None:
    done = await _acquire(backend, run_key="a")
    assert await backend.service.complete(done.lease)
    failed = await _acquire(backend, run_key="b")
    assert await backend.service.fail(failed.lease)
    await _acquire(backend, run_key="c")
    keys = [_opts(run_key=k).lock_key for k in ("a", "b", "c", "d")]
    assert await backend.service.statuses(keys) == {
        keys[0]: JobSchedulerStatus.SUCCESS,
        keys[1]: JobSchedulerStatus.FAIL,
        keys[2]: JobSchedulerStatus.RUNNING,
    }
    assert await backend.service.statuses([]) == {}
