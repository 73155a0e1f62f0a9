"""The schedule store contract, run history and lease reads: ``runs_started``,
``runs_finished``, ``run_started``, ``run_finished``, ``history``, ``prune``, ``release_failed``
and ``succeeded_before``, against memory and real PostgreSQL alike."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from sdcore.job_scheduler import JobAcquireOptions, JobExecutionLease
from sdcore.scheduling._control import ActionKind, RunFinish
from tests.contract._schedules import (
    TICK_AT,
    Schedules,
    control,
    declared,
    replica,
    run_start,
)

TICK = "2026-12-01T09:00:00Z"
OTHER = "2026-12-01T10:00:00Z"
ABANDONED = "abandoned: the tick was taken over (fencing token {})"


async def test_a_run_start_and_end_are_recorded_as_given(schedules: Schedules) -> None:
    store = schedules.store
    start = run_start(TICK, 7, attempt=2, source="catch-up")
    run_id = await store.run_started(start)
    (running,) = await store.history("report", 10)
    assert (running.schedule, running.run_key, running.source) == ("report", TICK, "catch-up")
    assert (running.scheduled_at, running.attempt, running.fencing_token) == (TICK_AT, 2, 7)
    assert (running.host, running.pid) == (start.replica.host, start.replica.pid)
    assert (running.status, running.finished_at, running.error) == ("RUNNING", None, None)
    assert running.started_at.tzinfo is not None
    assert running.duration is None
    await store.run_finished(run_id, "FAIL", "boom")
    (failed,) = await store.history("report", 10)
    assert (failed.status, failed.error) == ("FAIL", "boom")
    assert failed.duration is not None
    assert failed.duration >= timedelta(0)


async def test_an_end_leaves_a_run_no_longer_running_as_it_is(schedules: Schedules) -> None:
    store = schedules.store
    run_id = await store.run_started(run_start(TICK, 1))
    await store.run_finished(run_id, "SUCCESS", None)
    (done,) = await store.history("report", 10)
    await store.run_finished(run_id, "FAIL", "late")
    await store.runs_finished([RunFinish(run_id=run_id + 1_000, status="FAIL", error="none")])
    assert await store.history("report", 10) == [done]


async def test_a_superseded_run_that_returns_late_stays_abandoned(schedules: Schedules) -> None:
    """Replica A's attempt (token 5) slept past its lease, B took the tick over (token 6), then
    A's handler returned: A's run stays closed as abandoned, B's alone is the tick's SUCCESS."""
    store = schedules.store
    stale = await store.run_started(run_start(TICK, 5))
    fresh = await store.run_started(run_start(TICK, 6))
    await store.run_finished(stale, "SUCCESS", None)
    await store.run_finished(fresh, "SUCCESS", None)
    runs = {r.fencing_token: r for r in await store.history("report", 10)}
    assert runs[6].status == "SUCCESS"
    assert (runs[5].status, runs[5].error) == ("FAIL", ABANDONED.format(6))


async def test_a_start_closes_only_older_attempts_recorded_before_it(
    schedules: Schedules,
) -> None:
    store = schedules.store
    await store.run_started(run_start(TICK, 6))
    await store.run_started(run_start(TICK, 5))  # an older token, recorded later: left running
    await store.run_started(run_start(TICK, None))  # no token: closes nothing
    await store.run_started(run_start(TICK, 9, schedule="other"))  # another schedule's tick
    await store.run_started(run_start(OTHER, 8))  # another tick of the schedule
    runs = {r.fencing_token: r for r in await store.history("report", 10)}
    assert {t: runs[t].status for t in (5, 6, 8, None)} == dict.fromkeys((5, 6, 8, None), "RUNNING")
    await store.run_started(run_start(TICK, 7))
    runs = {r.fencing_token: r for r in await store.history("report", 10)}
    assert [(runs[t].status, runs[t].error) for t in (5, 6, 7, 8, None)] == [
        ("FAIL", ABANDONED.format(7)),
        ("FAIL", ABANDONED.format(7)),
        ("RUNNING", None),
        ("RUNNING", None),
        ("RUNNING", None),
    ]
    (other,) = await store.history("other", 10)
    assert other.status == "RUNNING"


async def test_runs_started_together_get_their_ids_in_order(schedules: Schedules) -> None:
    store = schedules.store
    runs = [run_start(f"2026-12-01T09:{i:02d}:00Z", i + 1, schedule=f"s{i % 3}") for i in range(7)]
    ids = await store.runs_started(runs)
    assert len(set(ids)) == 7
    # Each end names the run it was given for: the history shows whether the ids matched.
    await store.runs_finished(
        [
            RunFinish(run_id=run_id, status="FAIL" if n % 2 else "SUCCESS", error=runs[n].run_key)
            for n, run_id in enumerate(ids)
        ]
    )
    recorded = [r for name in ("s0", "s1", "s2") for r in await store.history(name, 10)]
    assert sorted((r.run_key, r.error, r.status, r.fencing_token) for r in recorded) == [
        (run.run_key, run.run_key, "FAIL" if n % 2 else "SUCCESS", n + 1)
        for n, run in enumerate(runs)
    ]
    assert await store.runs_started([]) == []
    await store.runs_finished([])


async def test_a_takeover_within_one_batch_closes_every_older_attempt(
    schedules: Schedules,
) -> None:
    store = schedules.store
    earlier = await store.run_started(run_start(TICK, 4))
    newest, older, unfenced, elsewhere = await store.runs_started(
        [run_start(TICK, 6), run_start(TICK, 5), run_start(TICK, None), run_start(OTHER, 1)]
    )
    runs = {(r.run_key, r.fencing_token): r for r in await store.history("report", 10)}
    abandoned = ABANDONED.format(6)
    assert [(runs[TICK, t].status, runs[TICK, t].error) for t in (4, 5, 6, None)] == [
        ("FAIL", abandoned),
        ("FAIL", abandoned),
        ("RUNNING", None),
        ("RUNNING", None),
    ]
    assert runs[TICK, 5].finished_at is not None
    assert runs[OTHER, 1].status == "RUNNING"
    await store.runs_finished(
        [
            RunFinish(run_id=run_id, status="SUCCESS", error=None)
            for run_id in (earlier, older, newest, unfenced, elsewhere)
        ]
    )
    runs = {(r.run_key, r.fencing_token): r for r in await store.history("report", 10)}
    assert [runs[TICK, t].status for t in (4, 5, 6, None)] == ["FAIL", "FAIL", "SUCCESS", "SUCCESS"]
    assert runs[OTHER, 1].status == "SUCCESS"


async def test_history_is_one_schedules_runs_newest_first(schedules: Schedules) -> None:
    store = schedules.store
    keys = [f"2026-12-01T09:{i:02d}:00Z" for i in range(4)]
    for key in keys:
        await store.run_started(run_start(key, None))
        await schedules.now()  # each start after the one before
    await store.run_started(run_start(OTHER, None, schedule="other"))
    assert [r.run_key for r in await store.history("report", 10)] == keys[::-1]
    assert [r.run_key for r in await store.history("report", 2)] == keys[:1:-1]
    assert [r.run_key for r in await store.history("other", 10)] == [OTHER]
    assert await store.history("nothing", 10) == []


async def test_prune_deletes_runs_started_and_actions_finished_before(
    schedules: Schedules,
) -> None:
    store = schedules.store
    await store.sync(replica(), [declared("beat")])
    await store.run_started(run_start(TICK, 1))
    done = await store.run_started(run_start(OTHER, 2))
    await store.run_finished(done, "SUCCESS", None)
    pause = await store.write(control("beat", ActionKind.PAUSE))
    trigger = await store.write(control("beat", ActionKind.TRIGGER))
    assert pause is not None
    assert trigger is not None
    before = await schedules.now()
    kept_run = await store.run_started(run_start(TICK, 3, schedule="later"))
    resume = await store.write(control("beat", ActionKind.RESUME))
    assert resume is not None
    # Batches of one: the store deletes until a batch comes back short.
    assert await store.prune(before, 1) == 3  # two runs (one still RUNNING) and the pause
    assert await store.history("report", 10) == []
    assert [r.fencing_token for r in await store.history("later", 10)] == [3]
    assert [a.id for a in await store.actions("beat", 10)] == [resume.id, trigger.id]
    assert await store.action(pause.id) is None
    assert await store.prune(before, 100) == 0
    await store.run_finished(kept_run, "SUCCESS", None)


async def _lease(schedules: Schedules, run_key: str) -> tuple[str, JobExecutionLease]:
    outcome = await schedules.jobs.acquire(
        JobAcquireOptions(code="report", run_key=run_key, lease_ms=60_000)
    )
    assert outcome.acquired
    return outcome.row.lock_key, outcome.lease


async def test_release_failed_reopens_ticks_that_failed_before(schedules: Schedules) -> None:
    jobs, store = schedules.jobs, schedules.store
    keys = [f"2026-12-01T0{i}:00:00Z" for i in range(5)]
    failed, succeeded, running, _, late = [await _lease(schedules, key) for key in keys]
    await jobs.fail(failed[1])
    await jobs.complete(succeeded[1])
    unknown = "v2:never-run"
    before = await schedules.now()
    await jobs.fail(late[1])
    lock_keys = [failed[0], succeeded[0], running[0], late[0], unknown]
    assert await store.release_failed(lock_keys, before, "backfill:1") == 1
    records = await jobs.tick_records([failed[0], late[0]])
    assert records[failed[0]].released
    assert not records[late[0]].released
    # A tick already reopened is not counted again (a backfill taken over by another replica).
    assert await store.release_failed(lock_keys, before, "backfill:2") == 0
    assert await store.release_failed([], before, "backfill:3") == 0


async def test_succeeded_before_names_the_ticks_done_by_then(schedules: Schedules) -> None:
    jobs, store = schedules.jobs, schedules.store
    keys = [f"2026-12-01T0{i}:00:00Z" for i in range(4)]
    early, failed, running, late = [await _lease(schedules, key) for key in keys]
    await jobs.complete(early[1])
    await jobs.fail(failed[1])
    before = await schedules.now()
    await jobs.complete(late[1])
    lock_keys = [early[0], failed[0], running[0], late[0], "v2:never-run"]
    assert await store.succeeded_before(lock_keys, before) == {early[0]}
    assert await store.succeeded_before(lock_keys, await schedules.now()) == {early[0], late[0]}
    assert await store.succeeded_before([], before) == set()


async def test_a_run_whose_lease_was_taken_over_ends_abandoned_before_the_takeover_starts(
    schedules: Schedules,
) -> None:
    """The superseded replica's handler returns after a takeover acquired the tick but before
    the takeover's start reached the history: its end is recorded as abandoned, never as a
    second SUCCESS of the tick."""
    jobs, store = schedules.jobs, schedules.store
    outcome = await jobs.acquire(JobAcquireOptions(code="report", run_key=TICK, lease_ms=1_000))
    assert outcome.acquired
    first = outcome.lease
    superseded = await store.run_started(run_start(TICK, first.fencing_token))
    kept = await store.run_started(run_start(OTHER, 1))
    await schedules.age(5_000)  # the lease ran out: the memory clock moves on,
    if schedules.name == "postgres":
        await asyncio.sleep(1.3)  # the database's clock does not
    again = await jobs.acquire(JobAcquireOptions(code="report", run_key=TICK, lease_ms=60_000))
    assert again.acquired
    assert again.lease.id == first.id
    assert again.lease.fencing_token == first.fencing_token + 1
    await store.runs_finished(
        [
            RunFinish(run_id=superseded, status="SUCCESS", error=None, lease_id=first.id),
            RunFinish(run_id=kept, status="SUCCESS", error=None, lease_id=None),
        ]
    )
    (ended,) = [r for r in await store.history("report", 10) if r.run_key == TICK]
    assert (ended.status, ended.error) == ("FAIL", ABANDONED.format(again.lease.fencing_token))
    (other,) = [r for r in await store.history("report", 10) if r.run_key == OTHER]
    assert other.status == "SUCCESS"
    # The run that holds the lease ends as its handler says.
    current = await store.run_started(run_start(TICK, again.lease.fencing_token))
    await store.runs_finished(
        [RunFinish(run_id=current, status="SUCCESS", error=None, lease_id=again.lease.id)]
    )
    statuses = sorted(r.status for r in await store.history("report", 10) if r.run_key == TICK)
    assert statuses == ["FAIL", "SUCCESS"]
