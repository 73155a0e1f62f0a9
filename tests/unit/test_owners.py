"""Owners: which replicas ask for an exclusive schedule's ticks (``sdcore.scheduling._owners``).

The rank function on its own, then real schedulers and control planes on one shared in-memory
"database" on loop time: how many replicas ask for each tick, and what happens when owners die.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import pytest

import sdcore.scheduling._owners as owners_module
from sdcore.job_scheduler import AttemptAcquireResult, AttemptBudget, JobAcquireOptions
from sdcore.scheduling import ScheduleAdmin, ScheduleControl, Scheduler, Tick
from sdcore.scheduling._owners import OWNERS, Member, Owners, second_delay
from sdcore.scheduling._policy import StartPath
from sdcore.testing import MemoryJobScheduler, MemoryScheduleStore
from tests.unit._looptime import BASE, block_loop, in_loop_time

# --- the rank on its own ----------------------------------------------------------------------


def _instant(run_key: str) -> datetime:
    return datetime.fromisoformat(run_key.replace("Z", "+00:00"))


def _ids(n: int) -> list[str]:
    return [str(uuid.UUID(int=i + 1)) for i in range(n)]


def _views(ids: list[str], names: dict[str, frozenset[str]] | None = None) -> list[Owners]:
    views = []
    for me in ids:
        owners = Owners(me, stale_s=15.0, clock=lambda: 0.0)
        owners.update(Member(r, None if names is None else names.get(r)) for r in ids)
        views.append(owners)
    return views


def test_every_schedule_has_exactly_one_replica_of_each_rank_and_the_load_spreads() -> None:
    ids = _ids(24)
    views = _views(ids)
    firsts: Counter[str] = Counter()
    for i in range(2_400):
        name = f"digest-{i}"
        ranks = sorted(v.rank(name) for v in views)
        assert ranks == list(range(24))
        firsts[ids[[v.rank(name) for v in views].index(0)]] += 1
    # 100 schedules per replica on average: none carries more than twice its share.
    assert len(firsts) == 24
    assert max(firsts.values()) < 200


def test_a_replica_leaving_moves_only_the_schedules_it_owned() -> None:
    ids = _ids(10)
    before = _views(ids)
    after = _views(ids[1:])  # the first replica left
    for i in range(500):
        name = f"s{i}"
        old = {ids[j] for j, v in enumerate(before) if v.owns(name)}
        new = {ids[1:][j] for j, v in enumerate(after) if v.owns(name)}
        if ids[0] not in old:
            assert new == old  # rendezvous hashing: nothing else moves
        else:
            assert old - {ids[0]} <= new
            assert len(new) == OWNERS


def test_only_replicas_that_declare_a_schedule_own_it() -> None:
    ids = _ids(4)
    names = {ids[0]: frozenset({"a"}), ids[1]: frozenset({"a"})}  # ids 2, 3: as their viewer
    for name in ("a", "b"):
        views = _views(ids, names)
        # Each replica is asked only about what it declares: "b" is declared by 2 and 3 only.
        declaring = [v for v, r in zip(views, ids, strict=True) if r not in names or name == "a"]
        ranks = sorted(v.rank(name) for v in declaring)
        assert ranks == list(range(len(declaring)))


def test_ranks_adjusted_on_a_view_change_equal_ranks_counted_afresh() -> None:
    rng = random.Random(7)
    ids = _ids(16)
    names = [f"s{i}" for i in range(300)]
    kept = Owners(ids[0], stale_s=15.0, clock=lambda: 0.0)
    for _ in range(40):
        live = [r for r in ids[1:] if rng.random() < 0.7]
        declared = {
            r: None if rng.random() < 0.6 else frozenset(rng.sample(names, 150)) for r in live
        }
        kept.update(Member(r, declared[r]) for r in live)
        fresh = Owners(ids[0], stale_s=15.0, clock=lambda: 0.0)
        fresh.update(Member(r, declared[r]) for r in live)
        assert [kept.rank(n) for n in names] == [fresh.rank(n) for n in names]


def test_ranks_adjusted_when_replicas_add_or_drop_a_few_names() -> None:
    rng = random.Random(11)
    ids = _ids(12)
    names = [f"s{i}" for i in range(400)]
    declared = {r: frozenset(rng.sample(names, 300)) for r in ids[1:]}
    kept = Owners(ids[0], stale_s=15.0, clock=lambda: 0.0)
    kept.update(Member(r, declared[r]) for r in ids[1:])
    assert [kept.rank(n) for n in names]  # every rank computed, then adjusted
    for _ in range(30):
        for r in rng.sample(ids[1:], 5):
            added = set(rng.sample(names, 3))
            dropped = set(rng.sample(sorted(declared[r]), 3))
            declared[r] = frozenset((declared[r] - dropped) | added)
        live = [r for r in ids[1:] if rng.random() < 0.9]
        kept.update(Member(r, declared[r]) for r in live)
        fresh = Owners(ids[0], stale_s=15.0, clock=lambda: 0.0)
        fresh.update(Member(r, declared[r]) for r in live)
        assert [kept.rank(n) for n in names] == [fresh.rank(n) for n in names]


def test_no_view_or_a_stale_one_asks_for_everything() -> None:
    now = [0.0]
    owners = Owners(_ids(1)[0], stale_s=15.0, clock=lambda: now[0])
    assert owners.rank("s") == 0  # no view yet
    owners.update(Member(r) for r in _ids(30))
    ranks = [owners.rank(f"s{i}") for i in range(100)]
    assert max(ranks) > OWNERS  # most schedules are someone else's
    now[0] = 15.1
    assert [owners.rank(f"s{i}") for i in range(100)] == [0] * 100
    assert owners.members is None


def test_a_replicas_place_at_an_instant_is_never_above_its_rank_for_any_schedule_it_declares() -> (
    None
):
    """``place`` lets the timer look at an instant's owned ticks later: it must never say a
    replica is further down than its rank for one of them, whatever the others declare."""
    rng = random.Random(7)
    names = [f"s{i}" for i in range(40)]
    base = datetime(2026, 12, 7, 8, tzinfo=UTC)
    seen = Counter[int]()
    for trial in range(300):
        ids = _ids(rng.randint(1, 10))
        mine = frozenset(rng.sample(names, 30))
        owners = Owners(ids[0], stale_s=15.0, clock=lambda: 0.0)
        members = []
        for r in ids[1:]:
            kind = rng.random()
            declared = (
                mine  # the same version (one frozenset, as the control plane hands out)
                if kind < 0.5
                else None
                if kind < 0.6
                else frozenset(mine | set(rng.sample(names, 5)))
                if kind < 0.8
                else frozenset(rng.sample(sorted(mine), 25))
            )
            members.append(Member(r, declared))
        owners.update(members, mine if trial % 10 else None)
        for minute in range(5):
            instant = base + timedelta(minutes=minute)
            place = owners.place(instant, sorted(mine))
            seen[place] += 1
            assert all(place <= owners.fire_rank(name, instant) for name in mine)
            # A name it does not declare: its owners are not known to be those.
            assert owners.place(instant, ["not-declared"]) == 0
    assert set(seen) == {0, 1, 2, OWNERS}  # every place was reached


def test_a_replicas_place_is_0_without_a_fresh_view() -> None:
    now = [0.0]
    mine = frozenset({"a", "b"})
    owners = Owners(_ids(1)[0], stale_s=15.0, clock=lambda: now[0])
    instant = datetime(2026, 12, 7, 8, tzinfo=UTC)
    assert owners.place(instant, ["a"]) == 0  # no view yet
    owners.update([Member(r, mine) for r in _ids(30)], mine)
    assert max(owners.place(instant + timedelta(minutes=m), ["a"]) for m in range(10)) == OWNERS
    now[0] = 15.1
    assert [owners.place(instant + timedelta(minutes=m), ["a"]) for m in range(10)] == [0] * 10


def test_the_second_owner_waits_a_quarter_of_the_gap_to_the_next_instant_50_ms_to_1_s() -> None:
    assert second_delay(timedelta(seconds=1)) == 0.25
    assert second_delay(timedelta(milliseconds=100)) == 0.05
    assert second_delay(timedelta(hours=1)) == 1.0
    assert second_delay(None) == 1.0


# --- a cluster on loop time -------------------------------------------------------------------


class _Asking(MemoryJobScheduler):
    """Counts the keys each replica asks for."""

    def __init__(self, clock: Callable[[], datetime]) -> None:
        super().__init__(clock=clock)
        self.asked: Counter[str] = Counter()  # run key -> acquire offers

    async def acquire_attempts(
        self, items: Sequence[tuple[JobAcquireOptions, AttemptBudget]]
    ) -> list[AttemptAcquireResult]:
        for options, _ in items:
            self.asked[f"{options.code} {options.run_key}"] += 1
        return await super().acquire_attempts(items)


@dataclass
class _Cluster:
    now: Callable[[], datetime]
    jobs: _Asking
    store: MemoryScheduleStore
    ran: list[tuple[str, str, int, float]] = field(default_factory=list)
    replicas: list[tuple[Scheduler, ScheduleControl]] = field(default_factory=list)

    async def start(
        self,
        index: int,
        names: Sequence[str],
        *,
        heartbeat_ms: int = 1_000,
        cron: str | None = None,
        catch_up: Literal["off", "latest", "all"] = "all",
        stored: Callable[[Tick, dict[str, Any]], Awaitable[None]] | None = None,
        replica_id: str | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(jobs=self.jobs, lease_ms=2_000, clock=self.now)
        if stored is not None:
            scheduler.handler("work")(stored)
        for name in names:

            async def handler(tick: Tick, index: int = index) -> None:
                self.ran.append((tick.schedule, tick.run_key or "", index, loop.time()))

            if cron is None:
                scheduler.add_interval(name, 1_000, handler, catch_up=catch_up)
            else:
                scheduler.add_cron(name, cron, handler, catch_up=catch_up)
        control = ScheduleControl(
            scheduler, self.store, poll_interval_ms=200, heartbeat_ms=heartbeat_ms, clock=self.now
        )
        if replica_id is not None:
            control.replica = dataclasses.replace(control.replica, replica_id=replica_id)
        await control.start()
        await scheduler.start_all()
        self.replicas.append((scheduler, control))

    async def crash(self, index: int) -> None:
        """The process dies: nothing more runs, and it never leaves (its heartbeat lapses)."""
        scheduler, control = self.replicas[index]
        control._joined = False  # no leave() on the way out: a kill -9 sends none
        await control.aclose()
        await scheduler.aclose()

    async def stop_all(self) -> None:
        for scheduler, control in self.replicas:
            if control.running:
                await control.aclose()
            if scheduler.running:
                await scheduler.aclose()


def _cluster() -> _Cluster:
    loop = asyncio.get_running_loop()

    def now() -> datetime:
        return BASE + timedelta(seconds=loop.time())

    jobs = _Asking(now)
    return _Cluster(now=now, jobs=jobs, store=MemoryScheduleStore(jobs, clock=now))


def _owners_of(cluster: _Cluster, name: str) -> list[int]:
    """The replicas that do ``name``'s catch-up and sweep, first owner first."""
    ranks = [(control._owners.rank(name), i) for i, (_, control) in enumerate(cluster.replicas)]
    return [i for rank, i in sorted(ranks) if rank < OWNERS]


