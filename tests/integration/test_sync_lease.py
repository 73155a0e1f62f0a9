"""``sdcore.sync.JobSchedulerService`` and ``LeaseAdmin`` on real PostgreSQL: blocking callers.

The lease contract itself runs through the facade in tests/contract (the ``postgres-sync``
backend); these tests cover what only blocking code has: the function in the caller's thread,
a loss it can only observe, interrupts, forks, refusal from an event loop, many threads and
processes on one table, and the blocking connection of ``complete_in`` and the admin.
"""

from __future__ import annotations

import asyncio
import contextvars
import multiprocessing
import os
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from sdcore import job_scheduler, sync
from sdcore.job_scheduler import (
    InvalidAdminRequestError,
    JobExecutionLease,
    JobNotFoundError,
    JobSchedulerStatus,
    LostJobLeaseError,
)
from sdcore.postgres import PoolSettings
from sdcore.runtime import RuntimeStateError
from sdcore.sync import _portal as sync_portal

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


@pytest.fixture
def jobs(pg_dsn: str) -> Iterator[sync.JobSchedulerService]:
    with sync.JobSchedulerService.connect(pg_dsn) as service:
        service.ensure_schema()
        yield service


def _row(dsn: str, job_id: str) -> tuple[str, Any]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT status, data FROM job_scheduler WHERE id = %s", (job_id,)
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def _count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM job_scheduler").fetchone()
    assert row is not None
    return int(row[0])


