"""The schedule store contract, replicas and declarations: ``sync``, ``declare``, ``heartbeat``,
``members``, ``declared_versions``, ``leave``, ``live_declarers``, ``live_handlers`` and
``states``, against memory and real PostgreSQL alike."""

from __future__ import annotations

from typing import Any

from sdcore.scheduling import ScheduleAdmin
from sdcore.scheduling._control import DEFAULT_LIVE_MS, ActionKind, MemberRow, Replica
from tests.contract._schedules import (
    Schedules,
    control,
    declared,
    replica,
    run_start,
    stored,
)

TICK = "2026-12-01T09:00:00Z"
# PostgreSQL forgets a replica not seen for ten times live_ms at the next sync of any replica.
EXPIRY_MS = 10 * DEFAULT_LIVE_MS


async def _state(schedules: Schedules, name: str) -> Any:
    (state,) = [s for s in await schedules.store.states() if s.name == name]
    return state


async def test_sync_records_code_schedules_and_reports_mixed_versions(
    schedules: Schedules,
) -> None:
    store = schedules.store
    assert store.live_ms == DEFAULT_LIVE_MS
    first, second = replica(pid=1), replica(pid=2)
    beat, alpha = declared("beat"), declared("alpha")
    assert await store.sync(first, [beat, alpha]) == []
    row = await store.row("beat")
    assert row is not None
    assert (row.origin, row.kind, row.expression, row.time_zone) == (
        "code",
        "interval",
        "60000",
        "UTC",
    )
    assert (row.fingerprint, dict(row.options), row.day_rule) == (
        beat.fingerprint,
        dict(beat.options),
        "vixie",
    )
    assert (row.handler, row.args, row.paused, row.paused_at, row.removed_at) == (
        None,
        None,
        False,
        None,
        None,
    )
    assert row.revision == 0  # a code definition is no control change: pollers read none
    # A second version of "beat" (a rolling deploy): the last sync's definition is the row's.
    assert await store.sync(second, [declared("beat", 30_000)]) == ["beat"]
    row = await store.row("beat")
    assert row is not None
    assert (row.expression, row.revision) == ("30000", 0)
    assert sorted(await store.sync(first, [beat, alpha])) == ["beat"]
    assert (await _state(schedules, "beat")).versions == 2
    assert (await _state(schedules, "alpha")).versions == 1
    # Once the other version's replica is no longer live, the versions agree again.
    await schedules.age(DEFAULT_LIVE_MS + 1_000)
    assert await store.sync(first, [beat, alpha]) == []
    assert await store.live_declarers("beat") == 1


async def test_sync_keeps_a_pause_and_leaves_a_stored_schedule_alone(
    schedules: Schedules,
) -> None:
    store = schedules.store
    me = replica()
    await store.sync(me, [declared("beat")])
    paused = await store.write(control("beat", ActionKind.PAUSE, reason="why"))
    assert paused is not None
    revision = await store.revision()
    await store.sync(me, [declared("beat", 30_000)])
    row = await store.row("beat")
    assert row is not None
    assert (row.expression, row.paused, row.revision) == ("30000", True, revision)
    assert await store.write(stored("s1", args={"customer": "acme"})) is not None
    before = await store.row("s1")
    await store.sync(me, [declared("beat", 30_000), declared("s1", 30_000)])
    assert await store.row("s1") == before


async def test_sync_takes_over_a_removed_schedule_with_none_of_its_state(
    schedules: Schedules,
) -> None:
    store = schedules.store
    assert await store.write(stored("s1", args={"customer": "acme"})) is not None
    assert await store.write(control("s1", ActionKind.PAUSE)) is not None
    assert await store.write(control("s1", ActionKind.REMOVE)) is not None
    await store.sync(replica(), [declared("s1", 30_000)])
    row = await store.row("s1")
    assert row is not None
    assert (row.origin, row.expression, row.handler, row.args) == ("code", "30000", None, None)
    assert (row.paused, row.paused_at, row.resumed_at, row.removed_at) == (False, None, None, None)
    state = await _state(schedules, "s1")
    assert (state.paused, state.paused_by, state.paused_reason) == (False, None, None)


