"""Operator actions on the in-memory doubles: stored schedules stay exclusive, trigger and
backfill requests are idempotent, removal closes open actions, update is a patch."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sdcore.scheduling import ScheduleAdmin, ScheduleControl, ScheduleControlError, Scheduler, Tick
from sdcore.scheduling._control import ActionKind, Declared, Write, fingerprint, policy_options
from sdcore.scheduling._policy import build_policy
from sdcore.testing import MemoryJobScheduler, MemoryScheduleStore
from tests.unit._looptime import BASE, in_loop_time, loop_clock
from tests.unit.test_schedule_control import (
    EVERY_MS,
    Cluster,
    loop_wall_clock,
    no_duplicates,
    until,
)

FORCED = "stored_forced_exclusive"


@pytest.fixture
async def two() -> AsyncIterator[Cluster]:
    async with Cluster() as c:
        yield c


async def test_create_refuses_a_non_exclusive_stored_schedule(two: Cluster) -> None:
    cluster = two
    for value in (False, "false", 0):
        with pytest.raises(ScheduleControlError, match="always exclusive") as caught:
            await cluster.admin.create(
                "dup",
                handler="digest",
                every_ms=EVERY_MS,
                options={"exclusive": value},
                actor="ops",
            )
        assert "exclusive=" in str(caught.value)
    assert await cluster.store.row("dup") is None
    assert await cluster.admin.actions("beat") == []
    # Saying what a stored schedule is anyway is accepted.
    await cluster.admin.create(
        "dup", handler="digest", every_ms=EVERY_MS, options={"exclusive": True}, actor="ops"
    )
    row = await cluster.store.row("dup")
    assert row is not None
    assert row.options["exclusive"] is True


@in_loop_time
async def test_a_non_exclusive_row_from_another_version_runs_each_tick_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with Cluster(clock=loop_wall_clock()) as cluster:
        # What an older sdcore wrote: a stored row whose options say exclusive=false.
        options = policy_options(
            build_policy("dup", {"exclusive": False}, has_jobs=True, default_lease_ms=300_000)
        )
        assert options["exclusive"] is False
        expression = str(EVERY_MS)
        declared = Declared(
            name="dup",
            kind="interval",
            expression=expression,
            time_zone="UTC",
            options=options,
            fingerprint=fingerprint("interval", expression, "UTC", options, "digest", {}),
        )
        with caplog.at_level(logging.WARNING, logger="sdcore.scheduling.control"):
            await cluster.store.write(
                Write(
                    name="dup",
                    action=ActionKind.CREATE,
                    actor="old-version",
                    reason=None,
                    stored=declared,
                    handler="digest",
                    args={},
                )
            )
            await until(lambda: len({k for k, _, _ in cluster.digests}) >= 6, timeout=10)
        no_duplicates([(k, i) for k, _, i in cluster.digests])
        forced = [r for r in caplog.records if getattr(r, "action", None) == FORCED]
        assert forced, caplog.text
        # The admin treats it as what it runs as: exclusive, so it can be triggered.
        action = await cluster.admin.trigger("dup", actor="ops")
        await until(lambda: any(k == f"trigger:{action.id}" for k, _, _ in cluster.digests))
        await asyncio.sleep(0.5)
        no_duplicates([(k, i) for k, _, i in cluster.digests])


@in_loop_time
async def test_a_trigger_open_at_removal_never_runs_the_re_created_schedule() -> None:
    clock = loop_wall_clock()
    jobs = MemoryJobScheduler(clock=clock)
    store = MemoryScheduleStore(jobs, clock=clock)
    admin = ScheduleAdmin(store)
    scheduler = Scheduler(jobs=jobs, lease_ms=2_000, clock=clock)
    runs: list[tuple[str | None, dict[str, Any]]] = []

    @scheduler.handler("send-digest")
    async def send_digest(tick: Tick, args: dict[str, Any]) -> None:
        runs.append((tick.run_key, args))

    # Poll-only and slow: the replica sees only what the test lets it see.
    control = ScheduleControl(scheduler, store, poll_interval_ms=3_600_000, listen=False)
    await control.start()
    await scheduler.start_all()
    try:
        acme = {"customer": "acme"}
        await admin.create(
            "digest-acme", handler="send-digest", cron="0 0 1 1 *", args=acme, actor="ops"
        )
        await control.poll()
        trigger = await admin.trigger("digest-acme", actor="ops")
        await admin.remove("digest-acme", actor="ops")
        globex = {"customer": "globex"}
        await admin.create(
            "digest-acme", handler="send-digest", cron="0 0 1 1 *", args=globex, actor="ops"
        )
        for _ in range(5):
            await control.poll()
            await asyncio.sleep(0.5)
        assert runs == []
        assert (await admin.action(trigger.id)).outcome == "CANCELLED"
        again = await admin.trigger("digest-acme", actor="ops")
        await control.poll()
        await until(lambda: len(runs) == 1)
        assert runs == [(f"trigger:{again.id}", globex)]
    finally:
        await control.aclose()
        await scheduler.aclose()


async def test_a_request_id_records_one_action(two: Cluster) -> None:
    admin = two.admin
    first = await admin.trigger("beat", actor="ops", request_id="req-1")
    again = await admin.trigger("beat", actor="someone else", reason="retry", request_id="req-1")
    assert again == replace(first, replayed=True)
    assert not first.replayed
    assert first.request_id == "req-1"
    other = await admin.trigger("beat", actor="ops", request_id="req-2")
    assert other.id != first.id
    now = datetime.now(UTC).replace(microsecond=0)
    start, end = now - timedelta(seconds=2), now - timedelta(seconds=1)
    with pytest.raises(ScheduleControlError, match="already recorded action"):
        await admin.backfill("beat", start, end, actor="ops", request_id="req-1")
    backfill = await admin.backfill("beat", start, end, actor="ops", request_id="bf-1")
    retried = await admin.backfill("beat", start, end, actor="ops", request_id="bf-1")
    assert retried == replace(backfill, replayed=True)
    with pytest.raises(ScheduleControlError, match="other parameters"):
        await admin.backfill("beat", start, end, actor="ops", concurrency=2, request_id="bf-1")
    for bad in ("", "x" * 201, "a\x00b"):
        with pytest.raises(ScheduleControlError, match="request_id"):
            await admin.trigger("beat", actor="ops", request_id=bad)
    log = await admin.actions("beat")
    assert [a.id for a in log] == [backfill.id, other.id, first.id]


async def test_rerun_succeeded_runs_each_succeeded_tick_once_more(two: Cluster) -> None:
    cluster = two
    await until(lambda: len(cluster.runs) >= 6, timeout=10)
    done = sorted(k for k, _ in cluster.runs)[:4]
    parse = [datetime.fromisoformat(k.replace("Z", "+00:00")) for k in done]
    plain = await cluster.admin.backfill("beat", parse[0], parse[-1], actor="ops")
    await until(lambda: cluster.store._actions[plain.id].finished_at is not None)
    assert cluster.store._actions[plain.id].progress == {
        "total": 4,
        "succeeded": 4,
        "failed": 0,
        "remaining": 0,
        "already_succeeded": 4,
    }
    again = await cluster.admin.backfill(
        "beat", parse[0], parse[-1], actor="ops", rerun_succeeded=True
    )
    assert again.params["rerun_succeeded"] is True
    await until(lambda: cluster.store._actions[again.id].finished_at is not None)
    finished = cluster.store._actions[again.id]
    assert finished.outcome == "SUCCESS"
    assert finished.progress == {
        "total": 4,
        "succeeded": 4,
        "failed": 0,
        "remaining": 0,
        "rerun": 4,
    }
    prefix = f"backfill:{again.id}:"
    assert sorted(k for k, _ in cluster.runs if k.startswith(prefix)) == [prefix + k for k in done]
    no_duplicates(cluster.runs)
    assert sorted(k for k, _ in cluster.runs if k in done) == done  # the originals once


def test_expected_instants_names_a_year_1_start_instead_of_overflowing() -> None:
    from sdcore.scheduling._triggers import IntervalTrigger, expected_instants

    first = datetime(1, 1, 1, tzinfo=UTC)
    with pytest.raises(ValueError, match="out of range"):
        expected_instants(IntervalTrigger(1_000), first, first + timedelta(hours=1), limit=10)
    later = first + timedelta(microseconds=1)
    assert (
        len(
            expected_instants(
                IntervalTrigger(60_000), later, later + timedelta(minutes=5), limit=10
            )
        )
        == 5
    )
    last = datetime(9999, 12, 31, 23, 59, tzinfo=UTC)
    end = datetime.max.replace(tzinfo=UTC)
    assert expected_instants(IntervalTrigger(60_000), last, end, limit=10) == [last]


class _SlowCommits(MemoryJobScheduler):
    """The completions of the schedule's regular ticks take 1.3 s, longer than its spacing (a
    slow synchronous standby): a regular fire always waits for the run before it."""

    async def complete(self, lease: Any, data: Any = None) -> bool:
        row = self.get(lease.id)
        if row is not None and (row.run_key or "")[:1].isdigit():
            await asyncio.sleep(1.3)
        return bool(await super().complete(lease, data))


@pytest.mark.parametrize("kind", ["trigger", "backfill"])
@in_loop_time
async def test_a_trigger_or_backfill_is_not_starved_by_fires_waiting_on_the_database(
    kind: str,
) -> None:
    """Each regular run's commit outlasts the spacing, so a regular fire always waits for the
    run before it and starts when it ends. A trigger or backfill refused for those runs goes
    before the next such fire, instead of waiting for ever."""
    jobs = _SlowCommits(clock=loop_clock())
    store = MemoryScheduleStore(jobs, clock=loop_clock())
    admin = ScheduleAdmin(store, clock=loop_clock())
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    started: list[tuple[str | None, float]] = []

    async def handler(tick: Tick) -> None:
        started.append((tick.run_key, asyncio.get_running_loop().time()))

    scheduler.add_interval("s", 1000, handler)
    control = ScheduleControl(
        scheduler, store, poll_interval_ms=200, heartbeat_ms=1000, clock=loop_clock()
    )
    async with control, scheduler:
        await asyncio.sleep(3.2)
        if kind == "trigger":
            await admin.trigger("s", actor="ops")
        else:
            at = BASE + timedelta(seconds=1)
            await admin.backfill("s", at, at, actor="ops", rerun_succeeded=True)
        await asyncio.sleep(6)
    asked = [at for key, at in started if (key or "").startswith(f"{kind}:")]
    assert len(asked) == 1, started
    assert asked[0] < 3.2 + 1.5, started
    regular = [at for key, at in started if (key or "")[:1].isdigit() and at > 3.2]
    assert len(regular) >= 4, "the regular fires went on"


@in_loop_time
async def test_two_backfills_leave_the_live_schedule_at_most_one_tick_behind() -> None:
    """Two backfills of 2.5 s runs against a per-second schedule: a live fire that waited for
    one of their runs starts when it ends, before the other backfill's next run (the two do not
    hand the schedule to each other while its live fires wait)."""
    jobs = MemoryJobScheduler(clock=loop_clock())
    store = MemoryScheduleStore(jobs, clock=loop_clock())
    admin = ScheduleAdmin(store, clock=loop_clock())
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    started: list[tuple[str, float]] = []

    async def handler(tick: Tick) -> None:
        key = tick.run_key or ""
        started.append((key, asyncio.get_running_loop().time()))
        await asyncio.sleep(2.5 if key.startswith("backfill:") else 0.1)

    scheduler.add_interval("s", 1000, handler)
    control = ScheduleControl(
        scheduler, store, poll_interval_ms=200, heartbeat_ms=1000, clock=loop_clock()
    )
    async with control, scheduler:
        await asyncio.sleep(8.2)
        for actor in ("ops-a", "ops-b"):
            first, last = BASE + timedelta(seconds=1), BASE + timedelta(seconds=6)
            await admin.backfill("s", first, last, actor=actor, rerun_succeeded=True)
        await asyncio.sleep(40)
    backfilled = [at for key, at in started if key.startswith("backfill:")]
    assert len(backfilled) == 12, started
    end = max(backfilled) + 2.5
    live = [at for key, at in started if key[:1].isdigit() and 8.2 < at < end]
    # Each backfill run holds the schedule 2.5 s; a live fire runs between two of them.
    assert len(live) >= len(backfilled) - 1, started
