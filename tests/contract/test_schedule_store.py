"""The schedule store contract (``ScheduleStore``), run against memory and real PostgreSQL alike:
the schedule rows and their revisions, control writes and the action log. Replicas and
declarations: ``test_schedule_store_replicas.py``; run history and lease reads:
``test_schedule_store_runs.py``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sdcore.scheduling import ScheduleAdmin, ScheduleControlError
from sdcore.scheduling._control import (
    DEFAULT_LIVE_MS,
    ActionKind,
    Changes,
    ControlAction,
    Write,
)
from tests.contract._schedules import Schedules, control, declared, replica, stored

REPLICA = replica(handlers=("digest",))


async def _write(schedules: Schedules, write: Write) -> ControlAction:
    action = await schedules.store.write(write)
    assert action is not None
    return action


def _pause_fields(state: Any) -> tuple[Any, ...]:
    return (state.paused, state.paused_at is not None, state.paused_by, state.paused_reason)


async def test_pause_fields_agree_after_resume_and_re_create(schedules: Schedules) -> None:
    store = schedules.store
    admin = ScheduleAdmin(store)
    await store.sync(REPLICA, [declared("beat")])
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


async def test_remove_closes_the_open_actions(schedules: Schedules) -> None:
    store = schedules.store
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


async def test_an_update_merged_from_an_old_version_is_refused(schedules: Schedules) -> None:
    store = schedules.store
    admin = ScheduleAdmin(store)
    await store.sync(REPLICA, [])
    await admin.create("s2", handler="digest", every_ms=60_000, actor="ops")
    await store.declare(REPLICA, "s2", "x")
    read = await store.row("s2")
    assert read is not None
    states = {s.name: s for s in await admin.list_schedules()}
    assert states["s2"].version == read.revision
    await admin.pause("s2", actor="ops")  # a change between the read and the write
    definition = declared("s2")
    stale = Write(
        name="s2",
        action=ActionKind.UPDATE,
        actor="ops",
        reason=None,
        stored=definition,
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
        stored=definition,
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


async def test_a_retried_request_finds_its_action_with_no_replica_live(
    schedules: Schedules,
) -> None:
    store = schedules.store
    # The retry after a lost COMMIT reply comes when the database is back, possibly before any
    # replica has heartbeated again: it must return the recorded action, not refuse with "no
    # running replica declares this schedule; nothing changed" (the action is recorded).
    admin = ScheduleAdmin(store)
    await store.sync(REPLICA, [declared("beat")])
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


async def test_revisions_order_every_control_change(schedules: Schedules) -> None:
    store = schedules.store
    assert await store.revision() == 0
    assert await store.rows(None) == []
    assert await store.rows(0) == []
    assert await store.row("beat") is None
    await store.sync(REPLICA, [declared("beat"), declared("alpha")])
    assert await store.revision() == 0  # code definitions are no control change
    # A starting replica needs only paused, stored and recently resumed rows.
    assert await store.rows(None) == []
    created = await _write(schedules, stored("s1"))
    after_create = await store.revision()
    assert after_create > 0
    await _write(schedules, control("beat", ActionKind.PAUSE))
    after_pause = await store.revision()
    assert after_pause > after_create
    assert [r.name for r in await store.rows(0)] == ["s1", "beat"]  # in revision order
    assert [r.name for r in await store.rows(after_create)] == ["beat"]
    assert await store.rows(after_pause) == []
    assert {r.name for r in await store.rows(None)} == {"s1", "beat"}
    # A write's action is drawn from the same sequence after its row change.
    assert created.id > 0
    await _write(schedules, control("s1", ActionKind.REMOVE))
    (removed,) = await store.rows(after_pause)
    assert (removed.name, removed.removed_at is not None) == ("s1", True)
    assert removed.revision == await store.revision()
    assert {r.name for r in await store.rows(None)} == {"beat"}
    # Resumed: still loaded at start (its pause's skips are start-up catch-up's within the
    # window), with the pause's start and the resume's instant.
    await _write(schedules, control("beat", ActionKind.RESUME))
    (resumed,) = await store.rows(None)
    assert resumed.name == "beat"
    assert resumed.paused is False
    assert resumed.paused_at is not None
    assert resumed.resumed_at is not None
    assert resumed.resumed_at >= resumed.paused_at
    row = await store.row("s1")  # a removed row is still read by name
    assert row is not None
    assert row.removed_at is not None
    # A refused write changes no revision.
    before = await store.revision()
    assert await store.write(control("s1", ActionKind.PAUSE)) is None
    assert await store.revision() == before


async def test_changes_tell_a_poll_whether_rows_or_actions_wait(schedules: Schedules) -> None:
    store = schedules.store
    assert await store.changes() == Changes(revision=0, actions_open=False)
    await store.sync(REPLICA, [declared("beat")])
    assert await store.changes() == Changes(revision=0, actions_open=False)
    await _write(schedules, control("beat", ActionKind.PAUSE))  # done at once: no open action
    paused = await store.changes()
    assert paused == Changes(revision=await store.revision(), actions_open=False)
    assert paused.revision > 0
    trigger = await _write(schedules, control("beat", ActionKind.TRIGGER))
    assert await store.changes() == Changes(revision=paused.revision, actions_open=True)
    await store.finish_action(trigger.id, "SUCCESS", None)
    assert await store.changes() == Changes(revision=paused.revision, actions_open=False)
    await _write(schedules, control("beat", ActionKind.RESUME))
    assert (await store.changes()).revision == await store.revision() > paused.revision


async def test_pause_and_resume_apply_once(schedules: Schedules) -> None:
    store = schedules.store
    assert await store.write(control("nothing", ActionKind.PAUSE)) is None
    assert await store.actions("nothing", 10) == []
    await store.sync(REPLICA, [declared("beat")])
    assert await store.write(control("beat", ActionKind.RESUME)) is None
    pause = await _write(
        schedules, control("beat", ActionKind.PAUSE, actor="alice", reason="INC-1")
    )
    assert (pause.schedule, pause.action, pause.actor, pause.reason) == (
        "beat",
        ActionKind.PAUSE,
        "alice",
        "INC-1",
    )
    assert (pause.outcome, pause.progress, pause.request_id, pause.replayed) == (
        "done",
        None,
        None,
        False,
    )
    assert dict(pause.params) == {}
    assert pause.created_at.tzinfo is not None
    assert pause.finished_at is not None
    paused = await store.row("beat")
    assert paused is not None
    assert (paused.paused, paused.paused_at is not None, paused.resumed_at) == (True, True, None)
    assert await store.write(control("beat", ActionKind.PAUSE)) is None
    resume = await _write(schedules, control("beat", ActionKind.RESUME))
    resumed = await store.row("beat")
    assert resumed is not None
    # paused_at stays: the resume's catch-up starts there.
    assert (resumed.paused, resumed.paused_at, resumed.resumed_at is not None) == (
        False,
        paused.paused_at,
        True,
    )
    assert await store.write(control("beat", ActionKind.RESUME)) is None
    assert [a.id for a in await store.actions("beat", 10)] == [resume.id, pause.id]
    assert [a.id for a in await store.actions("beat", 1)] == [resume.id]
    assert await store.action(pause.id) == pause


async def test_remove_frees_a_name_no_live_replica_declares(schedules: Schedules) -> None:
    store = schedules.store
    assert await store.write(control("nothing", ActionKind.REMOVE)) is None
    await store.sync(REPLICA, [declared("beat")])
    assert await store.write(control("beat", ActionKind.REMOVE)) is None  # declared, live
    assert await store.write(stored("beat")) is None  # nor may a create take it
    await schedules.age(DEFAULT_LIVE_MS + 1_000)
    taken = await _write(schedules, stored("beat"))  # dropped from the code: the name is free
    row = await store.row("beat")
    assert row is not None
    assert (row.origin, row.handler, row.revision) == ("stored", "digest", await store.revision())
    assert taken.action is ActionKind.CREATE
    await store.sync(replica(), [declared("alpha")])
    await schedules.age(DEFAULT_LIVE_MS + 1_000)
    await _write(schedules, control("alpha", ActionKind.REMOVE))
    assert await store.write(control("alpha", ActionKind.REMOVE)) is None


async def test_remove_then_create_starts_a_new_schedule(schedules: Schedules) -> None:
    store = schedules.store
    await _write(schedules, stored("s1", args={"customer": "acme"}))
    await _write(schedules, control("s1", ActionKind.PAUSE, reason="old customer"))
    trigger = await _write(schedules, control("s1", ActionKind.TRIGGER))
    await _write(schedules, control("s1", ActionKind.REMOVE))
    assert await store.write(control("s1", ActionKind.RESUME)) is None
    update = stored("s1", ActionKind.UPDATE, expected_revision=await store.revision())
    assert await store.write(update) is None  # an update never brings a schedule back
    await _write(schedules, stored("s1", every_ms=30_000, args={"customer": "globex"}))
    row = await store.row("s1")
    assert row is not None
    assert (row.expression, dict(row.args or {}), row.removed_at) == (
        "30000",
        {"customer": "globex"},
        None,
    )
    assert (row.paused, row.paused_at, row.resumed_at) == (False, None, None)
    cancelled = await store.action(trigger.id)
    assert cancelled is not None
    assert cancelled.outcome == "CANCELLED"
    (state,) = await store.states()
    assert (state.paused, state.paused_by, state.paused_reason) == (False, None, None)


async def test_an_update_changes_only_a_live_stored_schedule_at_its_revision(
    schedules: Schedules,
) -> None:
    store = schedules.store
    await store.sync(REPLICA, [declared("beat")])
    assert await store.write(stored("beat", ActionKind.UPDATE, expected_revision=0)) is None
    assert await store.write(stored("nothing", ActionKind.UPDATE, expected_revision=0)) is None
    await _write(schedules, stored("s1"))
    await _write(schedules, control("s1", ActionKind.PAUSE))
    at = await store.row("s1")
    assert at is not None
    update = stored("s1", ActionKind.UPDATE, every_ms=5_000, expected_revision=at.revision)
    done = await _write(schedules, update)
    assert (done.action, done.outcome) == (ActionKind.UPDATE, "done")
    row = await store.row("s1")
    assert row is not None
    assert (row.expression, row.paused, row.paused_at) == ("5000", True, at.paused_at)
    assert row.revision > at.revision
    assert await store.write(update) is None  # its revision is gone now


async def test_a_request_id_records_one_action_per_schedule(schedules: Schedules) -> None:
    store = schedules.store
    await store.sync(REPLICA, [declared("beat"), declared("alpha")])
    params = {"start": "2026-12-01T00:00:00+00:00", "concurrency": 2, "rerun_succeeded": False}
    first = await _write(
        schedules, control("beat", ActionKind.BACKFILL, request_id="req-1", params=params)
    )
    assert (first.request_id, first.outcome, first.finished_at, first.replayed) == (
        "req-1",
        None,
        None,
        False,
    )
    assert dict(first.params) == params
    again = await _write(schedules, control("beat", ActionKind.BACKFILL, request_id="req-1"))
    assert (again.id, again.replayed, dict(again.params)) == (first.id, True, params)
    # Whatever the retry asks: the request id names what was recorded, and nothing new is.
    pause = await _write(schedules, control("beat", ActionKind.PAUSE, request_id="req-1"))
    assert (pause.id, pause.action, pause.replayed) == (first.id, ActionKind.BACKFILL, True)
    beat = await store.row("beat")
    assert beat is not None
    assert not beat.paused
    assert [a.id for a in await store.actions("beat", 10)] == [first.id]
    found = await store.action_of_request("beat", "req-1")
    assert found is not None
    assert (found.id, found.replayed) == (first.id, True)
    assert await store.action_of_request("beat", "req-2") is None
    assert await store.action_of_request("alpha", "req-1") is None
    other = await _write(schedules, control("alpha", ActionKind.TRIGGER, request_id="req-1"))
    assert (other.id != first.id, other.replayed) == (True, False)
    plain = [await _write(schedules, control("beat", ActionKind.TRIGGER)) for _ in range(2)]
    assert plain[0].id != plain[1].id  # no request id: every write is its own


async def test_open_actions_progress_and_finish(schedules: Schedules) -> None:
    store = schedules.store
    await store.sync(REPLICA, [declared("beat"), declared("alpha")])
    trigger = await _write(schedules, control("beat", ActionKind.TRIGGER))
    backfill = await _write(schedules, control("beat", ActionKind.BACKFILL))
    elsewhere = await _write(schedules, control("alpha", ActionKind.TRIGGER))
    await _write(schedules, control("beat", ActionKind.PAUSE))
    assert [a.id for a in await store.open_actions(["beat"])] == [trigger.id, backfill.id]
    assert [a.id for a in await store.open_actions(["alpha", "beat"])] == [
        trigger.id,
        backfill.id,
        elsewhere.id,
    ]
    assert await store.open_actions([]) == []
    assert await store.open_actions(["nothing"]) == []
    await store.set_progress(backfill.id, {"total": 3, "remaining": 3})
    await store.set_progress(backfill.id, {"total": 3, "remaining": 1})
    opened = await store.action(backfill.id)
    assert opened is not None
    assert (opened.progress, opened.finished_at) == ({"total": 3, "remaining": 1}, None)
    await store.finish_action(backfill.id, "SUCCESS", None)  # the progress stays
    done = await store.action(backfill.id)
    assert done is not None
    assert (done.outcome, done.progress) == ("SUCCESS", {"total": 3, "remaining": 1})
    assert done.finished_at is not None
    # A closed action stays as it closed.
    await store.finish_action(backfill.id, "FAIL", {"total": 3, "remaining": 0})
    await store.set_progress(backfill.id, {"total": 9})
    assert await store.action(backfill.id) == done
    await store.finish_action(trigger.id, "FAIL", {"error": "boom"})
    failed = await store.action(trigger.id)
    assert failed is not None
    assert (failed.outcome, failed.progress) == ("FAIL", {"error": "boom"})
    assert await store.open_actions(["beat"]) == []
    assert [a.id for a in await store.open_actions(["alpha", "beat"])] == [elsewhere.id]
    await store.finish_action(10**9, "SUCCESS", None)  # an unknown action: nothing happens
    await store.set_progress(10**9, {"total": 1})
    assert await store.action(10**9) is None
    assert await store.actions("nothing", 10) == []