async def test_declare_adds_and_drops_one_declaration(schedules: Schedules) -> None:
    store = schedules.store
    me = replica(host="web", pid=7)
    await store.sync(me, [])
    create = stored("s1")
    assert await store.write(create) is not None
    assert create.stored is not None
    await store.declare(me, "s1", create.stored.fingerprint, create.stored.definition())
    assert await store.live_declarers("s1") == 1
    state = await _state(schedules, "s1")
    assert state.replicas == ("web:7",)
    (version,) = state.live_versions
    assert (version.kind, version.expression, version.replicas) == ("interval", "60000", ("web:7",))
    await store.declare(me, "s1", None)
    assert await store.live_declarers("s1") == 0
    assert (await _state(schedules, "s1")).live_versions == ()
    await store.declare(me, "never-declared", None)  # dropping nothing is no error


async def test_a_declaration_without_its_definition_shows_the_one_known(
    schedules: Schedules,
) -> None:
    store = schedules.store
    me = replica()
    beat = declared("beat")
    await store.sync(me, [beat])
    # The same version declared again without a definition: the row's (and the one recorded
    # before) still describe it.
    await store.declare(me, "beat", beat.fingerprint, None)
    (version,) = (await _state(schedules, "beat")).live_versions
    assert (version.fingerprint, version.kind, version.expression) == (
        beat.fingerprint,
        "interval",
        "60000",
    )
    create = stored("s1")
    assert await store.write(create) is not None
    assert create.stored is not None
    await store.declare(me, "s1", "f-other", {"kind": "interval", "expression": "5000"})
    await store.declare(me, "s1", "f-other", None)
    (version,) = (await _state(schedules, "s1")).live_versions
    assert (version.kind, version.expression) == ("interval", "5000")
    # A version nobody described (a replica of an sdcore that records no definitions).
    await store.declare(me, "beat", "f-unknown", None)
    (version,) = (await _state(schedules, "beat")).live_versions
    assert (version.fingerprint, version.kind, version.options) == ("f-unknown", None, None)


async def test_heartbeat_keeps_a_replica_live_and_tells_one_forgotten(
    schedules: Schedules,
) -> None:
    store = schedules.store
    me, other = replica(pid=1), replica(pid=2)
    assert not await store.heartbeat(me)  # never synced
    await store.sync(me, [declared("beat")])
    assert await store.heartbeat(me)
    await schedules.age(DEFAULT_LIVE_MS + 1_000)
    assert await store.live_declarers("beat") == 0
    assert await store.heartbeat(me)  # seen again: live, declarations and all
    assert await store.live_declarers("beat") == 1
    # Not seen for ten times live_ms: the next sync (any replica's) forgets it.
    await schedules.age(EXPIRY_MS + 1_000)
    await store.sync(other, [])
    assert not await store.heartbeat(me)
    assert await store.sync(me, [declared("beat")]) == []  # syncing again brings it back
    assert await store.heartbeat(me)
    await store.leave(me)
    assert not await store.heartbeat(me)


