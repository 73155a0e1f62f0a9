"""Lease core against a real PostgreSQL with injected faults (RELIABILITY.md §5.1, §5.2).

- DB-02: the connection dies during ``complete``/``fail``: killed before the commit
  (``pg_terminate_backend`` while a test-only trigger sleeps) and after it (a proxy forwards the
  statement and swallows the answer). The return value must agree with the row.
- DB-03: the answer of a committed ``acquire`` is lost: never a phantom owner.
- DB-07/DB-08: a row lock held by another session: bounded failure, nothing written.
- DB-11: a caller's old open transaction is not joined; no premature reclaim.
- DB-12: sessions in different time zones judge staleness the same.
- LC-08: guessed tokens are refused (audit trigger: zero changes).
- LC-06/LC-10: lease lost inside ``run_exclusive`` across two services.

No assertion is about speed: bounds (``asyncio.timeout``) only guard against hangs, and
"not before the lease" is checked with timestamps written by the database clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import (
    AttemptBudget,
    JobAcquired,
    JobAcquireOptions,
    JobAcquireResult,
    JobExecutionLease,
    JobLease,
    JobNotAcquired,
    JobSchedulerService,
    JobSchedulerUnavailableError,
    LostJobLeaseError,
)
from sdcore.postgres import PoolSettings
from tests._pgproxy import PgProxy, on_message
from tests._servers import own_postgres
from tests.conftest import ADMIN_DSN

Row = dict[str, Any]


def _report(line: str) -> None:
    """The RELIABILITY.md metric line (shown with ``pytest -s``)."""
    print(line)  # noqa: T201


def _dbname(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


async def _sql(dsn: str, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name="test-probe"
    ) as conn:
        cur = await conn.execute(query.encode(), params)
        return await cur.fetchall() if cur.description else []


_ROW_COLUMNS = (
    "id",
    "owner_token",
    "fencing_token",
    "status",
    "data",
    "modified_at",
    "created_at",
    "idempotency_key",
    "now",
)


async def _row(dsn: str, code: str, run_key: str) -> Row:
    rows = await _sql(
        dsn,
        "SELECT id::text, owner_token::text, fencing_token, status, data, modified_at,"
        " created_at, idempotency_key, clock_timestamp() FROM job_scheduler"
        " WHERE code = %s AND run_key = %s",
        (code, run_key),
    )
    assert len(rows) == 1, f"expected one row for {code}/{run_key}, found {len(rows)}"
    return dict(zip(_ROW_COLUMNS, rows[0], strict=True))


async def _db_now(dsn: str) -> datetime:
    value: datetime = (await _sql(dsn, "SELECT clock_timestamp()"))[0][0]
    return value


async def _busy_sessions(dsn: str, apps: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """G5: sessions of ``apps`` in this database that are not plain idle."""
    return await _sql(
        ADMIN_DSN,
        "SELECT application_name, state, query FROM pg_stat_activity"
        " WHERE datname = %s AND application_name = ANY(%s) AND state <> 'idle'",
        (_dbname(dsn), list(apps)),
    )


async def _acquired(svc: JobSchedulerService, options: dict[str, Any]) -> JobAcquired:
    got = await svc.acquire(options)
    assert isinstance(got, JobAcquired), f"expected to acquire {options}"
    return got


async def _acquire_until(
    svc: JobSchedulerService, options: dict[str, Any], deadline_s: float = 20
) -> tuple[JobAcquired, int]:
    """Retry until the lease is won; returns the win and how many attempts were refused."""
    refused = 0
    async with asyncio.timeout(deadline_s):
        while True:
            got = await svc.acquire(options)
            if isinstance(got, JobAcquired):
                return got, refused
            refused += 1
            await asyncio.sleep(0.05)


# --------------------------------------------------------------------------- fault tools


async def _install_sleep_trigger(dsn: str, code: str, status: str, sleeps: int) -> None:
    """A test-only BEFORE UPDATE trigger: the first ``sleeps`` updates of ``code``'s row to
    ``status`` sleep in the backend (a sequence counts them outside the killed transactions)."""
    await _sql(
        dsn,
        f"""
