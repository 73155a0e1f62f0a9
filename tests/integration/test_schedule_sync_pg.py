"""Which schedules reach the control plane, on PostgreSQL: names taken over from removed rows,
schedules added and removed while running, code schedules dropped from the code, the day rule and
an interval's zone, a long schema's NOTIFY channel, and every live version during a deploy."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from sdcore.cli._control_output import emit_schedules
from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import (
    InvalidScheduleError,
    PostgresScheduleStore,
    ScheduleAdmin,
    ScheduleControl,
    ScheduleControlError,
    Scheduler,
    ScheduleState,
    Tick,
)
from sdcore.scheduling._cron import CronSpec, DayRule, load_zone
from sdcore.scheduling._triggers import cron_trigger, expected_instants
from tests.integration._schedule_pg import schedule_pool
from tests.integration._schedule_pg import until as _until

ROOT = Path(__file__).resolve().parents[2]
HOUR_MS = 3_600_000


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with schedule_pool(pg_dsn) as pool:
        yield pool


async def _state(admin: ScheduleAdmin, name: str) -> ScheduleState | None:
    return {s.name: s for s in await admin.list_schedules()}.get(name)


def _noop(tick: Tick) -> None:
    return None


def _replica(
    pool: AsyncConnectionPool[Any], *, pid: int, store: PostgresScheduleStore | None = None
) -> tuple[Scheduler, ScheduleControl]:
    scheduler = Scheduler(jobs=JobSchedulerService(pool, max_connections=2))
    control = ScheduleControl(
        scheduler, store or PostgresScheduleStore(pool), poll_interval_ms=100, pid=pid
    )
    return scheduler, control


async def test_a_code_schedule_takes_over_the_name_of_a_removed_stored_one(
    pool: AsyncConnectionPool[Any],
) -> None:
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    release1, control1 = _replica(pool, pid=1)

    @release1.handler("send")
    def send(tick: Tick, args: dict[str, Any]) -> None:
        return None

    async with control1:
        await admin.create("nightly", handler="send", every_ms=HOUR_MS, actor="ops")
        await admin.remove("nightly", actor="ops")
    release2, control2 = _replica(pool, pid=2)
    release2.add_interval("nightly", HOUR_MS, _noop)
    async with control2, release2:
        state = await _state(admin, "nightly")
        assert state is not None, "the code schedule is listed"
        assert (state.origin, len(state.replicas), state.handler) == ("code", 1, None)
        assert state.next_fire_at is not None
        await admin.pause("nightly", actor="ops", reason="INC-1")

        async def held() -> bool:
            return control2.paused("nightly")

        await _until(held)
    row = await admin.store.row("nightly")
    assert row is not None
    assert (row.origin, row.removed_at, row.paused) == ("code", None, True)


async def test_schedules_added_and_removed_while_running_reach_the_control_plane(
    pool: AsyncConnectionPool[Any],
) -> None:
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    scheduler, control = _replica(pool, pid=3)
    scheduler.add_interval("hourly", HOUR_MS, _noop)
    async with control, scheduler:
        scheduler.add_interval("tenant-42", HOUR_MS, _noop)

        async def declared() -> bool:
            state = await _state(admin, "tenant-42")
            return state is not None and len(state.replicas) == 1

        await _until(declared)
        await admin.pause("tenant-42", actor="ops")

        async def held() -> bool:
            return control.paused("tenant-42")

        await _until(held)
        scheduler.remove("tenant-42")

        async def undeclared() -> bool:
            state = await _state(admin, "tenant-42")
            return state is not None and state.undeclared

        await _until(undeclared)
        state = await _state(admin, "tenant-42")
        assert state is not None
        assert state.next_fire_at is None
        hourly = await _state(admin, "hourly")
        assert hourly is not None
        assert len(hourly.replicas) == 1, "the other declarations are kept"


async def test_a_schedule_dropped_from_the_code_is_undeclared_and_its_name_free(
    pool: AsyncConnectionPool[Any],
) -> None:
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    old, old_control = _replica(pool, pid=4)
    old.add_interval("old-report", HOUR_MS, _noop)
    old.add_interval("old-export", HOUR_MS, _noop)
    async with old_control:
        pass
    new, new_control = _replica(pool, pid=5)
    new.add_interval("kept", HOUR_MS, _noop)

    @new.handler("report")
    def report(tick: Tick, args: dict[str, Any]) -> None:
        return None

    async with new_control:
        state = await _state(admin, "old-report")
        assert state is not None
        assert state.next_fire_at is None
        assert state.undeclared
        kept = await _state(admin, "kept")
        assert kept is not None
        assert not kept.undeclared
        with pytest.raises(ScheduleControlError, match="declared in code by a running replica"):
            await admin.remove("kept", actor="ops")
        await admin.create("old-report", handler="report", every_ms=HOUR_MS, actor="ops")
        state = await _state(admin, "old-report")
        assert state is not None
        assert (state.origin, state.handler) == ("stored", "report")

        async def running_it() -> bool:
            state = await _state(admin, "old-report")
            return state is not None and len(state.replicas) == 1

        await _until(running_it)
        await admin.remove("old-export", actor="ops")
        assert await _state(admin, "old-export") is None
    # A replica that still declares a removed code schedule takes its name back.
    back, back_control = _replica(pool, pid=6)
    back.add_interval("old-export", HOUR_MS, _noop)
    async with back_control:
        state = await _state(admin, "old-export")
        assert state is not None
        assert (state.origin, state.undeclared) == ("code", False)


async def test_removing_a_code_row_a_replica_still_declares_is_taken_back(
    pool: AsyncConnectionPool[Any],
) -> None:
    store = PostgresScheduleStore(pool, live_ms=500)
    admin = ScheduleAdmin(store)
    scheduler = Scheduler(jobs=JobSchedulerService(pool, max_connections=2))
    scheduler.add_interval("sticky", HOUR_MS, _noop)
    # Heartbeats far apart: the replica looks dead to the admin, which then removes the row.
    control = ScheduleControl(scheduler, store, poll_interval_ms=100, heartbeat_ms=60_000)
    async with control:
        await asyncio.sleep(0.7)
        await admin.remove("sticky", actor="ops")

        async def back() -> bool:
            row = await store.row("sticky")
            return row is not None and row.removed_at is None

        await _until(back)


async def test_day_rule_is_synced_listed_fingerprinted_and_backfilled(
    pool: AsyncConnectionPool[Any],
) -> None:
    expression = "0 0 */10 * 0"
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    scheduler, control = _replica(pool, pid=7)
    scheduler.add_cron("report", expression, _noop, day_rule="nestjs")
    other, other_control = _replica(pool, pid=8)
    other.add_cron("report", expression, _noop)  # the same expression, the Vixie rule
    async with control, scheduler:
        mine = scheduler.get("report").next_fire_at
        state = await _state(admin, "report")
        assert state is not None
        assert state.next_fire_at == mine
        assert state.day_rule == "nestjs"
        # The last Sunday that is not the 1st, 11th, 21st or 31st: a NestJS tick only.
        utc = load_zone("UTC")
        nestjs = cron_trigger(CronSpec.parse(expression, utc, day_rule=DayRule.NESTJS))
        vixie = cron_trigger(CronSpec.parse(expression, utc))
        now = datetime.now(UTC)
        ticks = expected_instants(nestjs, now - timedelta(days=60), now, limit=100)
        only = [
            t for t in ticks if not expected_instants(vixie, t, t + timedelta(seconds=1), limit=1)
        ]
        sunday = only[-1]
        action = await admin.backfill("report", sunday, sunday, actor="ops")
        assert action.params["ticks"] == 1
        async with other_control:
            state = await _state(admin, "report")
            assert state is not None
            assert state.versions == 2, "the day rule is part of the definition"
            rules = sorted(v.day_rule or "" for v in state.live_versions)
            assert rules == ["nestjs", "vixie"]


async def test_a_stored_interval_gets_its_zone_and_a_bad_zone_is_refused(
    pool: AsyncConnectionPool[Any],
) -> None:
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    scheduler, control = _replica(pool, pid=9)
    zones: list[str] = []

    @scheduler.handler("digest")
    def digest(tick: Tick, args: dict[str, Any]) -> None:
        zones.append(str(tick.local_time.tzinfo))

    async with control, scheduler:
        with pytest.raises(InvalidScheduleError, match="unknown time zone 'Mars/Base'"):
            await admin.create(
                "digest-mars", handler="digest", every_ms=200, time_zone="Mars/Base", actor="ops"
            )
        assert await admin.store.row("digest-mars") is None
        await admin.create(
            "digest-tokyo", handler="digest", every_ms=200, time_zone="Asia/Tokyo", actor="ops"
        )

        async def ran() -> bool:
            return bool(zones)

        await _until(ran)
    assert set(zones) == {"Asia/Tokyo"}


def test_cli_refuses_an_unknown_zone_for_an_interval(pg_dsn: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdcore.cli",
            "schedules",
            "create",
            "digest-mars",
            "--handler",
            "digest",
            "--every-ms",
            "1000",
            "--time-zone",
            "Mars/Base",
            "--database-url",
            pg_dsn,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "unknown time zone 'Mars/Base'" in done.stderr


async def test_a_long_schema_name_keeps_control_writes_and_notifications_working(
    pg_dsn: str,
) -> None:
    schema = "billing_service_production_eu_west_1_tenant_" + uuid.uuid4().hex[:6]
    assert len(schema) == 50
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=6, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True)
    try:
        async with pool.connection() as conn:
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        jobs = JobSchedulerService(pool, schema=schema, max_connections=2)
        await jobs.ensure_schema()
        store = PostgresScheduleStore(pool, schema=schema)
        await store.ensure_schema()
        scheduler = Scheduler(jobs=jobs)
        scheduler.add_interval("beat", HOUR_MS, _noop)
        # Polls an hour apart: only the notification can bring the pause in time.
        control = ScheduleControl(scheduler, store, poll_interval_ms=HOUR_MS)
        admin = ScheduleAdmin(PostgresScheduleStore(pool, schema=schema))
        async with control, scheduler:
            await asyncio.sleep(0.5)  # LISTEN in effect
            await admin.pause("beat", actor="ops")

            async def held() -> bool:
                return control.paused("beat")

            await _until(held)
        await jobs.close()
        assert len(store.channel.encode()) <= 63
        assert store.channel.startswith(schema[:40])
    finally:
        await pool.close()


async def test_every_live_version_is_listed_with_its_replicas(
    pool: AsyncConnectionPool[Any],
) -> None:
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    old, old_control = _replica(pool, pid=10)
    old.add_cron("report", "0 * * * *", _noop)
    new, new_control = _replica(pool, pid=11)
    new.add_cron("report", "*/5 * * * *", _noop, time_zone="Europe/Berlin")
    async with old_control, new_control:
        state = await _state(admin, "report")
        assert state is not None
        assert state.versions == 2
        by_expression = {v.expression: v for v in state.live_versions}
        assert set(by_expression) == {"0 * * * *", "*/5 * * * *"}
        assert len(by_expression["0 * * * *"].replicas) == 1
        assert by_expression["0 * * * *"].replicas != by_expression["*/5 * * * *"].replicas
        assert by_expression["*/5 * * * *"].time_zone == "Europe/Berlin"
        now = datetime.now(UTC)
        hourly = by_expression["0 * * * *"].next_fire_at
        assert hourly is not None
        assert hourly.minute == 0
        assert hourly - now <= timedelta(hours=1)
        five = by_expression["*/5 * * * *"].next_fire_at
        assert five is not None
        assert five.minute % 5 == 0
        assert five - now <= timedelta(minutes=5)
        lines: list[str] = []
        emit_schedules([state], lines.append, as_json=False)
        text = "\n".join(lines)
        assert "report: 2 versions live" in text
        assert "0 * * * *" in text
        assert "*/5 * * * *" in text
        for version in state.live_versions:
            assert version.replicas[0] in text
        lines.clear()
        emit_schedules([state], lines.append, as_json=True)
        shown = json.loads(lines[0])
        assert sorted(v["expression"] for v in shown["live_versions"]) == [
            "*/5 * * * *",
            "0 * * * *",
        ]
        assert all(v["next_fire_at"] and v["replicas"] for v in shown["live_versions"])
        # The old replica restarts (its sync moves the row back to its definition): both
        # definitions are still known.
        await old_control.aclose()
        await old_control.start()
        state = await _state(admin, "report")
        assert state is not None
        assert state.expression == "0 * * * *"
        assert {v.expression: v.time_zone for v in state.live_versions} == {
            "0 * * * *": "UTC",
            "*/5 * * * *": "Europe/Berlin",
        }


async def test_the_dashboard_lists_the_day_rule_and_undeclared_schedules(
    pool: AsyncConnectionPool[Any],
) -> None:
    from sdcore.dashboard._data import DashboardData

    store = PostgresScheduleStore(pool)
    data = DashboardData(pool, store=store)
    gone, gone_control = _replica(pool, pid=12)
    gone.add_interval("dropped", HOUR_MS, _noop)
    async with gone_control:
        pass
    scheduler, control = _replica(pool, pid=13)
    scheduler.add_cron("report", "0 0 */10 * 0", _noop, day_rule="nestjs")
    async with control, scheduler:
        async with pool.connection() as conn:  # as if it had been declared for days
            await conn.execute(
                "UPDATE sdcore_schedules SET created_at = now() - interval '3 days' "
                "WHERE name = 'report'"
            )
        mine = scheduler.get("report").next_fire_at
        rows = {r.name: r for r in (await data.schedules()).rows}
        assert rows["report"].next_fire_at == mine
        assert rows["dropped"].next_fire_at is None
        # The last 24 hours expect the ticks of the NestJS reading (a Sunday's midnight too).
        now = datetime.now(UTC)
        utc = load_zone("UTC")
        nestjs = cron_trigger(CronSpec.parse("0 0 */10 * 0", utc, day_rule=DayRule.NESTJS))
        start = rows["report"].timeline[0].start
        expected = expected_instants(nestjs, start, now, limit=100)
        assert sum(b.expected for b in rows["report"].timeline) == len(expected)


async def test_a_create_racing_a_replica_declaring_the_name_is_refused(
    pool: AsyncConnectionPool[Any],
) -> None:
    # A replica's sync and an operator's create of the same undeclared code name race: the
    # create must see the declaration the sync commits (and be refused), not take the name over
    # while that replica goes on running its code schedule under it.
    store = PostgresScheduleStore(pool)
    admin = ScheduleAdmin(store)
    gone, gone_control = _replica(pool, pid=11)
    gone.add_interval("report", HOUR_MS, _noop)
    async with gone_control:
        pass
    digest, digest_control = _replica(pool, pid=12)

    @digest.handler("digest")
    def run_digest(tick: Tick, args: dict[str, Any]) -> None:
        return None

    back, back_control = _replica(pool, pid=13)
    back.add_interval("report", HOUR_MS, _noop)
    declarations = sql.Identifier(f"{store.table}_declarations")
    async with digest_control, pool.connection() as blocker:
        assert (await _state(admin, "report")) is not None
        # Hold the declarations table so the starting replica's sync stays in its transaction
        # after it read the row, as a slow sync would.
        await blocker.execute("BEGIN")
        await blocker.execute(sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(declarations))
        starting = asyncio.create_task(back_control.start())
        await asyncio.sleep(0.5)
        create = asyncio.create_task(
            admin.create("report", handler="digest", every_ms=HOUR_MS, actor="ops")
        )
        await asyncio.sleep(0.5)
        await blocker.execute("COMMIT")
        await starting
        try:
            with pytest.raises(ScheduleControlError, match="changed meanwhile"):
                await create
            row = await store.row("report")
            assert row is not None
            assert (row.origin, row.removed_at) == ("code", None)
        finally:
            await back_control.aclose()


class _WritesBetweenReads(PostgresScheduleStore):
    """A replica's store that lets operator writes commit between a poll's read of the rows and
    its read of the open actions (a poll that started just before an update and a trigger)."""

    between: Callable[[], Awaitable[None]] | None = None

    async def changes(self) -> Any:
        # Say an action is open, so that the poll reads the open actions even when none was
        # open at its start (the writes commit after this read).
        return replace(await super().changes(), actions_open=True)

    async def open_actions(self, names: Any) -> Any:
        between, self.between = self.between, None
        if between is not None:
            await between()
        return await super().open_actions(names)


async def test_a_trigger_after_an_update_runs_the_updated_schedule(
    pool: AsyncConnectionPool[Any],
) -> None:
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    store = _WritesBetweenReads(pool)
    scheduler, control = _replica(pool, pid=21, store=store)
    runs: list[tuple[str, dict[str, Any]]] = []

    @scheduler.handler("send-digest")
    def send(tick: Tick, args: dict[str, Any]) -> None:
        runs.append((tick.run_key or "", args))

    async with control, scheduler:
        await admin.create(
            "digest",
            handler="send-digest",
            every_ms=HOUR_MS,
            args={"customer": "acme"},
            actor="ops",
        )

        async def applied() -> bool:
            state = await _state(admin, "digest")
            return state is not None and len(state.replicas) == 1

        await _until(applied)
        triggered: list[int] = []

        async def update_then_trigger() -> None:
            await admin.update("digest", args={"customer": "globex"}, actor="ops")
            triggered.append((await admin.trigger("digest", actor="ops")).id)

        store.between = update_then_trigger

        async def ran() -> bool:
            return bool(runs)

        await _until(ran)
        assert runs == [(f"trigger:{triggered[0]}", {"customer": "globex"})]


async def test_a_replica_stops_a_stored_schedule_whose_name_code_took_back(
    pool: AsyncConnectionPool[Any],
) -> None:
    # Moving a stored schedule into the code: the operator removes it and a release declaring it
    # starts. A replica that polls only after the code took the name over reads a code row, never
    # the removal: it must stop the stored schedule all the same, not run it next to the code one.
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    old = Scheduler(jobs=JobSchedulerService(pool, max_connections=2))
    old_control = ScheduleControl(
        old, PostgresScheduleStore(pool), poll_interval_ms=1_500, listen=False, pid=31
    )
    stored_runs: list[str] = []

    @old.handler("send")
    def send(tick: Tick, args: dict[str, Any]) -> None:
        stored_runs.append(tick.run_key or "")

    async with old_control, old:
        await admin.create("nightly", handler="send", every_ms=200, actor="ops")

        async def running() -> bool:
            return len(stored_runs) >= 2

        await _until(running)
        await admin.remove("nightly", actor="ops")
        new, new_control = _replica(pool, pid=32)
        new.add_interval("nightly", HOUR_MS, _noop)
        async with new_control:
            row = await admin.store.row("nightly")
            assert row is not None
            assert (row.origin, row.removed_at) == ("code", None)
            await asyncio.sleep(2.0)  # the old replica has polled since
            before = len(stored_runs)
            await asyncio.sleep(1.0)
            assert len(stored_runs) == before, "the removed stored schedule still runs"
            state = await _state(admin, "nightly")
            assert state is not None
            assert state.replicas == (f"{new_control.replica.host}:32",)