async def test_members_carry_each_replicas_digest_and_its_declared_names(
    schedules: Schedules,
) -> None:
    store = schedules.store
    mine, other = replica(host="a", pid=1), replica(host="b", pid=2)
    await store.sync(mine, [declared("m-1"), declared("m-2")])
    await store.sync(other, [declared("m-1")])
    ids = {mine.replica_id, other.replica_id}

    def digests(rows: list[MemberRow] | None) -> dict[str, str | None]:
        assert rows is not None
        assert len(rows) == len({r.replica_id for r in rows})
        return {r.replica_id: r.digest for r in rows}

    # The statement reads the rows as they were before its own write.
    assert digests(await store.members(mine, "dm", 30_000)) == dict.fromkeys(ids)
    assert digests(await store.members(other, "do", 30_000)) == {
        mine.replica_id: "dm",
        other.replica_id: None,
    }
    assert digests(await store.members(mine, "dm", 30_000)) == {
        mine.replica_id: "dm",
        other.replica_id: "do",
    }
    assert set(await store.declared_versions("dm")) == {"m-1", "m-2"}
    assert await store.declared_versions("do") == {"m-1": declared("m-1").fingerprint}
    assert await store.declared_versions("unknown") == {}
    # An unknown replica reads the members and records nothing.
    stranger = replica(host="c", pid=3)
    assert digests(await store.members(stranger, "ds", 30_000)) == {
        mine.replica_id: "dm",
        other.replica_id: "do",
    }
    assert await store.declared_versions("ds") == {}
    await store.leave(other)
    assert digests(await store.members(mine, "dm", 30_000)) == {mine.replica_id: "dm"}
    assert await store.declared_versions("do") == {}


async def test_members_are_the_replicas_seen_within_the_ttl(schedules: Schedules) -> None:
    store = schedules.store
    mine, other = replica(pid=1), replica(pid=2)
    await store.sync(mine, [])
    await store.sync(other, [])
    await schedules.age(5_000)
    # Neither seen within 4 s before the call; the call marks this one seen (a heartbeat).
    assert await store.members(mine, "dm", 4_000) == []
    assert await store.members(mine, "dm", 4_000) == [
        MemberRow(replica_id=mine.replica_id, digest="dm")
    ]
    rows = await store.members(mine, "dm", 6_000)
    assert rows is not None
    assert {r.replica_id for r in rows} == {mine.replica_id, other.replica_id}
    await schedules.age(5_000)
    # Marked alive by members alone: live as by heartbeat, the other one not.
    rows = await store.members(other, "do", 5_500)
    assert rows == [MemberRow(replica_id=mine.replica_id, digest="dm")]


async def test_members_of_a_forgotten_replica_mark_nothing(schedules: Schedules) -> None:
    store = schedules.store
    me, other = replica(pid=1), replica(pid=2)
    await store.sync(me, [])
    await schedules.age(EXPIRY_MS + 1_000)
    await store.sync(other, [])  # forgets me
    rows = await store.members(me, "dm", 30_000)
    assert rows is not None
    assert me.replica_id not in {r.replica_id for r in rows}
    assert not await store.heartbeat(me)  # still forgotten: sync again


async def test_leave_forgets_the_replica_and_its_declarations(schedules: Schedules) -> None:
    store = schedules.store
    me = replica()
    await store.sync(me, [declared("beat")])
    await store.members(me, "dm", 30_000)
    await store.leave(me)
    assert await store.live_declarers("beat") == 0
    assert await store.declared_versions("dm") == {}
    assert await store.members(replica(), "x", 30_000) == []
    state = await _state(schedules, "beat")
    assert (state.replicas, state.live_versions, state.undeclared) == ((), (), True)
    await store.leave(me)  # twice, or a replica never seen: no error
    # The row stays (a code schedule outlives its replicas until removed).
    assert (await store.row("beat")) is not None


async def test_live_handlers_are_those_of_live_replicas(schedules: Schedules) -> None:
    store = schedules.store
    assert await store.live_handlers() == set()
    first = replica(pid=1, handlers=("digest", "mail"))
    second = replica(pid=2, handlers=("digest",))
    await store.sync(first, [])
    await store.sync(second, [])
    assert await store.live_handlers() == {"digest", "mail"}
    await schedules.age(DEFAULT_LIVE_MS + 1_000)
    assert await store.live_handlers() == set()
    await store.heartbeat(second)
    assert await store.live_handlers() == {"digest"}
    # A replica's sync replaces the handlers it registers.
    await store.sync(Replica(replica_id=second.replica_id, host="replica", pid=2, handlers=()), [])
    assert await store.live_handlers() == set()


