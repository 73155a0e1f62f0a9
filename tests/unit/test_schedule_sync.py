"""Which schedules reach the control plane, on the in-memory doubles (the same rules as
PostgreSQL): removed names taken over, schedules added while running, undeclared code schedules,
the day rule, an interval's zone, every live version, and the NOTIFY channel's length."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sdcore.cli._control_output import emit_schedules
from sdcore.scheduling import (
    InvalidScheduleError,
    ScheduleAdmin,
    ScheduleControl,
    ScheduleControlError,
    Scheduler,
    ScheduleState,
    Tick,
)
from sdcore.scheduling._control import fingerprint, row_trigger
from sdcore.scheduling._hooks import SchedulerHooks
from sdcore.scheduling._triggers import ScheduleKind
from sdcore.testing import MemoryJobScheduler, MemoryScheduleStore
from tests.unit._looptime import BASE, block_loop, in_loop_time

HOUR_MS = 3_600_000


def _noop(tick: Tick) -> None:
    return None


async def _until(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _state(admin: ScheduleAdmin, name: str) -> ScheduleState | None:
    return {s.name: s for s in await admin.list_schedules()}.get(name)


def _replica(
    jobs: MemoryJobScheduler, store: MemoryScheduleStore, pid: int
) -> tuple[Scheduler, ScheduleControl]:
    scheduler = Scheduler(jobs=jobs)
    return scheduler, ScheduleControl(scheduler, store, poll_interval_ms=20, pid=pid)


async def test_code_sync_takes_over_a_removed_stored_row() -> None:
    jobs = MemoryJobScheduler()
    store = MemoryScheduleStore(jobs)
    admin = ScheduleAdmin(store)
    first, first_control = _replica(jobs, store, 1)
    first.handler("send")(lambda tick, args: None)
    async with first_control:
        await admin.create("nightly", handler="send", every_ms=HOUR_MS, actor="ops")
        await admin.pause("nightly", actor="ops")
        await admin.remove("nightly", actor="ops")
    second, second_control = _replica(jobs, store, 2)
    second.add_interval("nightly", HOUR_MS, _noop)
    async with second_control:
        state = await _state(admin, "nightly")
        assert state is not None
        assert (state.origin, state.paused, state.handler) == ("code", False, None)
        await admin.pause("nightly", actor="ops")

        async def held() -> bool:
            return second_control.paused("nightly")

        await _until(held)


async def test_added_while_running_is_declared_and_removed_is_undeclared() -> None:
    jobs = MemoryJobScheduler()
    store = MemoryScheduleStore(jobs)
    admin = ScheduleAdmin(store)
    scheduler, control = _replica(jobs, store, 1)
    async with control, scheduler:
        scheduler.add_interval("tenant-42", HOUR_MS, _noop)

        async def declared() -> bool:
            return bool(await store.live_declarers("tenant-42") == 1)

        await _until(declared)
        await admin.pause("tenant-42", actor="ops")
        scheduler.remove("tenant-42")

        async def undeclared() -> bool:
            return bool(await store.live_declarers("tenant-42") == 0)

        await _until(undeclared)
        state = await _state(admin, "tenant-42")
        assert state is not None
        assert state.undeclared
    # Uninstalled with the control plane: later changes are not reported to it.
    scheduler.add_interval("late", HOUR_MS, _noop)
    assert await store.row("late") is None


async def test_an_undeclared_code_schedule_can_be_removed_or_taken_by_create() -> None:
    jobs = MemoryJobScheduler()
    store = MemoryScheduleStore(jobs)
    admin = ScheduleAdmin(store)
    old, old_control = _replica(jobs, store, 1)
    old.add_interval("old-report", HOUR_MS, _noop)
    old.add_interval("old-export", HOUR_MS, _noop)
    async with old_control:
        with pytest.raises(ScheduleControlError, match="declared in code by a running replica"):
            await admin.remove("old-report", actor="ops")
    new, new_control = _replica(jobs, store, 2)
    new.handler("report")(lambda tick, args: None)
    async with new_control:
        state = await _state(admin, "old-report")
        assert state is not None
        assert (state.undeclared, state.next_fire_at) == (True, None)
        await admin.create("old-report", handler="report", every_ms=HOUR_MS, actor="ops")
        row = await store.row("old-report")
        assert row is not None
        assert (row.origin, row.handler) == ("stored", "report")
        await admin.remove("old-export", actor="ops")
        assert await _state(admin, "old-export") is None


def test_the_day_rule_changes_the_fingerprint_only_when_not_vixie() -> None:
    options = {"exclusive": True}
    plain = fingerprint("cron", "0 0 */10 * 0", "UTC", options)
    assert fingerprint("cron", "0 0 */10 * 0", "UTC", options, day_rule="vixie") == plain
    assert fingerprint("cron", "0 0 */10 * 0", "UTC", options, day_rule="nestjs") != plain


async def test_the_day_rule_of_a_code_schedule_is_recorded_when_it_matters() -> None:
    jobs = MemoryJobScheduler()
    store = MemoryScheduleStore(jobs)
    scheduler, control = _replica(jobs, store, 1)
    scheduler.add_cron("differs", "0 0 */10 * 0", _noop, day_rule="nestjs")
    scheduler.add_cron("alike", "0 0 * * 0", _noop, day_rule="nestjs")  # one restricted field
    async with control:
        differs, alike = await store.row("differs"), await store.row("alike")
        assert differs is not None
        assert alike is not None
        assert (differs.day_rule, alike.day_rule) == ("nestjs", "vixie")


def test_an_interval_zone_is_checked() -> None:
    with pytest.raises(InvalidScheduleError, match="unknown time zone 'Mars/Base'"):
        row_trigger("digest", "interval", "1000", "Mars/Base")
    assert row_trigger("digest", "interval", "1000", "Asia/Tokyo") is not None


async def test_a_stored_interval_ticks_in_its_zone() -> None:
    jobs = MemoryJobScheduler()
    store = MemoryScheduleStore(jobs)
    admin = ScheduleAdmin(store)
    scheduler, control = _replica(jobs, store, 1)
    local: list[datetime] = []

    @scheduler.handler("digest")
    def digest(tick: Tick, args: dict[str, Any]) -> None:
        local.append(tick.local_time)

    async with control, scheduler:
        await admin.create(
            "digest-tokyo", handler="digest", every_ms=50, time_zone="Asia/Tokyo", actor="ops"
        )

        async def ran() -> bool:
            return bool(local)

        await _until(ran)
    assert str(local[0].tzinfo) == "Asia/Tokyo"
    assert local[0].utcoffset() is not None
    assert local[0].astimezone(UTC).utcoffset() != local[0].utcoffset()


async def test_every_live_version_is_listed_with_its_replicas_and_next_fire() -> None:
    jobs = MemoryJobScheduler()
    store = MemoryScheduleStore(jobs)
    admin = ScheduleAdmin(store)
    old, old_control = _replica(jobs, store, 1)
    old.add_interval("report", HOUR_MS, _noop)
    new, new_control = _replica(jobs, store, 2)
    new.add_interval("report", 60_000, _noop)
    async with old_control, new_control:
        state = await _state(admin, "report")
        assert state is not None
        assert state.versions == 2
        shown = {v.expression: v for v in state.live_versions}
        assert set(shown) == {str(HOUR_MS), "60000"}
        assert {v.replicas for v in shown.values()} == {
            (f"{old_control.replica.host}:1",),
            (f"{new_control.replica.host}:2",),
        }
        assert all(v.next_fire_at is not None for v in shown.values())
        lines: list[str] = []
        emit_schedules([state], lines.append, as_json=False)
        assert any("2 versions live" in line for line in lines)
        assert any("every 60000 ms" in line and ":2" in line for line in lines)
        assert any(f"every {HOUR_MS} ms" in line and ":1" in line for line in lines)
        lines.clear()
        emit_schedules([state], lines.append, as_json=True)
        assert len(json.loads(lines[0])["live_versions"]) == 2


@pytest.mark.parametrize(
    ("schema", "table"),
    [
        (None, "sdcore_schedules"),
        ("billing", "sdcore_schedules"),
        ("billing_service_production_eu_west_1_tenant_acme01", "sdcore_schedules"),
        ("é" * 40, "sdcore_schedules"),
    ],
    ids=["bare", "short-schema", "long-schema", "multibyte"],
)
def test_the_notify_channel_fits_in_63_bytes(schema: str | None, table: str) -> None:
    from sdcore.scheduling._pg_store import notify_channel

    channel = notify_channel(table, schema)
    full = table if schema is None else f"{schema}.{table}"
    assert len(channel.encode("utf-8")) <= 63
    if len(full.encode("utf-8")) <= 63:
        assert channel == full
    else:
        assert channel != notify_channel(table + "x", schema)
        assert channel.startswith(full[:20])


async def test_odd_names_and_texts_are_escaped_once_in_the_tables() -> None:
    # Each table cell is escaped by the table itself: a name with a newline reads `a\nb` (as in
    # the command's own reply), the text an operator copies to name the schedule again.
    from sdcore.cli._control_output import emit_actions, emit_history
    from sdcore.scheduling import RunRecord
    from sdcore.scheduling._control import Replica

    store = MemoryScheduleStore(MemoryJobScheduler())
    admin = ScheduleAdmin(store)
    await store.sync(Replica(replica_id="r", host="web", pid=1, handlers=("h",)), [])
    await admin.create("a\nb", handler="h", every_ms=HOUR_MS, actor="ops")
    await store.declare(Replica(replica_id="r", host="web", pid=1), "a\nb", "x")
    await admin.pause("a\nb", actor="dom\\ops", reason="line1\nline2")
    lines: list[str] = []
    emit_schedules(await admin.list_schedules(), lines.append, as_json=False)
    emit_actions(await admin.actions("a\nb"), lines.append, as_json=False)
    now = datetime.now(UTC)
    run = RunRecord(
        schedule="a\nb",
        run_key="k\tey",
        source="tick",
        scheduled_at=now,
        started_at=now,
        finished_at=now,
        status="FAIL",
        attempt=1,
        fencing_token=1,
        host="web",
        pid=1,
        error="bad\nthing",
    )
    emit_history([run], lines.append, as_json=False)
    text = "\n".join(lines)
    for once in ("a\\nb", "paused by dom\\\\ops", "dom\\\\ops", "line1\\nline2", "k\\tey"):
        assert once in text, (once, text)
    assert "bad\\nthing" in text
    for twice in ("a\\\\nb", "dom\\\\\\\\ops", "line1\\\\nline2", "k\\\\tey", "bad\\\\nthing"):
        assert twice not in text, (twice, text)


def test_the_cli_reference_lists_the_control_plane_json_keys() -> None:
    # docs/cli.md promises each --json command's keys ("never renames or removes one").
    import re
    from pathlib import Path

    from sdcore.cli._control_output import _run_json, _schedule_json, action_json
    from sdcore.scheduling import ActionKind, ControlAction, RunRecord

    table = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text("utf-8")

    def documented(prefix: str) -> list[str]:
        line = next(x for x in table.splitlines() if x.startswith(prefix))
        return re.findall(r"`(\w+)`", line.rsplit("|", 2)[1])

    now = datetime.now(UTC)
    state = ScheduleState(
        name="s",
        origin="code",
        kind="interval",
        expression="1000",
        time_zone="UTC",
        paused=False,
        paused_at=None,
        paused_by=None,
        paused_reason=None,
        handler=None,
        args=None,
        options={},
        replicas=(),
        versions=0,
        last_run_at=None,
        last_status=None,
    )
    run = RunRecord(
        schedule="s",
        run_key="k",
        source="tick",
        scheduled_at=now,
        started_at=now,
        finished_at=None,
        status="RUNNING",
        attempt=1,
        fencing_token=None,
        host="h",
        pid=1,
        error=None,
    )
    action = ControlAction(
        id=1,
        schedule="s",
        action=ActionKind.PAUSE,
        actor="ops",
        reason=None,
        params={},
        progress=None,
        outcome="done",
        created_at=now,
        finished_at=now,
    )
    assert documented("| `schedules list` (the cluster)") == list(_schedule_json(state))
    assert documented("| `schedules history`") == list(_run_json(run))
    assert documented("| `schedules log`") == list(action_json(action))


@in_loop_time
async def test_a_change_that_lands_before_the_timer_reaches_a_due_tick_fires_it() -> None:
    # The loop was late: the 1 s tick is due, its timer has not run, and the stored schedule's
    # change replaces the schedule now. The tick fires, with the new definition.
    loop = asyncio.get_running_loop()
    scheduler = Scheduler(clock=lambda: BASE + timedelta(seconds=loop.time()))
    hooks = SchedulerHooks(scheduler)
    ran: list[tuple[str, str]] = []

    def version(label: str) -> Callable[[Tick], None]:
        return lambda tick: ran.append((tick.run_key or "", label))

    def put(label: str) -> None:
        hooks.put_stored(
            "s", ScheduleKind.INTERVAL, "1000", "UTC", "vixie", version(label), {"exclusive": False}
        )

    put("old")
    async with scheduler:
        await asyncio.sleep(0.5)
        block_loop(0.7)
        put("new")
        await asyncio.sleep(1.0)
    assert ran[:2] == [("2026-07-20T03:00:01Z", "new"), ("2026-07-20T03:00:02Z", "new")]


async def test_a_stored_schedule_of_another_kind_is_refused_and_nothing_changes() -> None:
    scheduler = Scheduler()
    hooks = SchedulerHooks(scheduler)
    with pytest.raises(InvalidScheduleError, match="cron or interval, not timeout"):
        hooks.put_stored("s", ScheduleKind.TIMEOUT, "10", "UTC", "vixie", lambda t: None, {})
    assert hooks.entry("s") is None


@in_loop_time
async def test_a_run_going_on_through_a_change_is_still_an_overlap_for_the_new_ticks() -> None:
    loop = asyncio.get_running_loop()
    scheduler = Scheduler(clock=lambda: BASE + timedelta(seconds=loop.time()))
    hooks = SchedulerHooks(scheduler)
    started: list[tuple[str, float]] = []

    async def slow(tick: Tick) -> None:
        started.append((tick.run_key or "", loop.time()))
        await asyncio.sleep(2.5)

    def put() -> None:
        hooks.put_stored("s", ScheduleKind.INTERVAL, "1000", "UTC", "vixie", slow, {})

    put()
    async with scheduler:
        await asyncio.sleep(1.5)  # the 1 s tick runs until 3.5 s
        put()
        await asyncio.sleep(3.0)
    assert [key[-9:] for key, _ in started] == ["03:00:01Z", "03:00:04Z"]
