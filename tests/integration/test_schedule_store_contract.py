"""One admin sequence on both stores (PostgreSQL and the in-memory double): what the operator
reads back agrees, pause fields included, and a removal closes the open actions."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import PostgresScheduleStore, ScheduleAdmin, ScheduleControlError
from sdcore.scheduling._control import (
    ActionKind,
    Declared,
    Replica,
    RunFinish,
    RunStart,
    ScheduleStore,
    Write,
    fingerprint,
    policy_options,
)
from sdcore.scheduling._policy import build_policy
from sdcore.testing import MemoryJobScheduler, MemoryScheduleStore

REPLICA = Replica(replica_id=str(uuid.uuid4()), host="replica", pid=1, handlers=("digest",))


def _declared(name: str) -> Declared:
    options = policy_options(build_policy(name, {}, has_jobs=True, default_lease_ms=300_000))
    return Declared(
        name=name,
        kind="interval",
        expression="60000",
        time_zone="UTC",
        options=options,
        fingerprint=fingerprint("interval", "60000", "UTC", options),
    )


@pytest.fixture(params=["memory", "postgres"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ScheduleStore]:
    if request.param == "memory":
        yield MemoryScheduleStore(MemoryJobScheduler())
        return
    dsn = request.getfixturevalue("pg_dsn")
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True)
    try:
        jobs = JobSchedulerService(pool, max_connections=1)
        await jobs.ensure_schema()
        await jobs.close()
        pg = PostgresScheduleStore(pool)
        await pg.ensure_schema()
        yield pg
    finally:
        await pool.close()


def _pause_fields(state: Any) -> tuple[Any, ...]:
    return (state.paused, state.paused_at is not None, state.paused_by, state.paused_reason)


async def test_pause_fields_agree_after_resume_and_re_create(store: ScheduleStore) -> None:
    admin = ScheduleAdmin(store)
    await store.sync(REPLICA, [_declared("beat")])
    await admin.pause("beat", actor="alice", reason="INC-481")
    paused = {s.name: _pause_fields(s) for s in await admin.list_schedules()}
    assert paused["beat"] == (True, True, "alice", "INC-481")
    await admin.resume("beat", actor="bob")
    await admin.create("s1", handler="digest", every_ms=60_000, actor="ops")
    await admin.pause("s1", actor="carol", reason="old customer")
    await admin.remove("s1", actor="ops")
    await admin.create("s1", handler="digest", every_ms=60_000, actor="ops")
    states = {s.name: _pause_fields(s) for s in await admin.list_schedules()}
    assert states == {
        "beat": (False, False, None, None),
        "s1": (False, False, None, None),
    }
    row = await store.row("s1")
    assert row is not None
    assert (row.paused, row.paused_at, row.resumed_at) == (False, None, None)
    beat = await store.row("beat")
    assert beat is not None
    assert beat.paused_at is not None  # kept: the resume's catch-up starts there
    assert beat.resumed_at is not None


async def test_remove_closes_the_open_actions(store: ScheduleStore) -> None:
    admin = ScheduleAdmin(store)
    await store.sync(REPLICA, [])
    await admin.create(
        "digest-acme", handler="digest", every_ms=60_000, args={"customer": "acme"}, actor="ops"
    )
    await store.declare(REPLICA, "digest-acme", "x")
    trigger = await admin.trigger("digest-acme", actor="ops")
    now = datetime.now(UTC)
    backfill = await admin.backfill(
        "digest-acme", now - timedelta(minutes=5), now - timedelta(minutes=1), actor="ops"
    )
    assert [a.id for a in await store.open_actions(["digest-acme"])] == [trigger.id, backfill.id]
    await admin.remove("digest-acme", actor="ops")
    assert await store.open_actions(["digest-acme"]) == []
    for action_id in (trigger.id, backfill.id):
        closed = await admin.action(action_id)
        assert closed.outcome == "CANCELLED"
        assert closed.finished_at is not None
    # The coordinator ends right after: its CANCELLED progress is kept, nothing else changes.
    closed_at = (await admin.action(backfill.id)).finished_at
    progress = {"total": 5, "succeeded": 2, "failed": 0, "remaining": 3}
    await store.finish_action(backfill.id, "CANCELLED", progress)
    await store.finish_action(trigger.id, "SUCCESS", progress)
    after = await admin.action(backfill.id)
    assert (after.outcome, after.finished_at, after.progress) == ("CANCELLED", closed_at, progress)
    assert (await admin.action(trigger.id)).outcome == "CANCELLED"
    assert (await admin.action(trigger.id)).progress is None
    await admin.create(
        "digest-acme", handler="digest", every_ms=60_000, args={"customer": "globex"}, actor="ops"
    )
    assert await store.open_actions(["digest-acme"]) == []
    log = await admin.actions("digest-acme")
    assert [a.action.value for a in log] == ["create", "remove", "backfill", "trigger", "create"]
    assert [a.outcome for a in log] == ["done", "done", "CANCELLED", "CANCELLED", "done"]


async def test_an_update_merged_from_an_old_version_is_refused(store: ScheduleStore) -> None:
    admin = ScheduleAdmin(store)
    await store.sync(REPLICA, [])
    await admin.create("s2", handler="digest", every_ms=60_000, actor="ops")
    await store.declare(REPLICA, "s2", "x")
    read = await store.row("s2")
    assert read is not None
    states = {s.name: s for s in await admin.list_schedules()}
    assert states["s2"].version == read.revision
    await admin.pause("s2", actor="ops")  # a change between the read and the write
    declared = _declared("s2")
    stale = Write(
        name="s2",
        action=ActionKind.UPDATE,
        actor="ops",
        reason=None,
        stored=declared,
        handler="digest",
        args={},
        expected_revision=read.revision,
    )
    assert await store.write(stale) is None
    racing_create = Write(
        name="s2",
        action=ActionKind.CREATE,
        actor="ops",
        reason=None,
        stored=declared,
        handler="digest",
        args={},
    )
    assert await store.write(racing_create) is None  # a create never replaces a live schedule
    with pytest.raises(ScheduleControlError, match="is stale"):
        await admin.update("s2", every_ms=30_000, expected_version=read.revision, actor="ops")
    now = await store.row("s2")
    assert now is not None
    assert now.expression == "60000"
    done = await admin.update("s2", every_ms=30_000, expected_version=now.revision, actor="ops")
    assert done.params["previous"]["expression"] == "60000"
    after = await store.row("s2")
    assert after is not None
    assert (after.expression, after.paused) == ("30000", True)


def _interval(name: str, every_ms: int) -> Declared:
    options = policy_options(build_policy(name, {}, has_jobs=True, default_lease_ms=300_000))
    expression = str(every_ms)
    return Declared(
        name=name,
        kind="interval",
        expression=expression,
        time_zone="UTC",
        options=options,
        fingerprint=fingerprint("interval", expression, "UTC", options),
    )


async def test_replicas_and_live_versions_are_listed_in_one_order(store: ScheduleStore) -> None:
    # Replicas by host then pid (as numbers: 999 before 1000), live versions by the start of
    # their oldest replica (during a deploy the old version first), whatever their fingerprints.
    old_def, new_def = sorted(
        (_interval("beat", 60_000), _interval("beat", 30_000)),
        key=lambda d: d.fingerprint,
        reverse=True,
    )
    old = Replica(replica_id=str(uuid.uuid4()), host="web", pid=1000, handlers=())
    new = Replica(replica_id=str(uuid.uuid4()), host="web", pid=999, handlers=())
    await store.sync(old, [old_def])
    await store.sync(new, [new_def])
    (state,) = [s for s in await ScheduleAdmin(store).list_schedules() if s.name == "beat"]
    assert state.replicas == ("web:999", "web:1000")
    assert [v.fingerprint for v in state.live_versions] == [
        old_def.fingerprint,
        new_def.fingerprint,
    ]
    assert [v.replicas for v in state.live_versions] == [("web:1000",), ("web:999",)]


async def test_a_retried_request_finds_its_action_with_no_replica_live(
    store: ScheduleStore,
) -> None:
    # The retry after a lost COMMIT reply comes when the database is back, possibly before any
    # replica has heartbeated again: it must return the recorded action, not refuse with "no
    # running replica declares this schedule; nothing changed" (the action is recorded).
    admin = ScheduleAdmin(store)
    await store.sync(REPLICA, [_declared("beat")])
    first = await admin.trigger("beat", actor="ops", request_id="req-7")
    now = datetime.now(UTC)
    start, end = now - timedelta(minutes=5), now - timedelta(minutes=1)
    backfill = await admin.backfill("beat", start, end, actor="ops", request_id="bf-7")
    await store.leave(REPLICA)
    again = await admin.trigger("beat", actor="ops", request_id="req-7")
    assert (again.id, again.replayed) == (first.id, True)
    retried = await admin.backfill("beat", start, end, actor="ops", request_id="bf-7")
    assert (retried.id, retried.replayed) == (backfill.id, True)
    with pytest.raises(ScheduleControlError, match="other parameters"):
        await admin.backfill("beat", start, end, actor="ops", concurrency=2, request_id="bf-7")
    # A new request still needs a live replica.
    with pytest.raises(ScheduleControlError, match="no running replica declares"):
        await admin.trigger("beat", actor="ops", request_id="req-8")


async def test_a_superseded_run_that_returns_late_stays_abandoned(store: ScheduleStore) -> None:
    """Replica A's attempt (token 5) slept past its lease, B took the tick over (token 6), then
    A's handler returned: A's run stays closed as abandoned, B's alone is the tick's SUCCESS."""
    at = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)

    def start(token: int, pid: int) -> RunStart:
        replica = Replica(replica_id=str(uuid.uuid4()), host=f"replica-{pid}", pid=pid)
        return RunStart(
            schedule="report",
            run_key="2026-12-01T09:00:00Z",
            source="tick",
            scheduled_at=at,
            attempt=1,
            fencing_token=token,
            replica=replica,
        )

    stale = await store.run_started(start(5, 1))
    fresh = await store.run_started(start(6, 2))
    assert stale is not None
    assert fresh is not None
    await store.run_finished(stale, "SUCCESS", None)
    await store.run_finished(fresh, "SUCCESS", None)
    runs = {r.fencing_token: r for r in await store.history("report", 10)}
    assert runs[6].status == "SUCCESS"
    assert runs[5].status == "FAIL"
    assert runs[5].error is not None
    assert runs[5].error.startswith("abandoned: the tick was taken over")


def _run(run_key: str, token: int | None, schedule: str = "report") -> RunStart:
    return RunStart(
        schedule=schedule,
        run_key=run_key,
        source="tick",
        scheduled_at=datetime(2026, 12, 1, 9, 0, tzinfo=UTC),
        attempt=1,
        fencing_token=token,
        replica=Replica(replica_id=str(uuid.uuid4()), host="replica", pid=token or 0),
    )


async def test_runs_started_together_get_their_ids_in_order(store: ScheduleStore) -> None:
    runs = [_run(f"2026-12-01T09:{i:02d}:00Z", i + 1, schedule=f"s{i % 3}") for i in range(7)]
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
    store: ScheduleStore,
) -> None:
    tick, other = "2026-12-01T09:00:00Z", "2026-12-01T10:00:00Z"
    earlier = await store.run_started(_run(tick, 4))
    newest, older, unfenced, elsewhere = await store.runs_started(
        [_run(tick, 6), _run(tick, 5), _run(tick, None), _run(other, 1)]
    )
    runs = {(r.run_key, r.fencing_token): r for r in await store.history("report", 10)}
    abandoned = "abandoned: the tick was taken over (fencing token 6)"
    assert [(runs[tick, t].status, runs[tick, t].error) for t in (4, 5, 6, None)] == [
        ("FAIL", abandoned),
        ("FAIL", abandoned),
        ("RUNNING", None),
        ("RUNNING", None),
    ]
    assert runs[tick, 5].finished_at is not None
    assert runs[other, 1].status == "RUNNING"
    await store.runs_finished(
        [
            RunFinish(run_id=run_id, status="SUCCESS", error=None)
            for run_id in (earlier, older, newest, unfenced, elsewhere)
        ]
    )
    runs = {(r.run_key, r.fencing_token): r for r in await store.history("report", 10)}
    assert [runs[tick, t].status for t in (4, 5, 6, None)] == ["FAIL", "FAIL", "SUCCESS", "SUCCESS"]
    assert runs[other, 1].status == "SUCCESS"


async def test_members_carry_each_replicas_digest_and_its_declared_names(
    store: ScheduleStore,
) -> None:
    mine = Replica(replica_id=str(uuid.uuid4()), host="a", pid=1)
    other = Replica(replica_id=str(uuid.uuid4()), host="b", pid=2)
    tag = uuid.uuid4().hex[:8]
    await store.sync(mine, [_declared(f"m-{tag}-1"), _declared(f"m-{tag}-2")])
    await store.sync(other, [_declared(f"m-{tag}-1")])
    ids = {mine.replica_id, other.replica_id}

    def ours(rows: list[Any] | None) -> dict[str, str | None]:
        assert rows is not None
        return {r.replica_id: r.digest for r in rows if r.replica_id in ids}

    # The statement reads the rows as they were before its own write.
    assert ours(await store.members(mine, f"dm-{tag}", 30_000)) == dict.fromkeys(ids)
    assert ours(await store.members(other, f"do-{tag}", 30_000)) == {
        mine.replica_id: f"dm-{tag}",
        other.replica_id: None,
    }
    assert ours(await store.members(mine, f"dm-{tag}", 30_000)) == {
        mine.replica_id: f"dm-{tag}",
        other.replica_id: f"do-{tag}",
    }
    assert set(await store.declared_versions(f"dm-{tag}")) == {f"m-{tag}-1", f"m-{tag}-2"}
    assert await store.declared_versions(f"do-{tag}") == {
        f"m-{tag}-1": _declared(f"m-{tag}-1").fingerprint
    }
    assert await store.declared_versions(f"unknown-{tag}") == {}
    await store.leave(other)
    assert ours(await store.members(mine, f"dm-{tag}", 30_000)) == {mine.replica_id: f"dm-{tag}"}
    assert await store.declared_versions(f"do-{tag}") == {}