async def test_live_declarers_count_live_replicas_only(schedules: Schedules) -> None:
    store = schedules.store
    first, second = replica(pid=1), replica(pid=2)
    assert await store.live_declarers("beat") == 0
    await store.sync(first, [declared("beat")])
    await schedules.age(DEFAULT_LIVE_MS + 1_000)
    await store.sync(second, [declared("beat"), declared("alpha")])
    assert await store.live_declarers("beat") == 1
    assert await store.live_declarers("alpha") == 1
    await store.heartbeat(first)
    assert await store.live_declarers("beat") == 2


async def test_states_list_every_live_schedule_by_name(schedules: Schedules) -> None:
    store = schedules.store
    me = replica(host="web", pid=3)
    await store.sync(me, [declared("beat"), declared("alpha")])
    await store.write(stored("s1", args={"customer": "acme"}))
    await store.write(stored("gone"))
    await store.write(control("gone", ActionKind.REMOVE))
    await store.write(control("alpha", ActionKind.PAUSE, actor="alice", reason="INC-1"))
    run_id = await store.run_started(run_start(TICK, 1, schedule="beat"))
    states = {s.name: s for s in await store.states()}
    assert list(states) == ["alpha", "beat", "s1"]
    alpha, beat, s1 = states["alpha"], states["beat"], states["s1"]
    assert (alpha.paused, alpha.paused_by, alpha.paused_reason) == (True, "alice", "INC-1")
    assert alpha.paused_at is not None
    assert (beat.paused, beat.paused_at, beat.paused_by, beat.paused_reason) == (
        False,
        None,
        None,
        None,
    )
    assert (beat.last_status, beat.replicas, beat.versions) == ("RUNNING", ("web:3",), 1)
    assert beat.last_run_at is not None
    assert beat.last_seen_at is not None
    assert (alpha.last_run_at, alpha.last_status) == (None, None)
    assert (s1.origin, s1.handler, dict(s1.args or {}), s1.replicas) == (
        "stored",
        "digest",
        {"customer": "acme"},
        (),
    )
    assert not s1.undeclared  # a stored schedule is no code one dropped from the code
    assert (beat.origin, beat.kind, beat.expression, beat.time_zone) == (
        "code",
        "interval",
        "60000",
        "UTC",
    )
    assert dict(beat.options) == dict(declared("beat").options)
    for name, state in states.items():
        row = await store.row(name)
        assert row is not None
        assert state.version == row.revision
    await store.run_finished(run_id, "SUCCESS", None)
    assert (await _state(schedules, "beat")).last_status == "SUCCESS"
    await schedules.age(DEFAULT_LIVE_MS + 1_000)
    beat = await _state(schedules, "beat")
    assert (beat.replicas, beat.versions, beat.last_seen_at, beat.undeclared) == ((), 0, None, True)


async def test_replicas_and_live_versions_are_listed_in_one_order(schedules: Schedules) -> None:
    store = schedules.store
    # Replicas by host then pid (as numbers: 999 before 1000), live versions by the start of
    # their oldest replica (during a deploy the old version first), whatever their fingerprints.
    old_def, new_def = sorted(
        (declared("beat", 60_000), declared("beat", 30_000)),
        key=lambda d: d.fingerprint,
        reverse=True,
    )
    old, new = replica(host="web", pid=1000), replica(host="web", pid=999)
    await store.sync(old, [old_def])
    await schedules.now()
    await store.sync(new, [new_def])
    (state,) = [s for s in await ScheduleAdmin(store).list_schedules() if s.name == "beat"]
    assert state.replicas == ("web:999", "web:1000")
    assert [v.fingerprint for v in state.live_versions] == [
        old_def.fingerprint,
        new_def.fingerprint,
    ]
    assert [v.replicas for v in state.live_versions] == [("web:1000",), ("web:999",)]
    assert [v.expression for v in state.live_versions] == [
        old_def.expression,
        new_def.expression,
    ]
