"""``sdcore schedules`` control commands as an operator runs them (a real CLI process) against a
replica running in the test: refusals that name the problem, idempotent triggers, patch updates,
backfills of ticks that already succeeded."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import (
    PostgresScheduleStore,
    ScheduleAdmin,
    ScheduleControl,
    Scheduler,
    Tick,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


@dataclass(frozen=True, slots=True)
class Done:
    code: int
    out: str
    err: str


@dataclass(slots=True)
class Replica:
    dsn: str
    admin: ScheduleAdmin
    control: ScheduleControl
    scheduler: Scheduler
    runs: list[tuple[str, str | None, dict[str, Any] | None]] = field(default_factory=list)

    async def cli(self, *args: str, dsn: str | None = None) -> Done:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sdcore.cli",
            *args,
            cwd=ROOT,
            env={**os.environ, "DATABASE_URL": dsn or self.dsn},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode is not None
        return Done(process.returncode, out.decode(), err.decode())

    def keys(self, schedule: str) -> list[str | None]:
        return [key for name, key, _ in self.runs if name == schedule]


async def until(predicate: Callable[[], Any], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@asynccontextmanager
async def replica(
    dsn: str, declare: Callable[[Scheduler, Replica], None] | None = None
) -> AsyncIterator[Replica]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=8, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True)
    jobs = JobSchedulerService(pool, max_connections=3)
    await jobs.ensure_schema()
    store = PostgresScheduleStore(pool)
    await store.ensure_schema()
    scheduler = Scheduler(jobs=jobs, lease_ms=3_000)
    control = ScheduleControl(scheduler, store, poll_interval_ms=100)
    r = Replica(dsn=dsn, admin=ScheduleAdmin(store), control=control, scheduler=scheduler)

    @scheduler.handler("send-digest")
    async def send_digest(tick: Tick, args: dict[str, Any]) -> None:
        r.runs.append((tick.schedule, tick.run_key, args))

    if declare is not None:
        declare(scheduler, r)
    try:
        async with control, scheduler:
            yield r
    finally:
        await jobs.close()
        await pool.close()


def _beat(scheduler: Scheduler, r: Replica) -> None:
    async def beat(tick: Tick) -> None:
        r.runs.append((tick.schedule, tick.run_key, None))

    scheduler.add_interval("beat", 3_600_000, beat)
    scheduler.add_interval("plain", 3_600_000, beat, exclusive=False)


async def test_refusals_name_the_problem(pg_dsn: str) -> None:
    async with replica(pg_dsn, _beat) as r:
        year1 = await r.cli(
            "schedules",
            "backfill",
            "beat",
            "--from",
            "0001-01-01T00:00:00Z",
            "--to",
            "0001-01-02T00:00:00Z",
        )
        assert year1.code == 1, year1
        assert "--from 0001-01-01T00:00:00+00:00 is out of range" in year1.err
        assert "bug" not in year1.err
        shifted = await r.cli(
            "schedules",
            "backfill",
            "beat",
            "--from",
            "0001-01-01T00:00:00+01:00",
            "--to",
            "0001-01-02T00:00:00Z",
        )
        assert shifted.code == 2, shifted
        assert "'0001-01-01T00:00:00+01:00' is out of range" in shifted.err
        assert "bug" not in shifted.err
        plain = await r.cli(
            "schedules",
            "backfill",
            "plain",
            "--from",
            "2026-01-01T00:00:00Z",
            "--to",
            "2026-01-01T01:00:00Z",
        )
        assert plain.code == 1, plain
        assert "can be backfilled" in plain.err
        assert "triggered" not in plain.err
        assert "can be triggered" in (await r.cli("schedules", "trigger", "plain")).err

        await r.admin.create("gone", handler="send-digest", every_ms=200, actor="ops")
        await until(lambda: r.keys("gone"))
        await until(lambda: r.admin.history("gone"))
        await r.admin.remove("gone", actor="ops")
        history = await r.cli("schedules", "history", "gone")
        assert history.code == 0, history
        assert "SUCCESS" in history.out
        unknown = await r.cli("schedules", "history", "never-was")
        assert unknown.code == 1
        assert "no such schedule" in unknown.err
        assert "nothing changed" not in unknown.err


async def test_update_changes_only_what_it_is_given(pg_dsn: str) -> None:
    import json

    async with replica(pg_dsn) as r:
        created = await r.cli(
            "schedules",
            "create",
            "digest-acme",
            "--handler",
            "send-digest",
            "--cron",
            "0 8 * * *",
            "--time-zone",
            "Europe/Berlin",
            "--args",
            '{"customer": "acme"}',
            "--option",
            "retries=2",
        )
        assert created.code == 0, created
        # The how-to's update: only the time changes.
        moved = await r.cli("schedules", "update", "digest-acme", "--cron", "30 7 * * *")
        assert moved.code == 0, moved
        row = await r.admin.store.row("digest-acme")
        assert row is not None
        assert (row.expression, row.time_zone, row.options["retries"]) == (
            "30 7 * * *",
            "Europe/Berlin",
            2,
        )
        assert row.args == {"customer": "acme"}
        log = await r.admin.actions("digest-acme", limit=1)
        assert log[0].params["previous"]["expression"] == "0 8 * * *"
        assert log[0].params["options"]["retries"] == 2
        assert log[0].params["args"] == {"customer": "acme"}

        # Operators A and B read the same version; A's edit lands, B's stale one is refused.
        listed = await r.cli("schedules", "list", "--json")
        seen = next(json.loads(line) for line in listed.out.splitlines() if '"digest-acme"' in line)
        assert seen["version"] == row.revision
        assert "VERSION" in (await r.cli("schedules", "list")).out
        version = str(seen["version"])
        a = await r.cli(
            "schedules",
            "update",
            "digest-acme",
            "--cron",
            "0 7 * * *",
            "--expected-version",
            version,
        )
        assert a.code == 0, a
        b = await r.cli(
            "schedules",
            "update",
            "digest-acme",
            "--args",
            '{"customer": "acme", "lang": "de"}',
            "--expected-version",
            version,
        )
        assert b.code == 1, b
        assert f"version {version} is stale" in b.err
        row = await r.admin.store.row("digest-acme")
        assert row is not None
        assert (row.expression, row.args) == ("0 7 * * *", {"customer": "acme"})
        # Only given options change; giving both timings is refused.
        await r.cli("schedules", "update", "digest-acme", "--option", "catch_up=latest")
        row = await r.admin.store.row("digest-acme")
        assert row is not None
        assert (row.options["catch_up"], row.options["retries"]) == ("latest", 2)
        both = await r.cli(
            "schedules", "update", "digest-acme", "--cron", "0 7 * * *", "--every-ms", "1000"
        )
        assert both.code == 2, both
        nothing = await r.cli("schedules", "update", "digest-acme")
        assert nothing.code == 1, nothing
        assert "at least one field" in nothing.err


async def test_backfill_says_what_already_succeeded_and_can_rerun_it(pg_dsn: str) -> None:
    from datetime import datetime

    def invoices(scheduler: Scheduler, r: Replica) -> None:
        async def send(tick: Tick) -> None:
            r.runs.append((tick.schedule, tick.run_key, None))

        scheduler.add_interval("send-invoices", 1_000, send)

    async with replica(pg_dsn, invoices) as r:
        # The "spoiled" ticks: they ran with SUCCESS (and sent wrong amounts).
        await until(lambda: len(r.keys("send-invoices")) >= 4)
        spoiled = sorted(k for k in r.keys("send-invoices") if k is not None)[:3]

        async def succeeded() -> bool:
            async with r.control.store.pool.connection() as conn:  # type: ignore[attr-defined]
                cur = await conn.execute(
                    "SELECT count(*) FROM job_scheduler WHERE code = 'send-invoices'"
                    " AND run_key = ANY(%s) AND status = 'SUCCESS'",
                    (spoiled,),
                )
                found = await cur.fetchone()
            return found is not None and found[0] == 3

        await until(succeeded)
        window = ["--from", spoiled[0], "--to", spoiled[-1]]
        plain = await r.cli("schedules", "backfill", "send-invoices", *window, "--wait")
        assert plain.code == 0, plain
        assert "3 already succeeded (not re-run)" in plain.out
        assert "finished: SUCCESS" in plain.out
        assert sorted(k for k in r.keys("send-invoices") if k in spoiled) == spoiled
        rerun = await r.cli(
            "schedules", "backfill", "send-invoices", *window, "--rerun-succeeded", "--wait"
        )
        assert rerun.code == 0, rerun
        assert "those that succeeded run again" in rerun.out
        assert "3 had succeeded (re-run)" in rerun.out
        actions = await r.admin.actions("send-invoices", limit=1)
        prefix = f"backfill:{actions[0].id}:"
        again = sorted(k for k in r.keys("send-invoices") if k and k.startswith(prefix))
        assert again == [prefix + k for k in spoiled]
        history = await r.admin.history("send-invoices", limit=100)
        assert {h.source for h in history if h.run_key.startswith(prefix)} == {"backfill"}
        assert {h.scheduled_at for h in history if h.run_key.startswith(prefix)} == {
            datetime.fromisoformat(k.replace("Z", "+00:00")) for k in spoiled
        }
        log = await r.cli("schedules", "log", "send-invoices")
        assert "3 had succeeded (re-run)" in log.out
        assert "3 already succeeded (not re-run)" in log.out


async def test_update_of_the_lease_alone_re_derives_the_default_heartbeat(pg_dsn: str) -> None:
    import json

    # A schedule created with the default timing records the heartbeat derived from its lease;
    # shortening the lease must derive it again (as create does), not keep the old one and
    # refuse. A heartbeat the operator chose stays, and a lease too short for it is refused.
    async with replica(pg_dsn) as r:
        created = await r.cli(
            "schedules", "create", "digest-acme", "--handler", "send-digest", "--every-ms", "60000"
        )
        assert created.code == 0, created
        shorter = await r.cli("schedules", "update", "digest-acme", "--option", "lease_ms=30000")
        assert shorter.code == 0, shorter
        row = await r.admin.store.row("digest-acme")
        assert row is not None
        assert (row.options["lease_ms"], row.options["heartbeat_ms"]) == (30_000, 10_000)
        # The options an --option patch changes are listed, so an operator sees what stays.
        listed = await r.cli("schedules", "list", "--json")
        (seen,) = [json.loads(line) for line in listed.out.splitlines() if "digest-acme" in line]
        assert (seen["options"]["lease_ms"], seen["options"]["heartbeat_ms"]) == (30_000, 10_000)
        chosen = await r.cli("schedules", "update", "digest-acme", "--option", "heartbeat_ms=2000")
        assert chosen.code == 0, chosen
        longer = await r.cli("schedules", "update", "digest-acme", "--option", "lease_ms=90000")
        assert longer.code == 0, longer
        row = await r.admin.store.row("digest-acme")
        assert row is not None
        assert (row.options["lease_ms"], row.options["heartbeat_ms"]) == (90_000, 2_000)
        short = await r.cli("schedules", "update", "digest-acme", "--option", "lease_ms=3000")
        assert short.code == 1, short
        assert "heartbeat_ms" in short.err, short.err
        assert "2000" in short.err, short.err


async def test_update_of_a_row_an_older_version_stored_non_exclusive(pg_dsn: str) -> None:
    # Before stored schedules were forced exclusive, `create --option exclusive=false` was
    # recorded as such. Patching such a row must make it exclusive, not refuse an option the
    # operator did not give ("exclusive=False is refused ... drop the option").
    async with replica(pg_dsn) as r:
        created = await r.cli(
            "schedules", "create", "digest-acme", "--handler", "send-digest", "--every-ms", "60000"
        )
        assert created.code == 0, created
        async with r.control.store.pool.connection() as conn:  # type: ignore[attr-defined]
            await conn.execute(
                "UPDATE sdcore_schedules SET options = options || '{\"exclusive\": false}'"
                " WHERE name = 'digest-acme'"
            )
        patched = await r.cli("schedules", "update", "digest-acme", "--option", "retries=1")
        assert patched.code == 0, patched
        row = await r.admin.store.row("digest-acme")
        assert row is not None
        assert (row.options["exclusive"], row.options["retries"]) == (True, 1)