def _fire_owners(cluster: _Cluster, name: str, at: float) -> list[int]:
    """The replicas that ask for ``name``'s tick at loop time ``at``, first owner first."""
    instant = BASE + timedelta(seconds=at)
    ranks = [
        (control._owners.fire_rank(name, instant), i)
        for i, (_, control) in enumerate(cluster.replicas)
    ]
    return [i for rank, i in sorted(ranks) if rank < OWNERS]


async def _four_replicas(
    cluster: _Cluster, names: str | list[str], cron: str, at: float
) -> list[int]:
    """Four replicas of cron schedules (one or a list), once each has read the others'
    heartbeats: the owners of their ticks at loop time ``at``, first owner first."""
    names = [names] if isinstance(names, str) else names
    for i in range(4):
        await cluster.start(i, names, cron=cron)
    await asyncio.sleep(3.0)
    return _fire_owners(cluster, names[0], at)


@in_loop_time
async def test_on_eight_replicas_only_two_ask_for_each_tick_and_each_runs_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(owners_module, "EPOCH_S", 2.0)  # several epochs in the window
    cluster = _cluster()
    names = [f"s{i}" for i in range(20)]
    try:
        for i in range(8):
            await cluster.start(i, names)
        await asyncio.sleep(3.0)  # every replica has read every other's heartbeat
        cluster.jobs.asked.clear()
        start = asyncio.get_running_loop().time()
        await asyncio.sleep(10.0)
        # Later owners' timers are forgotten once fired: nothing piles up from second to second.
        assert all(len(sch._sup._later_handles) <= OWNERS for sch, _ in cluster.replicas)
    finally:
        await cluster.stop_all()
    window = {(n, k) for n, k, _, at in cluster.ran if start + 0.5 < at < start + 9.0}
    assert len(window) >= 20 * 8
    per_tick = Counter((n, k) for n, k, _, _ in cluster.ran)
    assert all(per_tick[t] == 1 for t in window)
    asked = [cluster.jobs.asked[f"{n} {k}"] for n, k in window]
    assert max(asked) <= OWNERS
    # The second owner asks too (one losing statement), so most ticks cost exactly two asks.
    assert Counter(asked)[OWNERS] >= 0.9 * len(asked)
    # The ticks of one epoch share their owners: one replica runs all 20 of each of its
    # instants, at the instant; the epochs rotate over the replicas.
    by_epoch: dict[int, set[int]] = {}
    for n, k, i, _ in cluster.ran:
        if (n, k) in window:
            by_epoch.setdefault(int(_instant(k).timestamp() // 2), set()).add(i)
    assert len(by_epoch) >= 3
    assert all(len(runners) == 1 for runners in by_epoch.values())
    assert len({i for runners in by_epoch.values() for i in runners}) >= 2


@in_loop_time
async def test_an_owner_killed_leaves_its_ticks_to_the_second_owner_a_quarter_second_late() -> None:
    cluster = _cluster()
    names = [f"s{i}" for i in range(6)]
    loop = asyncio.get_running_loop()
    try:
        for i in range(4):
            await cluster.start(i, names)
        await asyncio.sleep(3.0)
        # The victim: the first owner of the next instant (3 s before its heartbeat lapses).
        owners = {t: _fire_owners(cluster, "s0", t) for t in (4.0, 5.0)}
        victim = owners[4.0][0]
        await cluster.crash(victim)
        killed = loop.time()
        await asyncio.sleep(2.5)  # less than the heartbeat TTL: the view still has the victim
        ran = {(n, k): (i, at) for n, k, i, at in cluster.ran if killed < at < killed + 2.5}
    finally:
        await cluster.stop_all()
    delay = second_delay(timedelta(seconds=1))
    for t, (first, second, *_) in owners.items():
        run_key = (BASE + timedelta(seconds=t)).strftime("%Y-%m-%dT%H:%M:%SZ")
        for name in names:
            replica, at = ran[name, run_key]
            if first == victim:  # the second owner, a delay late
                assert (replica, round(at - t, 3)) == (second, delay)
            else:  # the victim was second or not an owner: the first owner, on time
                assert (replica, at) == (first, t)


@in_loop_time
async def test_a_minutely_ticks_second_owner_asks_a_second_late_reading_the_gate_meanwhile() -> (
    None
):
    """A cron's fields say nothing of how far apart its instants are; the time to the next one
    does: a minute's quarter is over the cap, so the second owner waits 1 s, not the 250 ms of
    a per-second schedule (which in a burst of thousands would ask while the first still
    acquires). Meanwhile it keeps the paused state fresh, as while a tick runs."""
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    instant = 60.0  # loop time 0 is BASE, a whole minute: the cron's next instant
    try:
        first, second, third = await _four_replicas(cluster, "minutely", "* * * * *", instant)
        await asyncio.sleep(instant - 1.0 - loop.time())
        await cluster.crash(first)  # its heartbeat lapses after 3 s: still an owner at the instant
        await asyncio.sleep(instant + 0.5 - loop.time())
        hooks = cluster.replicas[second][1]._hooks
        assert hooks.next_start_in(0.0, 5.0) == 0.0  # the later ask waits: polls go on
        await asyncio.sleep(2.0)
        assert cluster.replicas[third][1]._hooks.next_start_in(0.0, 5.0) is None  # asked, lost
    finally:
        await cluster.stop_all()
    assert second_delay(timedelta(minutes=1)) == 1.0
    ran = [
        (i, round(at, 3))
        for n, k, i, at in cluster.ran
        if _instant(k) == BASE + timedelta(seconds=instant)
    ]
    assert ran == [(second, instant + 1.0)]


@in_loop_time
async def test_the_sweep_leaves_a_tick_to_its_later_owners_until_the_last_ones_turn() -> None:
    """Two owners of an instant dead but still in the views: the third asks at twice the
    second owner's delay. A sweep that falls between the instant and that ask must not start
    the tick (it would be a missed tick's late run in the history and to alerting, and one more
    ask): the later owners are how an owner's death is covered on time."""
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    instant = 63.0  # every 3 s: the later owners ask 0.75 and 1.5 s late
    await asyncio.sleep(0.25)
    try:
        first, second, third = await _four_replicas(cluster, "every3", "*/3 * * * * *", instant)
        await asyncio.sleep(instant - 1.0 - loop.time())
        await cluster.crash(first)  # their heartbeats lapse after 3 s: owners at the instant
        await cluster.crash(second)
        # The sweeps (every lease_ms, 2 s, from each start) fall at 64.25 s: after the instant's
        # first second, before the third owner's turn at 64.5 s.
        await asyncio.sleep(instant + 2.0 - loop.time())
    finally:
        await cluster.stop_all()
    delay = second_delay(timedelta(seconds=3))
    ran = [
        (i, round(at, 3))
        for n, k, i, at in cluster.ran
        if _instant(k) == BASE + timedelta(seconds=instant)
    ]
    assert ran == [(third, instant + 2 * delay)]


@in_loop_time
async def test_both_owners_killed_the_others_take_over_and_catch_up_what_fell_between() -> None:
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    try:
        for i in range(5):
            await cluster.start(i, ["report"])
        await asyncio.sleep(3.0)
        owners = _owners_of(cluster, "report")
        for index in owners:
            await cluster.crash(index)
        killed = loop.time()
        await asyncio.sleep(12.0)
        end = loop.time()
    finally:
        await cluster.stop_all()
    per_tick = Counter(k for n, k, _, _ in cluster.ran)
    assert set(per_tick.values()) == {1}
    after = sorted((k, i, at) for n, k, i, at in cluster.ran if killed < at < end)
    runners = {i for _, i, _ in after}
    assert not runners & set(owners)
    # Every instant from the kill to 2 s before the end ran (late ones by the sweep).
    expected = {
        (BASE + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ")
        for s in range(int(killed) + 1, int(end) - 2)
    }
    assert expected <= set(per_tick)
    # The first tick after the kill waited for the view: the heartbeat TTL (3 beats of 1 s)
    # and the next read (a beat at most), then the sweep (its cadence: the lease, 2 s).
    first = min(at for _, _, at in after)
    assert first - killed <= 3.0 + 1.0 + 2.0 + 1.0


# --- views built from the declarations --------------------------------------------------------


async def _idle_controls(cluster: _Cluster, count: int) -> list[tuple[Scheduler, ScheduleControl]]:
    """Replicas whose membership reads the test drives by hand (heartbeat of an hour)."""
    replicas = []
    for _ in range(count):
        scheduler = Scheduler(jobs=cluster.jobs, lease_ms=2_000, clock=cluster.now)

        async def base(tick: Tick) -> None:
            pass

        scheduler.add_interval("base", 60_000, base)
        control = ScheduleControl(
            scheduler,
            cluster.store,
            poll_interval_ms=3_600_000,
            heartbeat_ms=3_600_000,
            clock=cluster.now,
        )
        await control.start()
        await scheduler.start_all()
        replicas.append((scheduler, control))
    for _, control in replicas:  # each reads the others (all of one digest)
        await control._read_members()
    cluster.replicas.extend(replicas)
    return replicas


def _declarers_seen(control: ScheduleControl, name: str) -> set[str]:
    """The replicas ``control`` counts as declaring ``name``."""
    members = control._owners.members or ()
    own = name in control._hooks.names()  # a member's names None: "as this replica declares"
    return {m.replica_id for m in members if (own if m.names is None else name in m.names)}


def _rank_order(name: str, ids: Sequence[str]) -> list[str]:
    from sdcore.scheduling._owners import _score

    return sorted(ids, key=lambda r: (_score(name, r), r), reverse=True)


@in_loop_time
async def test_a_digest_read_while_a_replica_redeclares_is_not_taken_for_its_holders() -> None:
    # Five replicas declare {"base"} (one digest). "x" is then added on three of them; before
    # those write their new digest, a reader that meets the old digest reads the declarations
    # of its most recently seen holder, which may already declare "x": those names must not be
    # cached for the digest, or the two replicas that never declare "x" stay its owners in the
    # reader's view, and nobody asks for its ticks.
    cluster = _cluster()
    try:
        reps = await _idle_controls(cluster, 5)
        ids = [control.replica.replica_id for _, control in reps]
        # e, a, b declare "x"; c, d never do; pick a name ranked c, d above a, b above e.
        for i in range(10_000):
            name = f"x{i}"
            order = _rank_order(name, ids)
            if set(order[:2]) == {ids[3], ids[4]} and order[4] == ids[0]:
                break
        e, a, b = reps[0], reps[1], reps[2]
        for scheduler, _ in (e, a, b):

            async def handler(tick: Tick) -> None:
                pass

            scheduler.add_interval(name, 1_000, handler)
        await asyncio.sleep(0.1)  # each redeclares (the registry woke its loop)
        store = cluster.store
        await store.heartbeat(e[1].replica)  # e: the freshest holder of the old digest
        await a[1]._read_members()
        await store.heartbeat(e[1].replica)
        await b[1]._read_members()
        await e[1]._read_members()
        for _, control in reps[:3]:
            assert _declarers_seen(control, name) <= {ids[0], ids[1], ids[2]}
        assert any(control._owners.owns(name) for _, control in reps[:3])
    finally:
        await cluster.stop_all()


@in_loop_time
async def test_a_schedule_added_here_is_not_taken_for_one_the_others_declare() -> None:
    # Four replicas declare {"base"}; one adds "x". Until its next membership read, the others
    # (of the digest it had) declare what it declared then, not "x": it must not rank them
    # above itself for "x", or nobody asks for its ticks until that read.
    cluster = _cluster()
    try:
        reps = await _idle_controls(cluster, 4)
        ids = [control.replica.replica_id for _, control in reps]
        name = next(f"x{i}" for i in range(1_000) if _rank_order(f"x{i}", ids)[-1] == ids[0])
        scheduler, control = reps[0]
        ran: list[str] = []

        async def handler(tick: Tick) -> None:
            ran.append(tick.run_key or "")

        scheduler.add_interval(name, 1_000, handler)
        assert _declarers_seen(control, name) == set()
        assert control._owners.rank(name) == 0
        await asyncio.sleep(3.5)
        assert len(ran) == 3
    finally:
        await cluster.stop_all()


@in_loop_time
async def test_a_fleet_killed_and_restarted_within_the_ttl_catches_up_its_downtime() -> None:
    # Every replica killed -9 and started again before their heartbeats lapse: at start, the
    # new replicas see the dead ones as owners and leave the start-up catch-up to them. The one
    # that becomes an owner once they lapse must catch up the downtime then (its sweep looks
    # back only to its own start).
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    names = [f"s{i}" for i in range(40)]
    try:
        for i in range(3):
            await cluster.start(i, names)
        await asyncio.sleep(5.0)
        for i in range(3):
            await cluster.crash(i)
        down = loop.time()
        await asyncio.sleep(2.3)  # less than the TTL (3 beats of 1 s)
        for i in range(3, 6):
            await cluster.start(i, names)
        await asyncio.sleep(12.0)
        end = loop.time()
    finally:
        await cluster.stop_all()
    per_tick = Counter((n, k) for n, k, _, _ in cluster.ran)
    assert set(per_tick.values()) == {1}
    never = [
        (n, s)
        for s in range(int(down) + 1, int(end) - 2)
        for n in names
        if (n, (BASE + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ")) not in per_tick
    ]
    assert never == []


@in_loop_time
async def test_ticks_only_a_new_version_has_are_asked_for_during_a_rolling_deploy() -> None:
    # Three replicas run "report" every 2 s (old code), three every 1 s (new code). The owners
    # are chosen among the replicas of each version: the odd seconds, which only the new code
    # fires, are not left to two old replicas that never fire them.
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    try:
        reps = await _idle_controls(cluster, 6)
        ids = [control.replica.replica_id for _, control in reps]
        name = next(
            f"r{i}" for i in range(1_000) if set(_rank_order(f"r{i}", ids)[:2]) <= set(ids[:3])
        )
        ran: list[str] = []

        async def handler(tick: Tick) -> None:
            ran.append(tick.run_key or "")

        for i, (scheduler, _) in enumerate(reps):
            scheduler.add_interval(name, 2_000 if i < 3 else 1_000, handler)
        await asyncio.sleep(0.1)  # each declares it
        for _, control in [*reps, *reps]:  # each records its digest, then reads the others'
            await control._read_members()
        start = loop.time()
        await asyncio.sleep(10.0)
    finally:
        await cluster.stop_all()
    seconds = [datetime.fromisoformat(k.replace("Z", "+00:00")) - BASE for k in ran]
    odd = [s for s in seconds if start < s.total_seconds() < start + 9.5 and s.seconds % 2]
    assert len(odd) >= 4


@in_loop_time
async def test_both_owners_stopping_gracefully_leave_no_tick_behind() -> None:
    """Owners leaving (a scale-down, a rolling deploy by two) notify the others, which read the
    live replicas at once instead of at their next heartbeat (5 s here): with catch-up off, no
    tick of the instants the two owned is lost."""
    cluster = _cluster()
    names = ["s0", "s1", "s2"]
    loop = asyncio.get_running_loop()
    try:
        for i in range(5):
            await cluster.start(i, names, heartbeat_ms=5_000, catch_up="off")
        await asyncio.sleep(11.0)  # two heartbeats: every view holds every replica
        target = math.ceil(loop.time()) + 1.0
        leaving = _fire_owners(cluster, "s0", target)
        await asyncio.sleep(target - 0.5 - loop.time())
        for index in leaving:
            _, control = cluster.replicas[index]
            await control.aclose()  # leaves: its row is deleted, the others are notified
            await cluster.replicas[index][0].aclose()
        await asyncio.sleep(4.6)
    finally:
        await cluster.stop_all()
    per_tick = Counter((n, k) for n, k, _, _ in cluster.ran)
    assert set(per_tick.values()) == {1}
    for t in range(int(target), int(target) + 4):
        run_key = (BASE + timedelta(seconds=t)).strftime("%Y-%m-%dT%H:%M:%SZ")
        for name in names:
            assert per_tick[name, run_key] == 1, (name, run_key)


@pytest.mark.parametrize("count", [1, 150], ids=["one", "burst"])
@in_loop_time
async def test_a_stored_schedule_changed_while_a_later_owner_waits_still_runs_the_tick(
    count: int,
) -> None:
    # The first owner of each instant is dead (still in the view); the later owners wait a
    # quarter of a second, and the change of the stored schedules' arguments reaches them in
    # that quarter: the ticks they wait to ask for are the changed schedules', not lost ones
    # (one schedule waits in the starter, a burst in the timer).
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    admin = ScheduleAdmin(cluster.store)
    names = [f"s{i}" for i in range(count)]
    ran: list[tuple[str, str, int, dict[str, Any]]] = []
    try:
        for i in range(3):

            async def work(tick: Tick, args: dict[str, Any], index: int = i) -> None:
                ran.append((tick.schedule, tick.run_key or "", index, args))

            await cluster.start(i, [], stored=work)

        for name in names:
            await admin.create(name, handler="work", every_ms=1_000, args={"n": 0}, actor="t")
        await asyncio.sleep(3.0)
        first = math.ceil(loop.time()) + 1
        victim = _fire_owners(cluster, names[0], first)[0]
        await asyncio.sleep(first - 0.5 - loop.time())
        await cluster.crash(victim)
        for n, at in enumerate(range(first, first + 3), start=1):
            await asyncio.sleep(at + 0.01 - loop.time())
            for name in names:
                await admin.update(name, args={"n": n}, actor="t")
        await asyncio.sleep(1.0)
    finally:
        await cluster.stop_all()
    keys = {
        (BASE + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ")
        for s in range(first, first + 3)
    }
    per_key = Counter((name, k) for name, k, _, _ in ran if k in keys)
    assert per_key == {(name, k): 1 for name in names for k in keys}


@in_loop_time
async def test_at_a_bursts_instant_only_its_owners_walk_its_schedules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At a burst's instant only its first owner walks its schedules: the later owners look at
    them at their turns (one and two delays: one and two seconds for a minutely cron), the
    others after the last owner's turn (three delays), to re-arm them only. At the instant, the
    first owner has the CPU to itself."""
    from sdcore.scheduling._timer import Timer

    looked: list[tuple[int, float]] = []  # (timer, loop time) of each tick looked at
    fire = Timer._fire

    def recording(self: Timer, *args: Any, **kwargs: Any) -> Any:
        looked.append((id(self), asyncio.get_running_loop().time()))
        return fire(self, *args, **kwargs)

    monkeypatch.setattr(Timer, "_fire", recording)
    cluster = _cluster()
    names = [f"s{i}" for i in range(300)]
    instant = 120.0
    try:
        for i in range(6):
            await cluster.start(i, names, cron="* * * * *")
        await asyncio.sleep(instant - 1.0 - asyncio.get_running_loop().time())
        order = _fire_owners(cluster, "s0", instant)
        looked.clear()
        await asyncio.sleep(5.0)
    finally:
        await cluster.stop_all()
    timers = {id(scheduler._timer): i for i, (scheduler, _) in enumerate(cluster.replicas)}
    when: dict[int, Counter[float]] = {}
    for timer, at in looked:
        when.setdefault(timers[timer], Counter())[round(at - instant, 3)] += 1
    turns = {index: float(place) for place, index in enumerate(order)}
    expected = {i: Counter({turns.get(i, 3.0): len(names)}) for i in range(6)}
    assert when == expected
    run_key = (BASE + timedelta(seconds=instant)).strftime("%Y-%m-%dT%H:%M:%SZ")
    ran = [(i, at) for _, key, i, at in cluster.ran if key == run_key]
    assert sorted(ran) == [(order[0], instant)] * len(names)


async def _minutely_burst(cluster: _Cluster, instant: float) -> tuple[list[str], list[int]]:
    """150 minutely crons on four replicas (:func:`_four_replicas`): their names, and the
    owners of their ticks at loop time ``instant``."""
    names = [f"job{i}" for i in range(150)]
    return names, await _four_replicas(cluster, names, "* * * * *", instant)


async def _first_two_killed(cluster: _Cluster, name: str, instant: float) -> tuple[int, str]:
    """Kill the first two owners of ``name``'s tick at loop time ``instant`` just before it;
    0.3 s after it, the third owner and a replica id that ranks above it (a joiner's)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(instant - 0.1 - loop.time())
    first, second, third = _fire_owners(cluster, name, instant)
    await cluster.crash(first)
    await cluster.crash(second)
    await asyncio.sleep(instant + 0.3 - loop.time())
    return third, _above(cluster, third, instant)


def _above(cluster: _Cluster, index: int, at: float) -> str:
    """A replica id that ranks above replica ``index`` in the epoch of loop time ``at``."""
    epoch = str(int((BASE + timedelta(seconds=at)).timestamp() // owners_module.EPOCH_S))
    below = cluster.replicas[index][1].replica.replica_id
    while True:
        candidate = str(uuid.uuid4())
        if (owners_module._score(epoch, candidate), candidate) > (
            owners_module._score(epoch, below),
            below,
        ):
            return candidate


@pytest.mark.parametrize("count", [1, 150], ids=["one", "burst"])
@in_loop_time
async def test_a_replica_joining_after_an_instant_does_not_take_a_later_owners_turn(
    count: int,
) -> None:
    """The first two owners are killed (still in every view); just after the instant a replica
    starts that ranks above the third in the instant's epoch. It cannot fire a tick from before
    its start, and the third owner, which looks at the ticks two delays later with the joiner in
    its view, still asks for them: its place when the instant came counts."""
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    instant = 120.0
    names = [f"job{i}" for i in range(count)]
    try:
        await asyncio.sleep(1.5)  # a heartbeat read falls between the join and the third's turn
        for i in range(5):
            await cluster.start(i, names, cron="* * * * *", catch_up="off")
        third, joiner = await _first_two_killed(cluster, names[0], instant)
        await cluster.start(5, names, cron="* * * * *", catch_up="off", replica_id=joiner)
        await asyncio.sleep(instant + 1.9 - loop.time())
        view = cluster.replicas[third][1]._owners.members or ()
        assert joiner in {m.replica_id for m in view}  # the third's view has it before its turn
        await asyncio.sleep(instant + 4.0 - loop.time())
    finally:
        await cluster.stop_all()
    run_key = (BASE + timedelta(seconds=instant)).strftime("%Y-%m-%dT%H:%M:%SZ")
    ran = sorted((n, i, round(at, 3)) for n, key, i, at in cluster.ran if key == run_key)
    turn = instant + 2 * second_delay(timedelta(minutes=1))
    assert ran == sorted((name, third, turn) for name in names)


async def _stopped_on_the_second_owner(
    count: int, stop_at: float, start_at: float, rounds: int = 1
) -> tuple[list[tuple[str, int, float]], list[int]]:
    """Four replicas of ``count`` minutely crons; the first owner of the instant at 120 s is
    killed just before it, and the second stops its schedules locally at loop time ``stop_at``
    and starts them again at ``start_at`` (``rounds`` times over). Returns the runs of the
    instant's ticks (schedule, replica, loop time) and the owners, first first."""
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    instant = 120.0
    names = [f"job{i}" for i in range(count)]
    try:
        owners = await _four_replicas(cluster, names, "* * * * *", instant)
        await asyncio.sleep(instant - 0.1 - loop.time())
        await cluster.crash(owners[0])
        scheduler = cluster.replicas[owners[1]][0]
        await asyncio.sleep(stop_at - loop.time())
        for _ in range(rounds):
            for name in names:
                scheduler.stop(name)
            await asyncio.sleep(start_at - loop.time())
            for name in names:
                scheduler.start(name)
        await asyncio.sleep(instant + 4.0 - loop.time())
    finally:
        await cluster.stop_all()
    run_key = (BASE + timedelta(seconds=instant)).strftime("%Y-%m-%dT%H:%M:%SZ")
    ran = sorted((n, i, round(at, 3)) for n, key, i, at in cluster.ran if key == run_key)
    return ran, owners


@pytest.mark.parametrize("count", [1, 150], ids=["one", "burst"])
@in_loop_time
async def test_a_schedule_stopped_and_started_while_its_later_owner_waits_keeps_that_ask(
    count: int,
) -> None:
    """The second owner stops and starts the schedules locally while it waits for its turn
    (armed again from then, for the next minute; three times over, so that the timer compacts
    its buckets meanwhile): its turn still asks for the instant's ticks, a delay late, not the
    third owner's two."""
    ran, owners = await _stopped_on_the_second_owner(count, 120.3, 120.3, rounds=3)
    turn = 120.0 + second_delay(timedelta(minutes=1))
    assert ran == sorted((f"job{i}", owners[1], turn) for i in range(count))


@pytest.mark.parametrize("count", [1, 150], ids=["one", "burst"])
@in_loop_time
async def test_a_schedule_stopped_at_the_instant_on_a_later_owner_is_not_asked_for_at_its_turn(
    count: int,
) -> None:
    """The second owner has the schedules stopped at the instant and started again before its
    turn. It does not ask for the instant's ticks (it was not firing them): the third owner
    does, at its turn."""
    ran, owners = await _stopped_on_the_second_owner(count, 119.95, 120.3)
    turn = 120.0 + 2 * second_delay(timedelta(minutes=1))
    assert ran == sorted((f"job{i}", owners[2], turn) for i in range(count))


@pytest.mark.parametrize("instant", [30.0, 59.0], ids=["in-epoch", "epoch-end"])
@pytest.mark.parametrize("count", [1, 150], ids=["one", "burst"])
@in_loop_time
async def test_a_later_owners_loop_blocked_past_the_next_instant_still_asks_at_its_turn(
    count: int, instant: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-second schedules; the first owner of an instant is killed just before it, and every
    loop blocks for a second from a tenth after it, past the next instant. The second owner still
    asks for the instant's ticks (as it ranked then), once the loop runs again; the ticks that
    passed after it are coalesced to the latest, asked for by that instant's owners as ranked
    then: at 59 s the next instant is in the next epoch, whose owners differ."""
    from sdcore.scheduling._supervisor import TickStarter

    loop = asyncio.get_running_loop()
    asked: list[tuple[int, datetime, float]] = []  # (starter, instant, loop time)
    admit = TickStarter._admit

    def recording(self: TickStarter, entry: Any, due: datetime, path: Any, tick: Any) -> Any:
        if path is StartPath.FIRE and entry.name == "job0":
            asked.append((id(self), due, loop.time()))
        return admit(self, entry, due, path, tick)

    monkeypatch.setattr(TickStarter, "_admit", recording)
    cluster = _cluster()
    names = [f"job{i}" for i in range(count)]
    try:
        for i in range(4):
            await cluster.start(i, names, catch_up="off")
        await asyncio.sleep(instant - 0.1 - loop.time())
        owners = _fire_owners(cluster, names[0], instant)
        following = _fire_owners(cluster, names[0], instant + 1)
        await cluster.crash(owners[0])
        await asyncio.sleep(instant + 0.1 - loop.time())
        block_loop(1.0)
        await asyncio.sleep(instant + 4.0 - loop.time())
    finally:
        await cluster.stop_all()
    ran = Counter((n, k) for n, k, _, _ in cluster.ran)
    assert set(ran.values()) == {1}
    assert all(ran[n, _key(at)] == 1 for n in names for at in (instant, instant + 1))
    starters = {id(scheduler._sup): i for i, (scheduler, _) in enumerate(cluster.replicas)}
    by = {
        (starters[s], (due - BASE).total_seconds()): round(at - instant, 3)
        for s, due, at in asked
        if (due - BASE).total_seconds() in (instant, instant + 1)
    }
    delay = second_delay(timedelta(seconds=1))
    back = 1.1  # the loops run again
    live = [i for i in following if i != owners[0]]
    expected = {(i, instant): back for i in owners[1:]}
    expected |= {(i, instant + 1): max(back, 1 + r * delay) for r, i in enumerate(following)}
    assert by == {key: at for key, at in expected.items() if key[0] in live or key[1] == instant}


def _key(at: float) -> str:
    return (BASE + timedelta(seconds=at)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize("change", ["args", "cron"])
@pytest.mark.parametrize("count", [1, 150], ids=["one", "burst"])
@in_loop_time
async def test_stored_schedules_updated_after_a_joiner_keep_the_third_owners_turn(
    count: int, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first two owners are killed; just after the instant a replica joins that ranks above
    the third, and before the third's turn the stored schedules are updated (each replica reads
    the live replicas through a store with a round trip's latency): their arguments, or their
    cron to one that has no tick at the instant. The updated schedules' ticks keep the third
    owner's turn, ranked as at the instant: they run there, at its turn."""
    members = MemoryScheduleStore.members

    async def slow(self: MemoryScheduleStore, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.02)  # a database round trip
        return await members(self, *args, **kwargs)

    monkeypatch.setattr(MemoryScheduleStore, "members", slow)
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    admin = ScheduleAdmin(cluster.store)
    names = [f"s{i}" for i in range(count)]
    instant = 180.0  # 03:03: an odd minute, which "*/2 * * * *" skips

    def work_on(index: int) -> Callable[[Tick, dict[str, Any]], Awaitable[None]]:
        async def work(tick: Tick, args: dict[str, Any]) -> None:
            cluster.ran.append((tick.schedule, tick.run_key or "", index, loop.time()))

        return work

    try:
        await asyncio.sleep(1.5)
        for i in range(5):
            await cluster.start(i, [], stored=work_on(i))
        for name in names:
            await admin.create(
                name, handler="work", cron="* * * * *", args={}, options={"catch_up": "off"},
                actor="t",
            )  # fmt: skip
        third, joiner = await _first_two_killed(cluster, names[0], instant)
        await cluster.start(5, [], stored=work_on(5), replica_id=joiner)
        await asyncio.sleep(instant + 1.5 - loop.time())
        view = cluster.replicas[third][1]._owners.members or ()
        assert joiner in {m.replica_id for m in view}
        for name in names:
            if change == "args":
                await admin.update(name, args={"n": 1}, actor="t")
            else:
                await admin.update(name, cron="*/2 * * * *", actor="t")
        await asyncio.sleep(instant + 5.0 - loop.time())
    finally:
        await cluster.stop_all()
    ran = sorted((n, i, round(at, 3)) for n, key, i, at in cluster.ran if key == _key(instant))
    turn = instant + 2 * second_delay(timedelta(minutes=1))
    assert ran == sorted((name, third, turn) for name in names)


@in_loop_time
async def test_while_a_later_owner_waits_for_its_turn_the_plane_and_the_api_see_it() -> None:
    """During a later owner's wait for a burst's turn (its schedules stopped and started there
    meanwhile): the control plane's next start is the turn (it reads the paused state before),
    and each schedule's next fire time is the next instant, not the one that passed."""
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    instant = 120.0
    try:
        names, owners = await _minutely_burst(cluster, instant)
        await asyncio.sleep(instant + 0.2 - loop.time())
        scheduler, control = cluster.replicas[owners[1]]
        for name in names:
            scheduler.stop(name)
            scheduler.start(name)
        hooks = control._hooks
        upcoming = hooks.next_start_in(0.0, 5.0)
        assert upcoming is not None
        assert upcoming <= 0.8 + 1e-6
        for _, plane in cluster.replicas:
            assert plane._hooks.scheduler.get("job0").next_fire_at == BASE + timedelta(minutes=3)
    finally:
        await cluster.stop_all()


@in_loop_time
async def test_a_tick_that_fails_at_a_later_owners_turn_stops_only_its_schedule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first owner is killed; at the second owner's turn, ranking the burst's last tick
    raises. That schedule is stopped there (as any schedule that cannot fire) and the third
    owner runs its tick at its turn; the others' ticks run at the second's, and no replica keeps
    the turn's bucket once walked."""
    from sdcore.scheduling._supervisor import TickStarter

    route = TickStarter.route
    failing_on: list[TickStarter] = []

    def failing(self: TickStarter, entry: Any, due: Any = None, order: Any = None) -> int:
        if self in failing_on and order is not None and entry.name == "job149":
            raise RuntimeError("cannot rank")
        return route(self, entry, due, order)

    monkeypatch.setattr(TickStarter, "route", failing)
    cluster = _cluster()
    loop = asyncio.get_running_loop()
    instant = 120.0
    try:
        names, owners = await _minutely_burst(cluster, instant)
        failing_on.append(cluster.replicas[owners[1]][0]._sup)
        await asyncio.sleep(instant - 0.1 - loop.time())
        await cluster.crash(owners[0])
        await asyncio.sleep(instant + 2.5 - loop.time())
        waiting = [len(scheduler._timer._waiting) for scheduler, _ in cluster.replicas]
        stopped = not cluster.replicas[owners[1]][0].get("job149").active
    finally:
        await cluster.stop_all()
    delay = second_delay(timedelta(minutes=1))
    ran = sorted((n, i, round(at, 3)) for n, key, i, at in cluster.ran if key == _key(instant))
    expected = [(name, owners[1], instant + delay) for name in names[:-1]]
    assert ran == sorted([*expected, ("job149", owners[2], instant + 2 * delay)])
    assert waiting == [0, 0, 0, 0]
    assert stopped