CREATE SEQUENCE fault_hits;
CREATE FUNCTION fault_sleep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = '{status}' AND NEW.code = '{code}' THEN
        IF nextval('fault_hits') <= {sleeps} THEN
            PERFORM pg_sleep(60);
        END IF;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER fault_sleep BEFORE UPDATE ON job_scheduler
    FOR EACH ROW EXECUTE FUNCTION fault_sleep();
""",
    )


async def _terminate_sleepers(dsn: str, app: str, count: int) -> list[int]:
    """Wait for a backend of ``app`` sleeping in the trigger and terminate it, ``count`` times."""
    killed: list[int] = []
    async with await psycopg.AsyncConnection.connect(ADMIN_DSN, autocommit=True) as admin:
        while len(killed) < count:
            cur = await admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s"
                " AND wait_event = 'PgSleep' AND query LIKE 'UPDATE%%' AND NOT (pid = ANY(%s))",
                (_dbname(dsn), app, killed),
            )
            row = await cur.fetchone()
            if row is None:
                await asyncio.sleep(0.02)
                continue
            await admin.execute("SELECT pg_terminate_backend(%s)", (row[0],))
            killed.append(int(row[0]))
    return killed


async def _outcome(aw: Awaitable[bool], guard_s: float = 30) -> bool | BaseException:
    try:
        async with asyncio.timeout(guard_s):
            return await aw
    except (JobSchedulerUnavailableError, TimeoutError) as exc:
        return exc


# --------------------------------------------------------------------------- DB-02


@pytest.mark.parametrize("kills", [1, 2])
async def test_db02_backend_killed_before_commit_of_complete(
    jobs: JobSchedulerService, pg_dsn: str, kills: int
) -> None:
    """DB-02 (killed before commit): the complete UPDATE sleeps in a trigger and its backend is
    terminated. The library retries on a fresh connection; whatever it returns must agree with
    the row: True only if the row is SUCCESS with our data."""
    got = await _acquired(jobs, {"code": "db02", "run_key": "k", "lease_ms": 60_000})
    await _install_sleep_trigger(pg_dsn, "db02", "SUCCESS", sleeps=kills)

    completing = asyncio.create_task(_outcome(jobs.complete(got.lease, {"result": 42})))
    killed = await asyncio.wait_for(_terminate_sleepers(pg_dsn, "sdcore", kills), 20)
    outcome = await completing
    row = await _row(pg_dsn, "db02", "k")
    _report(
        f"DB-02 kills={len(killed)}: outcome={outcome!r} row_status={row['status']} "
        f"wrong_outcomes={int((outcome is True) != (row['status'] == 'SUCCESS'))}"
    )

    # G4: the API tells the truth.
    if outcome is True:
        assert row["status"] == "SUCCESS"
        assert row["data"] == {"result": 42}
    else:
        assert row["status"] != "SUCCESS", f"complete reported {outcome!r} but the row is SUCCESS"
    assert row["owner_token"] == got.owner_token
    assert row["fencing_token"] == 1

    if kills == 1:
        # One lost connection: the retry on a fresh connection records the outcome.
        assert outcome is True
    else:
        # Both attempts died before their commit: the outcome is unknown to the caller, who is
        # told so (not True, not a silent False) and still owns the RUNNING row.
        assert isinstance(outcome, JobSchedulerUnavailableError), outcome
        assert row["status"] == "RUNNING"
        assert await jobs.complete(got.lease, {"result": 42}) is True
        assert (await _row(pg_dsn, "db02", "k"))["status"] == "SUCCESS"
    assert await _busy_sessions(pg_dsn, ("sdcore",)) == []


@pytest.mark.parametrize("method", ["complete", "fail", "release"])
async def test_db02_answer_lost_after_commit_of_finalize(
    jobs: JobSchedulerService, pg_dsn: str, method: str
) -> None:
    """DB-02 (ambiguous commit): the finalize commits but its answer never reaches the client.
    The library must re-read the row by (id, token) and report True."""
    expected = {"complete": "SUCCESS", "fail": "FAIL", "release": "FAIL"}[method]
    async with (
        PgProxy(pg_dsn) as proxy,
        JobSchedulerService.connect(
            proxy.dsn, pool=PoolSettings(max_size=4, application_name="sdcore-proxied")
        ) as svc,
    ):
        got = await _acquired(svc, {"code": "db02b", "run_key": method, "lease_ms": 60_000})
        proxy.arm(on_message(b"SET status"))
        call: Callable[[JobLease], Awaitable[bool]] = getattr(svc, method)
        outcome = await _outcome(call(got.lease))
        assert proxy.tripped, "the fault was not injected"
        assert proxy.swallowed.is_set(), "the fault was not injected"
        row = await _row(pg_dsn, "db02b", method)
        _report(f"DB-02 after-commit {method}: outcome={outcome!r} row_status={row['status']}")
        assert row["status"] == expected, "the statement should have committed"
        assert row["owner_token"] == got.owner_token
        assert outcome is True, f"{method} committed but reported {outcome!r}"
        # The run is over: the same lease can neither finalize again nor heartbeat.
        assert await call(got.lease) is False
        assert await svc.heartbeat(got.lease) is False
    assert await _busy_sessions(pg_dsn, ("sdcore-proxied",)) == []


async def test_db03_answer_lost_after_commit_of_acquire(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """DB-03: the acquire commits but its answer is lost. Never a phantom owner: a True result
    carries the token that is in the row; otherwise the row is reclaimable after the lease."""
    options = {"code": "db03", "run_key": "k", "lease_ms": 1000}
    async with (
        PgProxy(pg_dsn) as proxy,
        JobSchedulerService.connect(
            proxy.dsn, pool=PoolSettings(max_size=4, application_name="sdcore-proxied")
        ) as svc,
    ):
        proxy.arm(on_message(b"INSERT INTO"))
        try:
            result: JobAcquireResult | JobSchedulerUnavailableError = await asyncio.wait_for(
                svc.acquire(options), 30
            )
        except JobSchedulerUnavailableError as exc:
            result = exc
        assert proxy.tripped, "the fault was not injected"
        assert proxy.swallowed.is_set(), "the fault was not injected"
        row = await _row(pg_dsn, "db03", "k")
        _report(f"DB-03: outcome={result!r} row_status={row['status']}")
        assert row["status"] == "RUNNING"
        if isinstance(result, JobAcquired):
            assert result.owner_token == row["owner_token"], "phantom owner"
            assert result.fencing_token == row["fencing_token"] == 1
            assert await svc.heartbeat(result.lease) is True
        else:
            # Not told it owns the run: the orphan row must be taken over after the lease.
            won, _ = await _acquire_until(jobs, options)
            assert won.fencing_token == 2


# --------------------------------------------------------------------------- synchronous standby


async def _standby_required(dsn: str) -> None:
    """From now on every commit that writes waits for a synchronous standby that never comes."""
    await _sql(dsn, "ALTER SYSTEM SET synchronous_standby_names = 'absent'")
    await _sql(dsn, "SELECT pg_reload_conf()")
    while (await _sql(dsn, "SHOW synchronous_standby_names"))[0][0] != "absent":
        await asyncio.sleep(0.02)


async def _kill_when_waiting_for_standby(dsn: str) -> None:
    """Terminate the backend whose commit waits for the standby: the primary's crash. The
    commit stays on the primary; a standby promoted now would not have it."""
    query = "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
    for _ in range(1_000):
        rows = await _sql(dsn, query)
        if rows:
            await _sql(dsn, "SELECT pg_terminate_backend(%s)", (rows[0][0],))
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no commit waited for the standby")


@pytest.mark.parametrize("call", ["complete", "acquire", "acquire_attempts"])
async def test_a_commit_the_synchronous_standby_never_got_is_not_confirmed(call: str) -> None:
    """The backend of a ``complete`` or an acquire dies while its commit waits for the
    synchronous standby (a crashed primary recovers such commits; a failover loses them). The
    read-back that resolves the ambiguous commit must not confirm it on that primary: a plain
    read saw the row as written, and the scheduler then ran a tick the promoted standby gave to
    another replica, or reported a completion it lost, with nothing logged."""
    options = JobAcquireOptions(code="sync-standby", run_key="k", lease_ms=2_000)
    with own_postgres() as server:
        async with JobSchedulerService.connect(
            server.dsn, pool=PoolSettings(max_size=2, application_name="sdcore-sync-standby")
        ) as svc:
            await svc.ensure_schema()
            lease = None
            if call == "complete":
                acquired = await svc.acquire(options)
                assert isinstance(acquired, JobAcquired)
                lease = acquired.lease
            await _standby_required(server.dsn)
            pending: asyncio.Future[Any]
            if lease is not None:
                pending = asyncio.ensure_future(svc.complete(lease))
            elif call == "acquire":
                pending = asyncio.ensure_future(svc.acquire(options))
            else:
                pending = asyncio.ensure_future(
                    svc.acquire_attempts([(options, AttemptBudget(max_attempts=1, backoff_ms=0))])
                )
            await _kill_when_waiting_for_standby(server.dsn)
            try:
                outcome: Any = await asyncio.wait_for(pending, 30)
            except JobSchedulerUnavailableError as exc:
                outcome = exc
            rows = await _sql(server.dsn, "SELECT status FROM job_scheduler")
        _report(f"sync standby, {call}: {outcome!r}; the primary's row {rows}")
    assert rows == [("SUCCESS" if call == "complete" else "RUNNING",)], "no fault injected"
    if call == "complete":
        assert outcome is not True, "a completion the standby never got was confirmed"
    elif call == "acquire":
        assert not isinstance(outcome, JobAcquired), "an acquire the standby never got was won"
    else:
        assert isinstance(outcome, Exception) or not any(
            answer.result.acquired for answer in outcome
        ), outcome


# --------------------------------------------------------------------------- DB-07 / DB-08


async def test_db07_row_lock_held_elsewhere_fails_bounded(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """DB-07/DB-08: another session holds the row lock (`BEGIN; SELECT … FOR UPDATE`, idle).
    With statement_timeout_ms=500, acquire / heartbeat / complete end with an error (or False)
    instead of hanging, write nothing, and work again once the lock is gone."""
    free = {"code": "db07", "run_key": "free", "lease_ms": 60_000}
    held_opts = {"code": "db07", "run_key": "held", "lease_ms": 60_000}
    seeded = await _acquired(jobs, free)
    assert await jobs.fail(seeded.lease)
    held = await _acquired(jobs, held_opts)
    before = {k: await _row(pg_dsn, "db07", k) for k in ("free", "held")}

    blocker = await psycopg.AsyncConnection.connect(pg_dsn, application_name="blocker")
    try:
        await blocker.execute("SELECT id FROM job_scheduler WHERE code = 'db07' FOR UPDATE")
        async with JobSchedulerService.connect(
            pg_dsn,
            statement_timeout_ms=500,
            pool=PoolSettings(max_size=4, application_name="sdcore-db07"),
        ) as svc:
            calls: dict[str, Callable[[], Awaitable[object]]] = {
                "acquire": lambda: svc.acquire(free),
                "heartbeat": lambda: svc.heartbeat(held.lease),
                "complete": lambda: svc.complete(held.lease, {"x": 1}),
                "fail": lambda: svc.fail(held.lease),
            }
            outcomes: dict[str, object] = {}
            for name, call in calls.items():
                try:
                    async with asyncio.timeout(20):  # a hang guard, not a speed check
                        outcomes[name] = await call()
                except JobSchedulerUnavailableError as exc:
                    outcomes[name] = exc
            _report(f"DB-07: outcomes={ {k: type(v).__name__ for k, v in outcomes.items()} }")
            for name, value in outcomes.items():
                refused = value is False or isinstance(value, JobNotAcquired)
                assert isinstance(value, JobSchedulerUnavailableError) or refused, (
                    f"{name} under a held row lock returned {value!r}"
                )
            for key in ("free", "held"):
                after = await _row(pg_dsn, "db07", key)
                for column in ("status", "owner_token", "fencing_token", "data", "modified_at"):
                    assert after[column] == before[key][column], f"{key}.{column} changed"

            await blocker.rollback()
            # The lock is gone: the same service works again on the same connections.
            won = await svc.acquire(free)
            assert isinstance(won, JobAcquired)
            # Tokens come from the table's sequence: above the seeded one, not necessarily +1
            # (the timed-out acquire drew a value before it waited for the lock).
            assert won.fencing_token > seeded.fencing_token
            assert await svc.heartbeat(held.lease) is True
            assert await svc.complete(held.lease, {"x": 1}) is True
            assert await _busy_sessions(pg_dsn, ("sdcore-db07",)) == []
    finally:
        await blocker.close()


# --------------------------------------------------------------------------- DB-11


async def test_db11_callers_old_transaction_is_not_joined(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """DB-11: the caller holds a 3 s old transaction on a connection of the same pool and calls
    acquire inside it. The lease statement runs on the service's own connection at statement
    time: modified_at is not the caller's now(), no second owner right after, and the caller's
    rollback does not undo the acquisition."""
    options = {"code": "db11", "run_key": "k", "lease_ms": 1000}
    seeded = await _acquired(jobs, options)
    assert await jobs.fail(seeded.lease)

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=4, open=False, kwargs={"application_name": "app-pool"}
    )
    await pool.open(wait=True)
    try:
        svc = JobSchedulerService(pool)
        try:
            async with pool.connection() as conn:
                assert not conn.autocommit
                cur = await conn.execute("SELECT now()")
                fetched = await cur.fetchone()
                assert fetched is not None
                txn_start: datetime = fetched[0]
                await asyncio.sleep(3)
                before_reclaim = await _db_now(pg_dsn)
                got = await _acquired(svc, options)
                right_after = await jobs.acquire(options)
                after_attempt = await _db_now(pg_dsn)
                row = await _row(pg_dsn, "db11", "k")
                await conn.rollback()
        finally:
            await svc.close()
    finally:
        await pool.close()

    written_after = row["modified_at"] - txn_start
    _report(
        f"DB-11: modified_at - caller_txn_start={written_after.total_seconds():.2f}s "
        f"two_owner_windows={int(right_after.acquired)}"
    )
    assert written_after >= timedelta(seconds=2.9), "lease timestamp from the caller's txn"
    if after_attempt - before_reclaim < timedelta(milliseconds=1000):
        # Both statements ran within one lease by the database clock: one owner only.
        assert not right_after.acquired, "a second owner right after the reclaim"
    assert row["owner_token"] == got.owner_token
    assert row["fencing_token"] == 2
    after_rollback = await _row(pg_dsn, "db11", "k")
    assert after_rollback["status"] == "RUNNING", "the acquire joined the caller's transaction"
    assert after_rollback["owner_token"] == got.owner_token


# --------------------------------------------------------------------------- DB-12


@pytest.mark.parametrize(
    ("owner_tz", "contender_tz"),
    [("Pacific/Kiritimati", "Etc/GMT+12"), ("Etc/GMT+12", "America/New_York")],
)
async def test_db12_replicas_in_different_session_time_zones(
    jobs: JobSchedulerService, pg_dsn: str, owner_tz: str, contender_tz: str
) -> None:
    """DB-12: the owner's and the contender's sessions default to time zones up to 26 h apart
    (ALTER DATABASE … SET timezone). Staleness is the same: no takeover before the lease by the
    database clock, and one after it."""
    db = _dbname(pg_dsn)
    lease_ms = 1500
    run_key = f"{owner_tz}>{contender_tz}"
    options = {"code": "db12", "run_key": run_key, "lease_ms": lease_ms}

    await _sql(ADMIN_DSN, f"ALTER DATABASE \"{db}\" SET timezone = '{owner_tz}'")
    assert (await _sql(pg_dsn, "SHOW timezone"))[0][0] == owner_tz
    async with JobSchedulerService.connect(
        pg_dsn, pool=PoolSettings(max_size=4, application_name="replica-a")
    ) as a:
        got = await _acquired(a, options)
    held = await _row(pg_dsn, "db12", run_key)

    await _sql(ADMIN_DSN, f"ALTER DATABASE \"{db}\" SET timezone = '{contender_tz}'")
    assert (await _sql(pg_dsn, "SHOW timezone"))[0][0] == contender_tz
    async with JobSchedulerService.connect(
        pg_dsn, pool=PoolSettings(max_size=4, application_name="replica-b")
    ) as b:
        early = await b.acquire(options)
        after_early = await _row(pg_dsn, "db12", run_key)
        refused = 0
        if isinstance(early, JobAcquired):
            won = early
        else:
            won, refused = await _acquire_until(b, options)
    row = await _row(pg_dsn, "db12", run_key)
    gap = row["modified_at"] - held["modified_at"]
    _report(
        f"DB-12 {owner_tz} -> {contender_tz}: failover_s={gap.total_seconds():.2f} "
        f"first_attempt_won={int(early.acquired)} "
        f"refused_attempts={refused + int(not early.acquired)}"
    )
    if after_early["now"] - held["modified_at"] < timedelta(milliseconds=lease_ms):
        assert not early.acquired, "taken over before the lease expired"
    assert won.fencing_token == 2
    assert won.owner_token != got.owner_token
    assert gap >= timedelta(milliseconds=lease_ms), f"taken over after only {gap}"

    # The row's age reads the same from sessions 26 h apart (timestamptz, not timestamp).
    ages = []
    for zone in (owner_tz, contender_tz):
        rows = await _sql(
            pg_dsn,
            "SELECT set_config('TimeZone', %s, false),"
            " extract(epoch FROM clock_timestamp() - modified_at)::float8"
            " FROM job_scheduler WHERE code = 'db12' AND run_key = %s",
            (zone, run_key),
        )
        ages.append(float(rows[0][1]))
    assert all(0 <= age < 600 for age in ages), f"row age by session zone: {ages}"


# --------------------------------------------------------------------------- LC-08


async def test_lc08_guessed_tokens_never_write(jobs: JobSchedulerService, pg_dsn: str) -> None:
    """LC-08/IV-16: heartbeat/complete/fail/release with random UUIDs, 2,000 calls: all False,
    the row is unchanged, and the audit trigger saw no write (G1)."""
    got = await _acquired(jobs, {"code": "lc08", "run_key": "k", "lease_ms": 60_000})
    await _sql(
        pg_dsn,
        """
