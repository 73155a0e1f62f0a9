"""The control plane on the in-memory doubles: two replicas sharing one job scheduler and store."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sdcore.job_scheduler import JobSchedulerStatus
from sdcore.scheduling import (
    ActionKind,
    InvalidScheduleError,
    ScheduleAdmin,
    ScheduleControl,
    ScheduleControlError,
    Scheduler,
    Tick,
)
from sdcore.scheduling._plane import LEAVE_TIMEOUT_S
from sdcore.testing import MemoryJobScheduler, MemoryScheduleStore
from tests.unit._looptime import in_loop_time


def loop_wall_clock() -> Callable[[], datetime]:
    """Now at the start, then moving with the running loop's (fast-forwarded) time.

    The control plane reads the real clock for its own bookkeeping (actions since start, the
    catch-up window); a clock that starts at real now and only runs ahead keeps those readings
    in order with the doubles' timestamps.
    """
    loop = asyncio.get_running_loop()
    start, t0 = datetime.now(UTC), loop.time()
    return lambda: start + timedelta(seconds=loop.time() - t0)


EVERY_MS = 200


class Cluster:
    def __init__(
        self,
        replicas: int = 2,
        catch_up: str = "off",
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        now = clock or (lambda: datetime.now(UTC))
        self.clock = now
        self.jobs = MemoryJobScheduler(clock=now)
        self.store = MemoryScheduleStore(self.jobs, clock=now)
        self.admin = ScheduleAdmin(self.store)
        self.runs: list[tuple[str, int]] = []
        self.digests: list[tuple[str, dict[str, Any], int]] = []
        self.schedulers: list[Scheduler] = []
        self.controls: list[ScheduleControl] = []
        for index in range(replicas):
            scheduler = Scheduler(jobs=self.jobs, lease_ms=2_000, clock=now)

            def record(tick: Tick, index: int = index) -> None:
                assert tick.run_key is not None
                self.runs.append((tick.run_key, index))

            async def work(tick: Tick, record: Any = record) -> None:
                record(tick)

            scheduler.add_interval("beat", EVERY_MS, work, catch_up=catch_up)  # type: ignore[arg-type]

            @scheduler.handler("digest")
            async def digest(tick: Tick, args: dict[str, Any], index: int = index) -> None:
                assert tick.run_key is not None
                self.digests.append((tick.run_key, args, index))

            self.schedulers.append(scheduler)
            self.controls.append(
                ScheduleControl(scheduler, self.store, poll_interval_ms=50, pid=1000 + index)
            )

    async def __aenter__(self) -> Cluster:
        for control, scheduler in zip(self.controls, self.schedulers, strict=True):
            await control.start()
            await scheduler.start_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for control, scheduler in zip(self.controls, self.schedulers, strict=True):
            await control.aclose()
            await scheduler.aclose()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with Cluster() as c:
        yield c


async def until(predicate: Any, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def no_duplicates(runs: list[tuple[str, int]]) -> None:
    counts = Counter(key for key, _ in runs)
    assert [k for k, n in counts.items() if n > 1] == []


@in_loop_time
async def test_pause_trigger_resume() -> None:
    async with Cluster(clock=loop_wall_clock()) as cluster:
        await _pause_trigger_resume(cluster)


async def _pause_trigger_resume(cluster: Cluster) -> None:
    await until(lambda: len(cluster.runs) >= 2)
    paused = await cluster.admin.pause("beat", actor="ops", reason="incident 42")
    assert paused.action is ActionKind.PAUSE
    await until(lambda: all(c.paused("beat") for c in cluster.controls))
    await asyncio.sleep(0.1)
    before = len(cluster.runs)
    await asyncio.sleep(3 * EVERY_MS / 1000)
    assert len(cluster.runs) == before  # nothing starts while paused
    now = cluster.clock()
    missed = await cluster.schedulers[0].missed_ticks(
        "beat", now - timedelta(milliseconds=4 * EVERY_MS), now
    )
    assert any(m.skipped == "paused" for m in missed)
    trigger = await cluster.admin.trigger("beat", actor="ops")
    await until(lambda: any(k == f"trigger:{trigger.id}" for k, _ in cluster.runs))
    await until(lambda: cluster.store._actions[trigger.id].outcome == "SUCCESS")
    states = {s.name: s for s in await cluster.admin.list_schedules()}
    assert states["beat"].paused
    assert states["beat"].paused_by == "ops"
    assert states["beat"].paused_reason == "incident 42"
    assert len(states["beat"].replicas) == 2
    assert states["beat"].last_seen_at is not None
    await cluster.admin.resume("beat", actor="ops")
    count = len(cluster.runs)
    await until(lambda: len(cluster.runs) >= count + 2)
    no_duplicates(cluster.runs)
    history = await cluster.admin.history("beat", limit=100)
    assert any(r.source == "trigger" for r in history)
    assert all(r.status in ("SUCCESS", "RUNNING") for r in history)
    log = await cluster.admin.actions("beat")
    assert [a.action for a in log][:3] == [ActionKind.RESUME, ActionKind.TRIGGER, ActionKind.PAUSE]


async def test_backfill_runs_each_missing_tick_once(cluster: Cluster) -> None:
    now = datetime.now(UTC)
    # Ten ticks long before the schedule existed, one of them already a SUCCESS.
    start = datetime.fromtimestamp((now.timestamp() // 60) * 60 - 3600, UTC)
    end = start + timedelta(milliseconds=9 * EVERY_MS)
    action = await cluster.admin.backfill("beat", start, end, actor="ops", reason="outage")
    assert action.params["ticks"] == 10
    await until(lambda: cluster.store._actions[action.id].finished_at is not None, timeout=10)
    done = cluster.store._actions[action.id]
    assert done.outcome == "SUCCESS"
    assert done.progress == {
        "total": 10,
        "succeeded": 10,
        "failed": 0,
        "remaining": 0,
        "already_succeeded": 0,
    }
    window = {k for k, _ in cluster.runs if k.startswith(start.strftime("%Y-%m-%dT%H"))}
    assert len(window) == 10
    no_duplicates(cluster.runs)
    history = await cluster.admin.history("beat", limit=200)
    assert sum(1 for r in history if r.source == "backfill") == 10


async def test_refusals_change_nothing(cluster: Cluster) -> None:
    import sdcore
    from sdcore.scheduling import SchedulingError

    assert issubclass(ScheduleControlError, SchedulingError)
    assert issubclass(ScheduleControlError, ValueError)
    assert issubclass(ScheduleControlError, sdcore.SdcoreError)
    admin = cluster.admin
    now = datetime.now(UTC)
    with pytest.raises(ScheduleControlError, match="no such schedule"):
        await admin.pause("nope", actor="ops")
    with pytest.raises(ScheduleControlError, match="before it starts"):
        await admin.backfill("beat", now, now - timedelta(seconds=1), actor="ops")
    with pytest.raises(ScheduleControlError, match="aware"):
        await admin.backfill("beat", now.replace(tzinfo=None), now, actor="ops")
    with pytest.raises(ScheduleControlError, match="future"):
        await admin.backfill("beat", now, now + timedelta(hours=1), actor="ops")
    with pytest.raises(ScheduleControlError, match="more than 10000"):
        await admin.backfill("beat", now - timedelta(hours=1), now, actor="ops")
    with pytest.raises(ScheduleControlError, match="not paused"):
        await admin.resume("beat", actor="ops")
    with pytest.raises(ScheduleControlError, match="actor"):
        await admin.pause("beat", actor="")
    with pytest.raises(ScheduleControlError, match="no running replica registers"):
        await admin.create("d1", handler="unknown", cron="* * * * *", actor="ops")
    with pytest.raises(InvalidScheduleError):
        await admin.create("d1", handler="digest", cron="61 * * * *", actor="ops")
    with pytest.raises(ScheduleControlError, match=r"code-declared|exists"):
        await admin.create("beat", handler="digest", every_ms=1000, actor="ops")
    assert await admin.actions("beat") == []
    for control in cluster.controls:  # replicas gone: nobody declares it any more
        await control.aclose()
    with pytest.raises(ScheduleControlError, match="no running replica declares"):
        await admin.pause("beat", actor="ops")
    row = await cluster.store.row("beat")
    assert row is not None
    assert not row.paused


@in_loop_time
async def test_stored_schedule_create_change_remove() -> None:
    async with Cluster(clock=loop_wall_clock()) as cluster:
        await _stored_schedule_create_change_remove(cluster)


async def _stored_schedule_create_change_remove(cluster: Cluster) -> None:
    admin = cluster.admin
    await admin.create(
        "digest-acme", handler="digest", every_ms=EVERY_MS, args={"customer": "acme"}, actor="ops"
    )
    await until(lambda: len(cluster.digests) >= 2)
    assert cluster.digests[0][1] == {"customer": "acme"}
    no_duplicates([(k, i) for k, _, i in cluster.digests])
    await admin.update(
        "digest-acme", handler="digest", every_ms=300, args={"customer": "acme2"}, actor="ops"
    )
    await until(lambda: cluster.digests[-1][1] == {"customer": "acme2"})
    assert cluster.digests[-1][0].endswith("00Z") or cluster.digests[-1][0][-4:-1] in (
        "000",
        "300",
        "600",
        "900",
        "200",
        "500",
        "800",
        "100",
        "400",
        "700",
    )
    await admin.remove("digest-acme", actor="ops")
    await until(lambda: all("digest-acme" not in s._entries for s in cluster.schedulers))
    count = len(cluster.digests)
    await asyncio.sleep(0.5)
    assert len(cluster.digests) <= count + 1  # one may have been running at removal
    no_duplicates([(k, i) for k, _, i in cluster.digests])


@in_loop_time
async def test_resume_catches_up_latest() -> None:
    async with Cluster(catch_up="latest", clock=loop_wall_clock()) as cluster:
        await until(lambda: len(cluster.runs) >= 1)
        await cluster.admin.pause("beat", actor="ops")
        await until(lambda: all(c.paused("beat") for c in cluster.controls))
        await asyncio.sleep(4 * EVERY_MS / 1000)
        paused_keys = {k for k, _ in cluster.runs}
        await cluster.admin.resume("beat", actor="ops")
        await until(lambda: len({k for k, _ in cluster.runs} - paused_keys) >= 1)
        no_duplicates(cluster.runs)
        rows = [
            r
            for r in cluster.jobs.rows()
            if r.code == "beat" and r.status is JobSchedulerStatus.SUCCESS
        ]
        assert rows


@in_loop_time
async def test_a_stop_gives_up_leaving_a_store_that_does_not_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The database is gone while the replica stops: leaving would wait the pool's whole checkout
    # timeout. The stop gives up after LEAVE_TIMEOUT_S (the row expires by itself) and says so.
    cluster = Cluster(replicas=1, clock=loop_wall_clock())
    await cluster.__aenter__()
    left = asyncio.Event()

    async def unanswered(replica: object) -> None:
        await asyncio.sleep(3_600)
        left.set()

    cluster.store.leave = unanswered  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    start = loop.time()
    await cluster.controls[0].aclose()
    assert loop.time() - start == pytest.approx(LEAVE_TIMEOUT_S, abs=0.1)
    assert not left.is_set()
    assert "could not leave the control plane within 5 s" in caplog.text
    assert not cluster.controls[0].running
    await cluster.schedulers[0].aclose()
