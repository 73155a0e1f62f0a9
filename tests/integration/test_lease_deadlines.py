"""Client-side lease deadlines against real PostgreSQL.

Each test makes the database or the network misbehave in one way and checks the lease's promise
from the client's side: at most one owner at a time, an owner that learns of its loss within its
own lease, and never a success reported for an answer that did not come back. Faults are made
with row triggers that ``pg_sleep`` for one contender (selected by ``application_name``) and with
a loopback TCP proxy written here that can stop forwarding.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sdcore.job_scheduler import (
    LEASE_CLOCK_MARGIN,
    LEASE_SLACK_MS,
    AttemptBudget,
    JobAcquired,
    JobAcquireOptions,
    JobExecutionLease,
    JobSchedulerService,
    JobSchedulerStatus,
    LostJobLeaseError,
)
from sdcore.postgres import PoolSettings

# Scheduling noise on a loaded 2-core CI machine: added to every upper bound, never to a lower one.
TOLERANCE_S = 0.4


# --------------------------------------------------------------------------- a TCP proxy


@dataclass
class _Link:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    blackholed: bool = False
    released: asyncio.Event = field(default_factory=asyncio.Event)


class Proxy:
    """A loopback TCP proxy in front of PostgreSQL.

    ``blackhole()`` stops forwarding in both directions on every connection, present and future,
    while keeping the sockets open (what a cut network looks like to both ends until TCP gives
    up). ``hold()`` keeps the server's answers on the connections open now until ``release()``.
    """

    def __init__(self, target_dsn: str) -> None:
        params = conninfo_to_dict(target_dsn)
        self.host = str(params.get("host") or "127.0.0.1")
        self.port = int(params.get("port") or 5432)
        self.target_dsn = target_dsn
        self.listen_port = 0
        self.links: list[_Link] = []
        self.blackhole_new = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def dsn(self) -> str:
        params = {k: str(v) for k, v in conninfo_to_dict(self.target_dsn).items()}
        params.update(host="127.0.0.1", port=str(self.listen_port), sslmode="disable")
        return make_conninfo(**params)

    def blackhole(self) -> None:
        self.blackhole_new = True
        for link in self.links:
            link.blackholed = True

    def hold(self) -> None:
        for link in self.links:
            link.released.clear()

    def release(self) -> None:
        for link in self.links:
            link.released.set()

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cut()

    async def cut(self) -> None:
        """Close everything: clients see their connections fail at once."""
        assert self._server is not None
        self._server.close()
        for link in self.links:
            link.client.transport.abort()
            link.server.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        await self._server.wait_closed()

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection(self.host, self.port)
        except OSError:
            cwriter.transport.abort()
            return
        link = _Link(client=cwriter, server=swriter, blackholed=self.blackhole_new)
        link.released.set()
        self.links.append(link)
        for task in (
            asyncio.create_task(self._pump(link, creader, swriter, downstream=False)),
            asyncio.create_task(self._pump(link, sreader, cwriter, downstream=True)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        link: _Link,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        downstream: bool,
    ) -> None:
        try:
            while data := await reader.read(65536):
                if downstream:
                    await link.released.wait()
                if link.blackholed:
                    continue  # swallowed: nothing arrives, nothing is refused
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()


# --------------------------------------------------------------------------- helpers


def _report(line: str) -> None:
    """A measured figure (shown with ``pytest -s``)."""
    print(line)  # noqa: T201


async def _sql(dsn: str, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(query.encode(), params)
        return await cur.fetchall() if cur.description else []


async def _sleep_trigger(dsn: str, timing: str, event: str, app: str, seconds: float) -> None:
    """A test-only row trigger on job_scheduler that sleeps for one application_name."""
    condition = "current_setting('application_name') = %s"
    if event == "UPDATE":
        condition += " AND NEW.status = 'SUCCESS'"
    await _sql(
        dsn,
        f"""
        CREATE FUNCTION sdcore_test_sleep() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF {condition.replace("%s", "'" + app + "'")} THEN
                PERFORM pg_sleep({seconds});
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER sdcore_test_sleep {timing} {event} ON job_scheduler
            FOR EACH ROW EXECUTE FUNCTION sdcore_test_sleep();
        """,
    )


@contextlib.asynccontextmanager
async def _service(dsn: str, app: str) -> AsyncIterator[JobSchedulerService]:
    async with JobSchedulerService.connect(
        dsn, pool=PoolSettings(max_size=4, application_name=app)
    ) as svc:
        yield svc


async def _status(dsn: str, code: str) -> str | None:
    rows = await _sql(dsn, "SELECT status FROM job_scheduler WHERE code = %s", (code,))
    return str(rows[0][0]) if rows else None


# --------------------------------------------------------------------------- tests


@pytest.mark.slow
@pytest.mark.parametrize("api", ["run_exclusive", "manual"])
async def test_an_acquire_answered_after_its_lease_is_never_an_owner(
    jobs: JobSchedulerService, pg_dsn: str, api: str
) -> None:
    """The slow contender's INSERT sleeps 3 s in an AFTER INSERT trigger, lease 2 s: by the time
    its commit could answer, the row has expired by the database clock and the other contender
    takes it over. The slow one must not run (nor report acquired): at most one owner, ever."""
    await _sleep_trigger(pg_dsn, "AFTER", "INSERT", "slow", 3)
    options = {"code": "late", "run_key": "r", "lease_ms": 2000}
    running = 0
    most = 0
    ran: list[str] = []
    owners: list[tuple[str, float, float]] = []  # (who, reported at, client deadline)

    def make(who: str) -> Any:
        async def work(lease: JobExecutionLease) -> str:
            nonlocal running, most
            running += 1
            most = max(most, running)
            ran.append(who)
            try:
                await asyncio.sleep(1.0)
            finally:
                running -= 1
            return who

        return work

    async def attempt(svc: JobSchedulerService, who: str) -> bool:
        if api == "run_exclusive":
            return (await svc.run_exclusive(options, make(who))).acquired
        result = await svc.acquire(options)
        if isinstance(result, JobAcquired):
            owners.append((who, time.monotonic(), result.lease.deadline))
            return True
        return False

    async with _service(pg_dsn, "slow") as slow, _service(pg_dsn, "fast") as fast:
        slow_task = asyncio.create_task(attempt(slow, "slow"))
        await asyncio.sleep(0.3)  # the slow INSERT is now sleeping in its trigger
        fast_won = False
        async with asyncio.timeout(15):
            while not fast_won:
                fast_won = await attempt(fast, "fast")
                if not fast_won:
                    await asyncio.sleep(0.05)
        async with asyncio.timeout(15):
            slow_won = await slow_task

    _report(f"late acquire ({api}): slow acquired={slow_won} fast acquired={fast_won} ran={ran}")
    assert fast_won
    assert not slow_won, "an acquire that came back after its lease was reported as acquired"
    if api == "run_exclusive":
        assert ran == ["fast"]
        assert most == 1
    else:
        # The manual API reported exactly one owner, and only once the slow one had given up.
        assert [who for who, _, _ in owners] == ["fast"]


async def test_expiry_is_the_owners_lease_not_the_contenders(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """A live owner with a 3 s lease and 1 s heartbeats is never taken over by a contender
    asking 300 ms; a dead owner with a 1 s lease is taken over ~1 s after its last write by a
    contender asking 60 s."""
    stop = asyncio.Event()
    taken: list[bool] = []

    async def owner_work(lease: JobExecutionLease) -> None:
        async with asyncio.timeout(10):
            await stop.wait()

    async with _service(pg_dsn, "contender") as other:
        owner = asyncio.create_task(
            jobs.run_exclusive(
                {"code": "owners", "run_key": "live", "lease_ms": 3000, "heartbeat_ms": 1000},
                owner_work,
            )
        )
        await asyncio.sleep(0.2)
        end = time.monotonic() + 2.5  # spans two heartbeat gaps far longer than 300 ms
        while time.monotonic() < end:
            result = await other.acquire({"code": "owners", "run_key": "live", "lease_ms": 300})
            taken.append(result.acquired)
            await asyncio.sleep(0.05)
        stop.set()
        outcome = await owner
        assert outcome.acquired
        assert not any(taken), "a contender asking a shorter lease took over a live owner"
        assert len(taken) > 10

        dead = await jobs.acquire({"code": "owners", "run_key": "dead", "lease_ms": 1000})
        assert isinstance(dead, JobAcquired)
        began = time.monotonic()
        async with asyncio.timeout(10):
            while not (
                won := await other.acquire(
                    {"code": "owners", "run_key": "dead", "lease_ms": 60_000}
                )
            ).acquired:
                await asyncio.sleep(0.02)
        waited = time.monotonic() - began
    _report(
        f"owner's expiry: {len(taken)} attempts asking 300 ms took over a live 3 s owner "
        f"{sum(taken)} times; a dead 1 s owner was taken over by a 60 s contender after "
        f"{waited:.2f} s"
    )
    assert isinstance(won, JobAcquired)
    assert won.fencing_token > dead.fencing_token
    assert won.row.lease_ms == 60_000  # the new owner's lease is recorded on the row
    # The dead owner's lease (1 s) decides: not the contender's 60 s.
    assert waited < 1.0 + 1.0, f"takeover of a dead owner took {waited:.2f} s"


@pytest.mark.slow
async def test_a_blackholed_owner_is_cancelled_within_its_own_lease(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """The owner's connections go silent (a proxy stops forwarding, sockets stay open) after it
    acquired with a 3 s lease and 1 s heartbeats. Its callable must be cancelled before the lease
    ends, i.e. before another replica can take over, and run_exclusive must raise within the
    lease plus the documented slack."""
    lease_ms = 3000
    options = {"code": "cut", "run_key": "r", "lease_ms": lease_ms, "heartbeat_ms": 1000}
    started = asyncio.Event()
    seen: dict[str, float] = {}

    async def work(lease: JobExecutionLease) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen["cancelled"] = time.monotonic()
            raise

    async with Proxy(pg_dsn) as proxy, _service(proxy.dsn, "cut-owner") as owner:
        began = time.monotonic()
        run = asyncio.create_task(owner.run_exclusive(options, work))
        async with asyncio.timeout(10):
            await started.wait()
        proxy.blackhole()
        async with asyncio.timeout(10):
            while not (won := await jobs.acquire(options)).acquired:
                await asyncio.sleep(0.02)
        seen["taken_over"] = time.monotonic()
        with pytest.raises(LostJobLeaseError, match="ran out on the client"):
            async with asyncio.timeout(10):
                await run
        seen["returned"] = time.monotonic()
        await proxy.cut()  # the abandoned connections fail now, not at the pool's close

    _report(
        "blackholed owner (lease 3 s, heartbeat 1 s): "
        + " ".join(f"{k}=+{v - began:.2f}s" for k, v in sorted(seen.items(), key=lambda i: i[1]))
    )
    assert "cancelled" in seen, "the owner's callable was never cancelled"
    assert seen["cancelled"] < seen["taken_over"], "both ran: the owner learned too late"
    assert seen["cancelled"] - began < lease_ms / 1000 + TOLERANCE_S
    assert seen["returned"] - began < (lease_ms + LEASE_SLACK_MS) / 1000 + TOLERANCE_S
    assert seen["taken_over"] - began >= lease_ms / 1000 * (1 - LEASE_CLOCK_MARGIN) - 0.05
    assert isinstance(won, JobAcquired)


async def test_a_caller_cancelled_after_its_acquire_committed_leaves_a_fail_row(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """The acquire commits but its answer is held by the proxy; the caller is cancelled then.
    Before the cancellation propagates the acquire reads its row back by its token and marks it
    FAIL, so another replica acquires at once instead of waiting out a 60 s lease."""
    options = {"code": "cancelled", "run_key": "r", "lease_ms": 60_000}
    async with Proxy(pg_dsn) as proxy, _service(proxy.dsn, "cancelled-owner") as owner:
        # One connection open through the proxy, the acquire prepared on it: what is held
        # below is the acquire's execution, not its Parse.
        await owner.acquire({**options, "code": "cancelled-warm-up"})
        proxy.hold()
        task = asyncio.create_task(owner.acquire(options))
        async with asyncio.timeout(10):
            while await _status(pg_dsn, "cancelled") != "RUNNING":
                await asyncio.sleep(0.02)
        # Committed on the server; the answer waits in the proxy.
        task.cancel()
        await asyncio.sleep(0.3)
        proxy.release()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(15):
                await task
    assert await _status(pg_dsn, "cancelled") == "FAIL"
    again = await jobs.acquire(options)
    assert again.acquired, "the cancelled acquire left a RUNNING row with no owner"


@pytest.mark.slow
async def test_a_hung_finalize_is_bounded_and_never_success(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """complete() hangs in a BEFORE UPDATE trigger far past the 2 s lease: run_exclusive must
    return or raise within the lease plus the documented slack, and not report success."""
    await _sleep_trigger(pg_dsn, "BEFORE", "UPDATE", "hung", 6)
    lease_ms = 2000
    async with _service(pg_dsn, "hung") as svc:
        began = time.monotonic()
        with pytest.raises(LostJobLeaseError):
            async with asyncio.timeout(15):
                await svc.run_exclusive(
                    {"code": "hung", "run_key": "r", "lease_ms": lease_ms},
                    lambda lease: "done",
                )
        elapsed = time.monotonic() - began
    _report(f"hung finalize (lease 2 s, trigger sleeps 6 s): raised after {elapsed:.2f} s")
    assert elapsed < (lease_ms + LEASE_SLACK_MS) / 1000 + TOLERANCE_S, f"took {elapsed:.2f} s"


async def test_fencing_tokens_grow_across_re_creation_of_a_key(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """A pruned key created anew gets a token above every token it had (from the sequence)."""
    options = {"code": "pruned", "run_key": "r", "lease_ms": 60_000}
    first = await jobs.acquire(options)
    assert isinstance(first, JobAcquired)
    assert await jobs.fail(first.lease)
    second = await jobs.acquire(options)
    assert isinstance(second, JobAcquired)
    assert second.fencing_token > first.fencing_token
    assert await jobs.complete(second.lease)
    await _sql(pg_dsn, "DELETE FROM job_scheduler WHERE code = 'pruned'")
    third = await jobs.acquire(options)
    assert isinstance(third, JobAcquired)
    assert third.id != second.id
    assert third.fencing_token > second.fencing_token


async def test_the_lease_exposes_its_client_deadline(jobs: JobSchedulerService) -> None:
    valid = 10 * (1 - LEASE_CLOCK_MARGIN)
    sent = time.monotonic()
    won = await jobs.acquire({"code": "deadline", "run_key": "r", "lease_ms": 10_000})
    answered = time.monotonic()
    assert isinstance(won, JobAcquired)
    lease = won.lease
    assert lease.deadline == won.deadline
    # From when the statement was sent, not when its answer came.
    assert sent + valid <= lease.deadline <= answered + valid
    assert 9.0 < lease.time_left <= 10 * (1 - LEASE_CLOCK_MARGIN)
    before = lease.deadline
    await asyncio.sleep(0.05)
    assert await jobs.heartbeat(lease)
    assert lease.deadline > before
    assert won.lease.deadline == lease.deadline  # one deadline, however often .lease is read
    assert lease.is_held


async def test_the_service_never_holds_the_last_connection_of_its_pool(pg_dsn: str) -> None:
    """connect(max_size=2): a handler that uses jobs.pool still gets a connection."""
    async with JobSchedulerService.connect(pg_dsn, pool=PoolSettings(max_size=2)) as svc:
        await svc.ensure_schema()
        assert svc.max_connections == 1

        async def work(lease: JobExecutionLease) -> int:
            async with svc.pool.connection(timeout=5) as conn:
                cur = await conn.execute("SELECT 1")
                row = await cur.fetchone()
                assert row is not None
                return int(row[0])

        # The service holds its one lease connection; the handler gets the pool's other one.
        outcome = await svc.run_exclusive({"code": "pool", "run_key": "r"}, work)
        assert outcome.result == 1


async def test_the_owner_lease_migration_runs_again_without_moving_the_sequence_back(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """lease/0002 applied a second time (as after `sdcore db sql` by hand) changes nothing."""
    from sdcore.postgres import migrations

    (owner,) = [m for m in migrations("lease") if m.version == 2]
    first = await jobs.acquire({"code": "again", "run_key": "r", "lease_ms": 60_000})
    assert isinstance(first, JobAcquired)
    await _sql(pg_dsn, "DELETE FROM job_scheduler")  # the sequence is now ahead of every row
    await _sql(pg_dsn, owner.render(table="job_scheduler"))
    second = await jobs.acquire({"code": "again", "run_key": "r", "lease_ms": 60_000})
    assert isinstance(second, JobAcquired)
    assert second.fencing_token > first.fencing_token


@pytest.mark.slow
async def test_a_tick_whose_acquire_answered_too_late_is_given_back_for_another_replica(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """The slow replica's INSERT sleeps 1.2 s (past half of a 2 s lease) and its confirming
    heartbeat is refused: it gives the tick back unstarted. With retries=0 the tick must still
    run once: the other replica takes it at once as attempt 1 (a plain FAIL would use up the
    budget, and no replica would ever run the tick)."""
    await _sleep_trigger(pg_dsn, "AFTER", "INSERT", "slow", 1.2)
    await _sql(
        pg_dsn,
        """
        CREATE FUNCTION sdcore_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF current_setting('application_name') = 'slow' AND NEW.status = 'RUNNING' THEN
                RAISE EXCEPTION 'heartbeat refused by the test';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER sdcore_test_refuse BEFORE UPDATE ON job_scheduler
            FOR EACH ROW EXECUTE FUNCTION sdcore_test_refuse();
        """,
    )
    options = JobAcquireOptions(code="late-tick", run_key="r", lease_ms=2_000)
    budget = AttemptBudget(max_attempts=1, backoff_ms=60_000)
    async with _service(pg_dsn, "slow") as slow:
        lost, attempt = await slow.acquire_attempt(options, budget)
    assert (lost.acquired, attempt) == (False, 0)
    record = (await jobs.tick_records([options.lock_key]))[options.lock_key]
    assert (record.status, record.attempts, record.given_back) == (
        JobSchedulerStatus.FAIL,
        1,
        True,
    )
    taken, attempt = await jobs.acquire_attempt(options, budget)
    assert (taken.acquired, attempt) == (True, 1)