CREATE TABLE lease_audit (
    seq bigserial PRIMARY KEY, op text, old_token uuid, new_token uuid,
    old_status text, new_status text, at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION lease_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease_audit (op, old_token, new_token, old_status, new_status)
    VALUES (TG_OP, OLD.owner_token, NEW.owner_token, OLD.status, NEW.status);
    RETURN NULL;
END $$;
CREATE TRIGGER lease_audit AFTER UPDATE OR DELETE ON job_scheduler
    FOR EACH ROW EXECUTE FUNCTION lease_audit();
""",
    )
    before = await _row(pg_dsn, "lc08", "k")
    rng = random.Random(20260720)  # reproducible guesses

    def guess() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    methods: list[tuple[str, Callable[[JobLease], Awaitable[bool]]]] = [
        ("heartbeat", jobs.heartbeat),
        ("complete", lambda lease: jobs.complete(lease, {"stolen": True})),
        ("fail", lambda lease: jobs.fail(lease, {"stolen": True})),
        ("release", jobs.release),
    ]
    accepted: Counter[str] = Counter()
    calls = 0
    for _ in range(500):
        batch = []
        for name, method in methods:
            variant = rng.randrange(3)
            fake = JobLease(
                id=got.id if variant == 0 else guess(),
                owner_token=got.owner_token if variant == 1 else guess(),
            )
            batch.append((name, method(fake)))
        results = await asyncio.gather(*(aw for _, aw in batch))
        calls += len(results)
        for (name, _), ok in zip(batch, results, strict=True):
            if ok is not False:
                accepted[name] += 1
    audit = (await _sql(pg_dsn, "SELECT count(*) FROM lease_audit"))[0][0]
    _report(f"LC-08: runs={calls} zombie_writes_accepted={sum(accepted.values())} audit={audit}")
    assert calls == 2000
    assert not accepted, f"guessed tokens were accepted: {dict(accepted)}"
    assert audit == 0
    after = await _row(pg_dsn, "lc08", "k")
    assert {k: v for k, v in after.items() if k != "now"} == {
        k: v for k, v in before.items() if k != "now"
    }
    # Positive control: the real token still works and the audit trigger does record writes.
    assert await jobs.heartbeat(got.lease) is True
    assert (await _sql(pg_dsn, "SELECT count(*) FROM lease_audit"))[0][0] == 1
    # Once finalized, even the real token writes nothing more.
    assert await jobs.fail(got.lease, {"done": True}) is True
    assert [
        await jobs.heartbeat(got.lease),
        await jobs.complete(got.lease),
        await jobs.fail(got.lease),
        await jobs.release(got.lease),
    ] == [False, False, False, False]
    assert (await _sql(pg_dsn, "SELECT count(*) FROM lease_audit"))[0][0] == 2


# --------------------------------------------------------------------------- lease loss


@contextlib.asynccontextmanager
async def _two_replicas(dsn: str) -> AsyncIterator[tuple[JobSchedulerService, JobSchedulerService]]:
    async with (
        JobSchedulerService.connect(
            dsn, pool=PoolSettings(max_size=4, application_name="replica-a")
        ) as a,
        JobSchedulerService.connect(
            dsn, pool=PoolSettings(max_size=4, application_name="replica-b")
        ) as b,
    ):
        yield a, b


async def _settle(task: asyncio.Task[Any], guard_s: float) -> None:
    """Wait for ``task`` without cancelling it: a hang guard that cannot itself end the run
    (cancelling the awaiting test would cancel run_exclusive and hide a missing lease-loss
    cancellation)."""
    done, _ = await asyncio.wait({task}, timeout=guard_s)
    if not done:
        task.cancel()
        await asyncio.wait({task})
        pytest.fail(f"run_exclusive was still running after {guard_s} s")


def _heartbeat_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("sdcore-heartbeat")]


async def test_lease_loss_without_heartbeat_reclaimed_by_another_replica(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """LC-06/LC-09: A runs run_exclusive(lease 1.5 s, heartbeat off) with an fn that would
    outlive the lease. Nothing renews the lease, so A's own deadline timer cancels fn when the
    lease runs out on A's clock (before it can run out by the database clock) and A raises
    LostJobLeaseError; B takes the row over (a higher fencing token) only after A gave up, and
    keeps it."""
    lease_ms = 1500
    options = {"code": "loss", "run_key": "no-heartbeat", "lease_ms": lease_ms, "heartbeat_ms": 0}
    started = asyncio.Event()
    seen: dict[str, Any] = {}

    async def work(lease: JobExecutionLease) -> str:
        seen["lease"] = lease
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen["cancelled_at"] = time.monotonic()
            raise
        seen["finished"] = True
        return "done"

    async with _two_replicas(pg_dsn) as (a, b):
        begun = time.monotonic()
        running = asyncio.create_task(a.run_exclusive(options, work))
        async with asyncio.timeout(20):
            await started.wait()
        held = await _row(pg_dsn, "loss", "no-heartbeat")
        early = await b.acquire(options)
        after_early = await _row(pg_dsn, "loss", "no-heartbeat")
        if isinstance(early, JobAcquired):
            won = early
        else:
            won, _ = await _acquire_until(b, options)
        won_at = time.monotonic()
        await _settle(running, 30)
        with pytest.raises(LostJobLeaseError, match="ran out on the client"):
            running.result()
        row = await _row(pg_dsn, "loss", "no-heartbeat")
        assert await b.heartbeat(won.lease) is True

    gap = row["modified_at"] - held["modified_at"]
    _report(
        f"lease-loss(no heartbeat): failover_s={gap.total_seconds():.2f} "
        f"owner_cancelled_s={seen['cancelled_at'] - begun:.2f} "
        f"zombie_writes_accepted={int(row['owner_token'] != won.owner_token)}"
    )
    if after_early["now"] - held["modified_at"] < timedelta(milliseconds=lease_ms):
        assert not early.acquired, "taken over before the lease expired"
    assert won.fencing_token > seen["lease"].fencing_token
    assert won.owner_token != seen["lease"].owner_token
    assert "finished" not in seen
    assert seen["cancelled_at"] < won_at, "the owner still ran when another replica took over"
    assert seen["cancelled_at"] - begun < lease_ms / 1000
    assert row["status"] == "RUNNING"
    assert row["owner_token"] == won.owner_token
    assert row["fencing_token"] == won.fencing_token
    assert row["data"] is None
    assert not seen["lease"].is_held


async def test_lease_loss_seen_by_heartbeat_cancels_fn(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """LC-10: an operator marks A's running row FAIL and B acquires it. A's next heartbeat is
    refused; A's async fn is cancelled (it never reaches its end) and run_exclusive raises
    LostJobLeaseError; B's row is untouched by A; no heartbeat task is left behind."""
    options = {"code": "loss", "run_key": "heartbeat", "lease_ms": 3000}
    started = asyncio.Event()
    flags: dict[str, Any] = {"cancelled": False, "finished": False}

    async def work(lease: JobExecutionLease) -> str:
        flags["lease"] = lease
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            flags["cancelled"] = True
            raise
        flags["finished"] = True
        return "done"

    async with _two_replicas(pg_dsn) as (a, b):
        running = asyncio.create_task(a.run_exclusive(options, work))
        async with asyncio.timeout(20):
            await started.wait()
        await _sql(
            pg_dsn,
            "UPDATE job_scheduler SET status = 'FAIL', data = '{\"operator\": true}'"
            " WHERE code = 'loss' AND run_key = 'heartbeat'",
        )
        won = await _acquired(b, options)
        await _settle(running, 20)  # fn sleeps 60 s: only the lease-loss cancellation ends it
        with pytest.raises(LostJobLeaseError) as raised:
            running.result()
        row = await _row(pg_dsn, "loss", "heartbeat")
        leftover = _heartbeat_tasks()
        assert await b.heartbeat(won.lease) is True

    _report(
        f"lease-loss(heartbeat): fn_cancelled={flags['cancelled']} "
        f"fn_finished={flags['finished']} reason={raised.value.reason!r}"
    )
    assert flags["cancelled"] is True
    assert flags["finished"] is False
    assert not flags["lease"].is_held
    assert won.fencing_token == 2
    assert row["status"] == "RUNNING"
    assert row["owner_token"] == won.owner_token
    assert row["fencing_token"] == 2
    assert row["data"] is None, "A's finalize must have been refused"
    assert leftover == []


# --------------------------------------------------------------------------- pool exhaustion


async def test_ensure_schema_after_lease_traffic_on_a_fully_held_pool(pg_dsn: str) -> None:
    """DB-15 neighbourhood: the service keeps up to ``max_connections`` (default: the pool's
    max_size) connections checked out for lease statements. After enough concurrent lease
    traffic every pool slot is held, and ``ensure_schema()`` — documented as idempotent, e.g.
    called again by a second component at start-up — must still work rather than wait for a
    pool connection that never comes back (psycopg_pool's 30 s timeout, then an error)."""
    async with JobSchedulerService.connect(
        pg_dsn, pool=PoolSettings(max_size=4, application_name="sdcore-held")
    ) as svc:
        await svc.ensure_schema()
        results = await asyncio.gather(
            *(svc.acquire({"code": "held", "run_key": f"k{i}"}) for i in range(8))
        )
        assert all(r.acquired for r in results)
        stats = svc.pool.get_stats()
        _report(f"pool after lease traffic: {stats}")
        bootstrap = asyncio.ensure_future(svc.ensure_schema())
        done, _ = await asyncio.wait({bootstrap}, timeout=10)  # a hang guard
        if not done:
            bootstrap.cancel()
            await asyncio.wait({bootstrap})
            pytest.fail(
                "ensure_schema() is still waiting for a pool connection after 10 s: the service's "
                f"held lease connections occupy the whole pool ({stats})"
            )
        bootstrap.result()