def test_fn_runs_in_the_callers_thread_with_its_locals_and_context(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    local = threading.local()
    local.request = "req-7"
    token = WHO.set("caller")
    seen: dict[str, Any] = {}

    def work(lease: JobExecutionLease) -> int:
        seen["thread"] = threading.get_ident()
        seen["local"] = getattr(local, "request", None)
        seen["context"] = WHO.get()
        assert lease.is_held
        return lease.fencing_token

    try:
        outcome = jobs.run_exclusive({"code": "here", "run_key": "1"}, work)
    finally:
        WHO.reset(token)
    assert outcome.acquired
    assert seen == {"thread": threading.get_ident(), "local": "req-7", "context": "caller"}
    assert jobs.run_exclusive({"code": "here", "run_key": "1"}, work).acquired is False
    assert _count(pg_dsn) == 1


def test_a_loss_seen_by_the_heartbeat_reaches_the_function_and_is_never_success(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    ids: list[str] = []
    stopped: list[LostJobLeaseError] = []

    def work(lease: JobExecutionLease) -> str:
        ids.append(lease.id)
        # An operator releases the run; the next heartbeat finds the row no longer ours.
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            sync.LeaseAdmin().release(conn, lease.id, reason="operator")
        while True:
            try:
                lease.raise_if_lost()
            except LostJobLeaseError as exc:
                stopped.append(exc)
                return "stopped early"
            time.sleep(0.01)

    with pytest.raises(LostJobLeaseError):
        jobs.run_exclusive(
            {"code": "lost", "run_key": "1", "lease_ms": 3_000, "heartbeat_ms": 100}, work
        )
    assert len(stopped) == 1
    assert "ownership" in str(stopped[0]) or "lost" in str(stopped[0])
    status, data = _row(pg_dsn, ids[0])
    assert status == "FAIL"
    assert data["reason"] == "operator"


def test_a_lease_that_runs_out_stops_the_function_at_its_client_deadline(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    seen: dict[str, Any] = {}

    def work(lease: JobExecutionLease) -> str:
        seen["id"], seen["deadline"] = lease.id, lease.deadline
        while True:
            try:
                lease.raise_if_lost()
            except LostJobLeaseError:
                seen["at"] = time.monotonic()
                break
            time.sleep(0.005)
        # The function's own clock saw the deadline; wait until the portal's deadline timer
        # has fired too, so that returning now is a return after the loss, never a race with it.
        while not lease._state.lost:
            time.sleep(0.005)
        return "a result after the lease ran out"

    with pytest.raises(LostJobLeaseError):
        jobs.run_exclusive(
            {"code": "out", "run_key": "1", "lease_ms": 400, "heartbeat_ms": 0}, work
        )
    # The client deadline is the acquire's send time plus lease_ms less LEASE_CLOCK_MARGIN: the
    # function is stopped no later than that, by its own clock, never after it.
    assert seen["at"] >= seen["deadline"]
    assert _row(pg_dsn, seen["id"])[0] != "SUCCESS"


@pytest.mark.parametrize("rounds", [12])
def test_a_function_ending_at_the_deadline_is_success_only_if_recorded(
    jobs: sync.JobSchedulerService, pg_dsn: str, rounds: int
) -> None:
    outcomes: list[str] = []
    for n in range(rounds):
        ids: list[str] = []

        def work(lease: JobExecutionLease, ids: list[str] = ids) -> str:
            ids.append(lease.id)
            # Return as close to the client deadline as the clock allows, on either side.
            time.sleep(max(lease.time_left + random.uniform(-0.004, 0.004), 0.0))
            return "done"

        try:
            result = jobs.run_exclusive(
                {"code": "edge", "run_key": str(n), "lease_ms": 150, "heartbeat_ms": 0}, work
            )
        except LostJobLeaseError:
            # Lost is always allowed here; the row may even be SUCCESS when the finalize's
            # answer came too late to be believed. The guarantee is the other way round.
            outcomes.append("lost")
        else:
            if not result.acquired:
                # The acquire's answer came after the 150 ms lease's client deadline (a loaded
                # machine): the lease is given back and the function never starts.
                assert ids == []
                outcomes.append("late")
                continue
            outcomes.append("success")
            assert result.result == "done"
            assert _row(pg_dsn, ids[0])[0] == "SUCCESS"
    assert len(outcomes) == rounds


def test_keyboard_interrupt_in_the_function_marks_fail_and_reaches_the_caller(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    ids: list[str] = []

    def work(lease: JobExecutionLease) -> None:
        ids.append(lease.id)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        jobs.run_exclusive({"code": "ki", "run_key": "1"}, work)
    status, data = _row(pg_dsn, ids[0])
    assert status == "FAIL"
    assert "KeyboardInterrupt" in data["error"]
    # The facade still works afterwards.
    assert jobs.run_exclusive({"code": "ki", "run_key": "1"}, lambda lease: 1).result == 1


def test_an_exception_in_the_function_marks_fail_and_is_reraised(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    ids: list[str] = []

    def work(lease: JobExecutionLease) -> None:
        ids.append(lease.id)
        raise ValueError("bad input file")

    with pytest.raises(ValueError, match="bad input file"):
        jobs.run_exclusive({"code": "err", "run_key": "1"}, work)
    assert _row(pg_dsn, ids[0]) == ("FAIL", {"error": "ValueError: bad input file"})


def test_calls_from_a_running_event_loop_are_refused(jobs: sync.JobSchedulerService) -> None:
    async def inside() -> None:
        with pytest.raises(RuntimeStateError, match="running event loop"):
            jobs.statuses(["k"])
        with pytest.raises(RuntimeStateError, match="running event loop"):
            jobs.run_exclusive({"code": "c", "run_key": "r"}, lambda lease: None)

    asyncio.run(inside())


def test_a_facade_used_after_fork_is_refused_in_the_child(jobs: sync.JobSchedulerService) -> None:
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        try:
            jobs.statuses(["k"])
            message = b"not refused"
        except RuntimeStateError as exc:
            message = b"refused: " + str(exc).encode()
        except BaseException as exc:
            message = repr(exc).encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(pid, 0)
    assert answer.startswith("refused: ")
    assert "before a fork" in answer
    assert jobs.statuses(["k"]) == {}  # the parent's facade is untouched


def _facade_and_service_errors(
    call: Callable[[Any], Any], jobs: sync.JobSchedulerService, dsn: str
) -> tuple[BaseException, BaseException]:
    with pytest.raises(Exception) as blocking:  # noqa: PT011 - compared with the async one below
        call(jobs)

    async def both() -> BaseException:
        async with job_scheduler.JobSchedulerService.connect(dsn) as service:
            try:
                result = call(service)
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:
                return exc
        raise AssertionError("the async service accepted it")

    return blocking.value, asyncio.run(both())


LEASE = job_scheduler.JobLease(id="not-a-uuid", owner_token="x")
BAD_CALLS: dict[str, Callable[[Any], Any]] = {
    "identity": lambda s: s.acquire({"code": "", "run_key": "r"}),
    "unknown-key": lambda s: s.acquire({"code": "c", "runKey": "r"}),
    "timing": lambda s: s.acquire({"code": "c", "run_key": "r", "lease_ms": 1}),
    "batch-twice": lambda s: s.acquire_many([{"code": "c", "run_key": "r"}] * 2),
    "statuses-str": lambda s: s.statuses("abc"),
    "lease": lambda s: s.heartbeat(LEASE),
    "data": lambda s: s.complete(
        job_scheduler.JobLease(id=str(_UUID), owner_token=str(_UUID)), {"x": float("nan")}
    ),
    "reason": lambda s: s.give_back(
        job_scheduler.JobLease(id=str(_UUID), owner_token=str(_UUID)), ""
    ),
    "run-options": lambda s: s.run_exclusive({"code": "c", "run_key": "r", "lease_ms": None}, len),
    "run-fn": lambda s: s.run_exclusive({"code": "c", "run_key": "r"}, "not callable"),
}
_UUID = "0b5f3c1e-1111-4222-8333-444455556666"


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_input_gets_the_async_error_before_any_sql(
    jobs: sync.JobSchedulerService, pg_dsn: str, call: Callable[[Any], Any]
) -> None:
    blocking, async_ = _facade_and_service_errors(call, jobs, pg_dsn)
    assert (type(blocking), str(blocking)) == (type(async_), str(async_))
    assert _count(pg_dsn) == 0


def test_async_functions_and_awaitables_are_refused_with_the_async_api_named(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    async def work(lease: JobExecutionLease) -> None:
        raise AssertionError("never awaited")

    with pytest.raises(TypeError, match=r"async function.*await sdcore\.job_scheduler"):
        jobs.run_exclusive({"code": "a", "run_key": "1"}, work)
    assert _count(pg_dsn) == 0
    # A plain function that hands back an awaitable ran: its row is marked FAIL.
    with pytest.raises(TypeError, match="returned an awaitable"):
        jobs.run_exclusive({"code": "a", "run_key": "2"}, lambda lease: work(lease))
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT status FROM job_scheduler").fetchall() == [("FAIL",)]


def test_complete_in_records_success_in_the_callers_blocking_transaction(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    def work(lease: JobExecutionLease) -> bool:
        with psycopg.connect(pg_dsn) as conn, conn.transaction():
            conn.execute("CREATE TABLE effects (token bigint)")
            conn.execute("INSERT INTO effects VALUES (%s)", (lease.fencing_token,))
            return jobs.complete_in(conn, lease, {"effects": 1})

    outcome = jobs.run_exclusive({"code": "tx", "run_key": "1"}, work)
    assert outcome.result is True
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT status, data FROM job_scheduler").fetchall() == [
            ("SUCCESS", {"effects": 1})
        ]
        assert conn.execute("SELECT count(*) FROM effects").fetchone() == (1,)


def test_complete_in_matches_nothing_for_a_fenced_out_owner(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    won = jobs.acquire({"code": "fenced", "run_key": "1"})
    assert won.acquired
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        sync.LeaseAdmin().release(conn, won.id)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        assert jobs.complete_in(conn, won.lease) is False
    assert _row(pg_dsn, won.id)[0] == "FAIL"


def test_complete_in_refuses_an_async_connection(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    async def refused() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            lease = job_scheduler.JobLease(id=_UUID, owner_token=_UUID)
            with pytest.raises(TypeError, match=r"blocking psycopg\.Connection"):
                jobs.complete_in(conn, lease)  # type: ignore[arg-type]

    asyncio.run(refused())


def _race(dsn: str, keys: list[str], threads: int, start: Any, out: Any) -> None:
    """One process of the race: ``threads`` threads sharing one facade, every key each."""
    done: list[tuple[int, int, str, int]] = []
    won = 0
    lock = threading.Lock()

    def worker() -> None:
        nonlocal won
        mine = list(keys)
        random.shuffle(mine)
        for key in mine:

            def work(lease: JobExecutionLease, key: str = key) -> None:
                with lock:
                    done.append((os.getpid(), threading.get_ident(), key, lease.fencing_token))
                time.sleep(0.005)

            outcome = facade.run_exclusive({"code": "race", "run_key": key}, work)
            if outcome.acquired:
                with lock:
                    won += 1

    with sync.JobSchedulerService.connect(dsn) as facade:
        start.wait()
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    out.put((won, done))


@pytest.mark.slow
def test_two_processes_of_four_threads_run_each_of_thirty_keys_once(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    keys = [f"key-{n}" for n in range(30)]
    context = multiprocessing.get_context("spawn")
    start, out = context.Event(), context.Queue()
    processes = [
        context.Process(target=_race, args=(pg_dsn, keys, 4, start, out)) for _ in range(2)
    ]
    for process in processes:
        process.start()
    start.set()
    reports = [out.get(timeout=90) for _ in processes]
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    won = sum(count for count, _ in reports)
    ran = [entry for _, entries in reports for entry in entries]
    assert won == 30
    assert sorted(key for _, _, key, _ in ran) == sorted(keys), "each key ran once"
    assert len({(pid, thread) for pid, thread, _, _ in ran}) > 1, "the threads competed"
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT run_key, status FROM job_scheduler WHERE code = 'race'"
        ).fetchall()
    assert sorted(rows) == sorted((key, "SUCCESS") for key in keys)


def test_close_while_a_run_is_in_another_thread_never_reports_success(pg_dsn: str) -> None:
    connected = sync.JobSchedulerService.connect(pg_dsn)
    jobs = connected.__enter__()
    jobs.ensure_schema()
    started, release = threading.Event(), threading.Event()
    outcome: list[object] = []

    def work(lease: JobExecutionLease) -> str:
        started.set()
        release.wait(10)
        return "finished after close"

    def run() -> None:
        try:
            outcome.append(jobs.run_exclusive({"code": "closing", "run_key": "1"}, work))
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    assert started.wait(10)
    closer = threading.Thread(target=connected.__exit__, args=(None, None, None))
    closer.start()
    time.sleep(0.2)  # let close() begin while the function still runs
    release.set()
    closer.join(30)
    runner.join(30)
    assert not closer.is_alive()
    assert not runner.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], RuntimeStateError), outcome
    assert "closed while the call ran" in str(outcome[0])
    assert not jobs.portal.running
    with pytest.raises(RuntimeStateError, match="closed"):
        jobs.statuses([])
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT status FROM job_scheduler").fetchone() != ("SUCCESS",)


def test_connect_warns_at_the_callers_line_for_a_0_1_pool_keyword(pg_dsn: str) -> None:
    with (
        pytest.warns(DeprecationWarning, match=r"connect\(pool=PoolSettings") as caught,
        sync.JobSchedulerService.connect(pg_dsn, max_size=3) as jobs,
    ):
        assert jobs.max_connections == 2  # capped at the pool's max_size - 1
    assert caught[0].filename == __file__
    with (
        pytest.raises(TypeError, match="cannot be combined"),
        sync.JobSchedulerService.connect(pg_dsn, pool=PoolSettings(max_size=2), max_size=3),
    ):
        pass


def test_the_admin_lists_releases_and_prunes_on_a_blocking_connection(
    jobs: sync.JobSchedulerService, pg_dsn: str
) -> None:
    admin = sync.LeaseAdmin()
    done = jobs.run_exclusive({"code": "adm", "run_key": "1"}, lambda lease: lease.id)
    running = jobs.acquire({"code": "adm", "run_key": "2"})
    assert running.acquired
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        runs = admin.list_runs(conn, code="adm")
        assert {(r.run_key, r.status) for r in runs} == {("1", "SUCCESS"), ("2", "RUNNING")}
        assert [r.run_key for r in admin.list_runs(conn, status="running")] == ["2"]
        released = admin.release(conn, running.id, reason="stuck")
        assert (released.id, released.run_key) == (running.id, "2")
        with pytest.raises(JobNotFoundError):
            admin.release(conn, _UUID)
        with pytest.raises(job_scheduler.JobNotRunningError):
            admin.release(conn, running.id)
        conn.execute(
            "UPDATE job_scheduler SET created_at = now() - interval '3 days',"
            " modified_at = now() - interval '3 days'"
        )
        seen: list[int] = []
        dry = admin.prune(conn, older_than=timedelta(days=1), dry_run=True)
        assert (dry.matching, dry.deleted) == (2, 0)
        report = admin.prune(conn, older_than=timedelta(days=1), batch_size=1, progress=seen.append)
        assert (report.deleted, report.batches, seen) == (2, 3, [1, 2])
        assert admin.has_schedule_runs(conn, "adm") is False
    assert done.acquired
    assert _count(pg_dsn) == 0


BAD_ADMIN: dict[str, Callable[[Any, Any], Any]] = {
    "limit": lambda a, c: a.list_runs(c, limit=0),
    "status": lambda a, c: a.list_runs(c, status="DONE"),
    "job-id": lambda a, c: a.release(c, "42"),
    "reason": lambda a, c: a.release(c, _UUID, reason="x" * 1001),
    "running": lambda a, c: a.prune(c, older_than=timedelta(days=1), statuses=["RUNNING"]),
    "age": lambda a, c: a.prune(c, older_than=timedelta(0)),
    "code": lambda a, c: a.has_schedule_runs(c, "a\x00b"),
}


@pytest.mark.parametrize("call", BAD_ADMIN.values(), ids=BAD_ADMIN.keys())
def test_the_admin_refuses_what_the_async_admin_refuses(
    pg_dsn: str, call: Callable[[Any, Any], Any]
) -> None:
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        pytest.raises(InvalidAdminRequestError) as blocking,
    ):
        call(sync.LeaseAdmin(), conn)

    async def refused() -> InvalidAdminRequestError:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            with pytest.raises(InvalidAdminRequestError) as info:
                await call(job_scheduler.LeaseAdmin(), conn)
            return info.value

    async_ = asyncio.run(refused())
    assert (blocking.value.field, str(blocking.value)) == (async_.field, str(async_))


def test_the_admin_refuses_an_async_connection_and_names_the_async_admin(pg_dsn: str) -> None:
    async def refused() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            with pytest.raises(TypeError, match=r"sdcore\.job_scheduler\.LeaseAdmin"):
                sync.LeaseAdmin().list_runs(conn)  # type: ignore[arg-type]

    asyncio.run(refused())


def test_statuses_and_heartbeat_from_many_threads_share_one_facade(
    jobs: sync.JobSchedulerService,
) -> None:
    won = jobs.acquire_many([{"code": "many", "run_key": str(n)} for n in range(8)])
    leases = [result.lease for result in won if result.acquired]
    assert len(leases) == 8
    errors: list[BaseException] = []

    def beat(lease: JobExecutionLease) -> None:
        try:
            for _ in range(20):
                assert jobs.heartbeat(lease)
                assert jobs.status_of(lease) is JobSchedulerStatus.RUNNING
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=beat, args=(lease,)) for lease in leases]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(60)
    assert errors == []
    assert all(jobs.complete(lease) for lease in leases)


def test_close_from_inside_the_function_is_refused(jobs: sync.JobSchedulerService) -> None:
    def work(lease: JobExecutionLease) -> str:
        with pytest.raises(RuntimeStateError, match="inside run_exclusive"):
            jobs.close()
        return "still running"

    assert (
        jobs.run_exclusive({"code": "self-close", "run_key": "1"}, work).result == "still running"
    )
    assert not jobs.closed


def test_a_portal_stopped_under_a_run_signals_the_function_and_records_fail(pg_dsn: str) -> None:
    portal = sync_portal.Portal(name="sdcore-test-jobs")
    portal.start()
    stack = AsyncExitStack()
    service = portal.call(
        stack.enter_async_context, job_scheduler.JobSchedulerService.connect(pg_dsn)
    )
    jobs = sync.JobSchedulerService(service, portal)
    jobs.ensure_schema()
    started = threading.Event()
    outcome: list[object] = []

    def work(lease: JobExecutionLease) -> str:
        started.set()
        while lease.is_held:
            time.sleep(0.01)
        outcome.append("saw the loss")
        return "after the loss"

    def run() -> None:
        try:
            outcome.append(jobs.run_exclusive({"code": "stopped", "run_key": "1"}, work))
        except RuntimeStateError as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    assert started.wait(10)
    portal.stop()
    runner.join(30)
    assert outcome[0] == "saw the loss"
    assert isinstance(outcome[1], RuntimeStateError)
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT status, data FROM job_scheduler").fetchall() == [
            ("FAIL", {"error": "cancelled"})
        ]


def test_a_connect_that_fails_leaves_no_portal_thread(pg_dsn: str) -> None:
    before = set(threading.enumerate())
    with (
        pytest.raises(ValueError, match="max_connections"),
        sync.JobSchedulerService.connect(pg_dsn, max_connections=0),
    ):
        pass
    with (
        pytest.raises(job_scheduler.JobSchedulerUnavailableError),
        sync.JobSchedulerService.connect(
            "postgresql://postgres@127.0.0.1:1/none", pool=PoolSettings(open_timeout_ms=300)
        ),
    ):
        pass
    assert {t.name for t in set(threading.enumerate()) - before} == set()
