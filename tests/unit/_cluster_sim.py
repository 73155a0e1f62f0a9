"""A deterministic cluster simulation: real schedulers and control planes on the in-memory doubles.

N replicas (each a real :class:`~sdcore.scheduling.Scheduler` plus a real
:class:`~sdcore.scheduling.ScheduleControl`) share one :class:`~sdcore.testing.MemoryJobScheduler`
and one :class:`~sdcore.testing.MemoryScheduleStore`, on a ``looptime`` event loop whose time
only moves when every task waits. A seeded random walk of steps drives them: operator actions
(pause, resume, trigger, backfill, create, update, remove), replica crashes, graceful stops,
restarts, network partitions and clock skews, and between steps the loop time advances while
ticks fire and handlers succeed, fail or hang. The handlers record every run; after every step
:class:`Sim` checks the invariants (see :data:`HOLES` for the names a check reports under).

Everything is deterministic for a seed: handler behaviour is a function of (seed, schedule, run
key, n-th run of that key), the steps are drawn up front, and the lease code's client deadlines
follow the loop's clock (``time.monotonic`` is replaced by the loop's time in the lease modules
while an episode runs), and the replicas' ids, which rank them among each instant's owners, are
drawn from the seed (:func:`seeded_ids`). A failing episode is shrunk by removing steps while it
still fails the same way.

A replica's crash cuts its link to the "database" for good (every later call of its job scheduler
or store raises :class:`JobSchedulerUnavailableError`, so nothing it does afterwards lands) and
ends its handlers at that instant; a partition cuts the link for a while (its leases then run
out on the client and its handlers are cancelled); a graceful stop is the Runtime's order
(control plane first, then the scheduler), optionally with a slow ``leave``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import inspect
import logging
import math
import random
import time
import types
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import looptime

from sdcore.job_scheduler import (
    BaseJobScheduler,
    JobAcquireOptions,
    JobAcquireResult,
    JobLease,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
)
from sdcore.job_scheduler import _memory as memory_module
from sdcore.job_scheduler import _model as lease_model
from sdcore.job_scheduler import _run as lease_run
from sdcore.job_scheduler._attempts import (
    GIVEN_BACK,
    AttemptAcquireResult,
    AttemptBudget,
    TickRecord,
)
from sdcore.scheduling import (
    InvalidScheduleError,
    ScheduleAdmin,
    ScheduleControl,
    ScheduleControlError,
    Scheduler,
    Tick,
)
from sdcore.scheduling import _plane as plane_module
from sdcore.scheduling import _timer as timer_module
from sdcore.scheduling._control import ScheduleStore
from sdcore.scheduling._supervisor import current_path
from sdcore.scheduling._triggers import IntervalTrigger
from sdcore.testing import MemoryJobScheduler, MemoryScheduleStore

# Every name a check reports under. The strict ones fail the test; a name in the test's
# KNOWN_HOLES set is counted and printed instead (a hole another change fixes).
HOLES = {
    "concurrent_run": "a tick's handler started while another run of the same tick was live",
    "too_many_runs": "a tick ran more than retries + 1 times (abandoned runs and backfill "
    "releases aside)",
    "paused_started": "a tick started on a replica that held its schedule paused",
    "pause_retries": "a retry of a tick started on a replica that held its schedule paused",
    "stop_ungates_paused": "a stopping replica started a tick of a schedule it held paused",
    "clean_tick_lost": "a due tick of an active schedule, with a live replica and no "
    "disturbance around it, neither ran nor was skipped for a reason",
    "backfill_starves_live": "a live tick was recorded as an overlap skip while only backfill, "
    "catch-up or sweep runs were running",
    "resume_gap": "a catch_up='all' tick after the resume, skipped as 'paused' by a replica "
    "that had not applied the resume yet, was never caught up (nor held by a catch-up until "
    "its window passed)",
    "trigger_idempotency": "one trigger request (one request id) ran more than once",
    "remove_open_actions": "a trigger outlived the removal of its schedule (ran into a "
    "re-created schedule, or stayed open)",
    "action_never_finishes": "a trigger or backfill of a schedule that stayed unchanged, with "
    "a live replica, did not finish",
    "backfill_stall": "a backfill stopped making progress once its stored schedule was "
    "updated or removed",
    "stored_nonexclusive": "a stored schedule ran one tick on several replicas at once "
    "(created with exclusive=false)",
    "unexpected_task_error": "a scheduler task ended with an error nothing foresaw",
    "tick_after_close": "a scheduler still owned (or started) a tick after its aclose() returned",
    "update_patch": "an update that names some fields changed the others",
    "missed_report": "missed_ticks disagrees with the lease rows",
    "given_back_reporting": "missed_ticks reports a tick given back unstarted as attempted",
}

BASE = datetime(2026, 7, 20, 3, 0, tzinfo=UTC)
_BASE_MS = int(BASE.timestamp() * 1000)
LEASE_MS = 2_000
GRACE_MS = 400
MAX_SKEW_MS = 80  # under half the shortest period (200 ms): the documented bound
SLOW_MAX_S = 6.0  # the longest a handler runs ("hangs")
STORED_HANDLER = "work"


@dataclass(frozen=True, slots=True)
class Def:
    """A schedule's definition as the simulation created it."""

    every_ms: int
    retries: int = 0
    backoff_ms: int = 100
    catch_up: str = "off"
    overlap: str = "skip"
    exclusive: bool = True
    window_ms: int = 8_000
    lease_ms: int = LEASE_MS

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "retries": self.retries,
            "retry_backoff_ms": self.backoff_ms,
            "catch_up": self.catch_up,
            "overlap": self.overlap,
            "catch_up_window_ms": self.window_ms,
            "lease_ms": self.lease_ms,
        }
        if not self.exclusive:
            opts["exclusive"] = False
        return opts


CODE_SCHEDULES = {
    "beat": Def(200, retries=1, backoff_ms=50),
    "sync": Def(500, retries=2, catch_up="all"),
    "report": Def(1_000, catch_up="latest"),
    "fanout": Def(400, retries=1, overlap="allow"),
}
STORED_NAMES = ("s1", "s2")


@dataclass(frozen=True, slots=True)
class Step:
    """One step of the walk: an action (``kind`` and its arguments), then ``advance_ms``."""

    kind: str
    args: tuple[Any, ...]
    advance_ms: int

    def __str__(self) -> str:
        args = ", ".join(repr(a) for a in self.args)
        return f"{self.kind}({args}) +{self.advance_ms}ms"


@dataclass(frozen=True, slots=True)
class Config:
    """An episode's cluster: replicas, and how the control plane propagates."""

    replicas: int
    listen: bool
    poll_ms: int
    faults: bool  # crashes, stops and partitions happen (else those steps do nothing)
    # The timer's burst size (sdcore.scheduling._timer.BURST): at 1, every instant's owned ticks
    # are looked at later by all but their first owner, as a burst's are.
    burst: int

    @classmethod
    def draw(cls, seed: int) -> Config:
        rng = random.Random(f"config:{seed}")
        return cls(
            replicas=rng.randint(1, 5),
            listen=rng.random() < 0.6,
            poll_ms=rng.choice((100, 300, 1_000)),
            faults=rng.random() < 0.6,
            burst=rng.choice((1, timer_module.BURST)),
        )


def draw_steps(seed: int, count: int) -> list[Step]:
    """The walk of an episode: ``count`` steps drawn from ``seed``."""
    rng = random.Random(f"steps:{seed}")
    names = [*CODE_SCHEDULES, *STORED_NAMES]
    kinds = [
        ("wait", 30),
        ("pause", 6),
        ("resume", 6),
        ("trigger", 5),
        ("backfill", 3),
        ("create", 4),
        ("update", 3),
        ("remove", 2),
        ("crash", 1),
        ("stop", 1),
        ("start", 4),
        ("partition", 1),
        ("skew", 3),
    ]
    population = [k for k, _ in kinds]
    weights = [w for _, w in kinds]
    steps: list[Step] = []
    rid = 0
    for _ in range(count):
        kind = rng.choices(population, weights)[0]
        advance = rng.choice((0, 10, 20, 50, 100, 200, 400, 800))
        args: tuple[Any, ...]
        if kind in ("pause", "resume", "remove"):
            args = (rng.choice(names),)
        elif kind == "trigger":
            rid += 1
            args = (rng.choice(names), f"req-{rid}", rng.random() < 0.3)
        elif kind == "backfill":
            start = rng.randint(500, 3_000)
            args = (rng.choice(names), start, rng.randint(0, start), rng.choice((1, 1, 3)))
        elif kind in ("create", "update"):
            catch_up = rng.choice(("off", "latest", "all"))
            exclusive = catch_up != "off" or rng.random() > 0.1
            definition = Def(
                rng.choice((300, 600, 900)),
                retries=rng.randint(0, 2),
                catch_up=catch_up,
                overlap=rng.choice(("skip", "skip", "allow")),
                exclusive=exclusive,
            )
            # Drawn apart, so that the other draws of a seed stay as they were.
            partial = random.Random(f"partial:{seed}:{len(steps)}").random() < 0.3
            args = (rng.choice(STORED_NAMES), definition, kind == "update" and partial)
        elif kind in ("crash", "stop", "start"):
            args = (rng.randrange(5),)
        elif kind == "partition":
            args = (rng.randrange(5), rng.choice((300, 1_000, 3_000)))
        elif kind == "skew":
            args = (rng.randrange(5), rng.randint(-MAX_SKEW_MS, MAX_SKEW_MS))
        else:
            args = ()
        steps.append(Step(kind, args, advance))
    return steps


class Violation(AssertionError):
    """An invariant failed (``hole`` names it; see :data:`HOLES`)."""

    def __init__(self, hole: str, detail: str, step: int) -> None:
        self.hole = hole
        self.detail = detail
        self.step = step
        super().__init__(f"{hole}: {detail}")


# --- the replicas' links to the shared "database" ---------------------------------------------


class Link:
    """One replica incarnation's connection: cut for good by a crash, for a while by a partition."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.dead = False
        self.cut_until = -math.inf
        self.leave_delay_s = 0.0

    def check(self) -> None:
        if self.dead or self.loop.time() < self.cut_until:
            raise JobSchedulerUnavailableError("simulated: this replica cannot reach the database")


class LinkedJobs(BaseJobScheduler):
    """The shared in-memory job scheduler as one replica reaches it."""

    def __init__(self, shared: MemoryJobScheduler, link: Link, sim: Sim, replica: Replica):
        super().__init__(logger_name="sdcore.job_scheduler")
        self.shared = shared
        self.link = link
        self.sim = sim
        self.replica = replica

    async def acquire(self, options: JobAcquireOptions | Any) -> JobAcquireResult:
        self.link.check()
        return await self.shared.acquire(options)

    async def heartbeat(self, lease: JobLease) -> bool:
        self.link.check()
        return await self.shared.heartbeat(lease)

    async def complete(self, lease: JobLease, data: Any = None) -> bool:
        self.link.check()
        return await self.shared.complete(lease, data)

    async def fail(self, lease: JobLease, data: Any = None) -> bool:
        self.link.check()
        return await self.shared.fail(lease, data)

    async def _reopen(
        self,
        lease: JobLease,
        data: Any,
        *,
        released: str | None = None,
        given_back: str | None = None,
    ) -> bool:
        # release() and give_back() write their marks as columns through this hook: a wrapper
        # that left it to the base class would record plain failures instead.
        self.link.check()
        return await self.shared._reopen(lease, data, released=released, given_back=given_back)

    async def statuses(self, lock_keys: Sequence[str]) -> dict[str, JobSchedulerStatus]:
        self.link.check()
        return await self.shared.statuses(lock_keys)

    async def status_of(self, lease: JobLease) -> JobSchedulerStatus | None:
        self.link.check()
        return await self.shared.status_of(lease)

    async def acquire_attempt(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> AttemptAcquireResult:
        self.link.check()
        return await self.shared.acquire_attempt(options, budget)

    async def record_skipped(self, options: JobAcquireOptions, reason: str) -> bool:
        self.link.check()
        blockers = self.sim.live_sources(self.replica, options.code)
        written = await self.shared.record_skipped(options, reason)
        if written:
            self.sim.skips[(options.code, options.run_key or "")] = (reason, blockers)
        return written

    async def tick_records(self, lock_keys: Sequence[str]) -> dict[str, TickRecord]:
        self.link.check()
        return await self.shared.tick_records(lock_keys)

    async def first_seen(self, code: str) -> datetime | None:
        self.link.check()
        return await self.shared.first_seen(code)


class LinkedStore:
    """The shared in-memory schedule store as one replica reaches it (any call may be cut)."""

    def __init__(self, shared: MemoryScheduleStore, link: Link, sim: Sim) -> None:
        self.shared = shared
        self.link = link
        self.sim = sim
        self.live_ms = shared.live_ms

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.shared, name)
        link = self.link

        async def call(*args: Any, **kwargs: Any) -> Any:
            link.check()
            if name == "leave" and link.leave_delay_s:
                await asyncio.sleep(link.leave_delay_s)  # a slow database during a stop
                link.check()
            if name == "release_failed":
                self.sim.note_release(args[0])
            return await target(*args, **kwargs)

        return call


# --- runs ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    """One call of a handler, as the handler saw it."""

    schedule: str
    run_key: str
    replica: int
    incarnation: int
    source: str
    attempt: int
    start: float
    end: float | None = None
    outcome: str | None = None  # ok, fail, cancelled, crashed
    unleased: bool = False  # maybe run under a non-exclusive definition (no lease, no budget)

    @property
    def abandoned(self) -> bool:
        return self.outcome in ("cancelled", "crashed")


@dataclass(slots=True)
class Replica:
    """One replica slot; a restart makes a new incarnation (new objects, new link)."""

    index: int
    incarnation: int = 0
    state: str = "down"  # up, stopping, down
    skew_ms: int = 0
    link: Link | None = None
    scheduler: Scheduler | None = None
    control: ScheduleControl | None = None
    live: set[int] = field(default_factory=set)  # id() of its live runs
    teardown: asyncio.Task[None] | None = None


@dataclass(slots=True)
class Stored:
    """A stored schedule's definitions over time (one generation per create)."""

    generation: int = 0
    definition: Def | None = None  # None: removed / never created


@dataclass(slots=True)
class OpenAction:
    """A trigger or backfill the simulation requested, until the store says it finished."""

    action_id: int
    kind: str
    schedule: str
    generation: int
    requested: float
    bound_s: float


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "action", None) == "task_failed":
            self.errors.append(record.getMessage())


class Sim:
    """One episode: the cluster, the walk's effects, and the invariants."""

    def __init__(self, seed: int, config: Config, holes: frozenset[str]) -> None:
        self.seed = seed
        self.config = config
        self.holes = holes
        self.loop = asyncio.get_running_loop()
        self.jobs = MemoryJobScheduler(clock=self.db_now)
        self.store = MemoryScheduleStore(self.jobs, clock=self.db_now)
        self.admin = ScheduleAdmin(self.store, clock=self.db_now)
        self.replicas = [Replica(i) for i in range(config.replicas)]
        self.runs: dict[tuple[str, str], list[Run]] = defaultdict(list)
        self.live_runs: dict[int, Run] = {}
        self.releases: dict[tuple[str, str], int] = defaultdict(int)
        self.skips: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        # Live fires that waited behind a backfill or catch-up run and were, by contract, not
        # started: replaced by a later fire, or held by a pause applied while waiting (when).
        self.deferred_missed: dict[tuple[str, str], float] = {}
        self.deferred_gated: dict[tuple[str, str], float] = {}
        # Ticks a catch-up chose (pending on a replica) and dropped once its catch-up window no
        # longer held them, unstarted (when): the schedule's own runs kept them waiting.
        self.aged_out: dict[tuple[str, str], float] = {}
        self.stored = {name: Stored() for name in STORED_NAMES}
        self.retries_seen: dict[str, int] = {n: d.retries for n, d in CODE_SCHEDULES.items()}
        self.defs_seen: dict[str, list[tuple[float, Def | None]]] = {
            n: [(-math.inf, d)] for n, d in CODE_SCHEDULES.items()
        }
        for name in STORED_NAMES:
            self.defs_seen[name] = [(-math.inf, None)]
        self.paused: dict[str, list[list[float]]] = defaultdict(list)  # [start, end] by the store
        self.disturbed: list[float] = []  # replica lifecycle events (sorted, loop time)
        self.schedule_events: dict[str, list[float]] = defaultdict(list)
        self.definition_events: dict[str, list[float]] = defaultdict(list)
        self.up_log: list[tuple[float, int]] = [(-math.inf, 0)]
        self.actions: dict[int, OpenAction] = {}
        self.done_actions: list[tuple[float, OpenAction]] = []  # (seen finished at, action)
        self.trigger_requests: dict[int, str] = {}  # action id -> request id
        self.request_runs: dict[str, set[int]] = defaultdict(set)
        self.checked_until: dict[str, float] = {}
        self.gated: dict[str, int] = defaultdict(int)
        self.first_gated: dict[str, str] = {}
        self.step_no = 0
        self.runs_started = 0
        self.capture = _Capture()
        self.later: list[tuple[str, str]] = []  # found by background tasks, raised by check()
        self.driver: asyncio.Task[Any] | None = None  # the task that runs the walk

    # --- clocks ------------------------------------------------------------------------------

    def db_now(self) -> datetime:
        return BASE + timedelta(seconds=self.loop.time())

    def replica_clock(self, replica: Replica) -> Callable[[], datetime]:
        loop = self.loop

        def now() -> datetime:
            return BASE + timedelta(seconds=loop.time(), milliseconds=replica.skew_ms)

        return now

    # --- violations --------------------------------------------------------------------------

    def violate(self, hole: str, detail: str) -> None:
        if hole in self.holes:
            self.gated[hole] += 1
            self.first_gated.setdefault(hole, f"step {self.step_no}: {detail}")
            return
        if asyncio.current_task() is not self.driver:
            # Found inside a handler or a replica's task: raised here it would only fail that
            # tick; the driver raises it after the step.
            self.later.append((hole, f"t={self.loop.time():.3f}s: {detail}"))
            return
        raise Violation(
            hole, f"step {self.step_no}, t={self.loop.time():.3f}s: {detail}", self.step_no
        )

    # --- replicas ----------------------------------------------------------------------------

    async def start_replica(self, replica: Replica) -> None:
        if replica.state != "down":
            return
        replica.incarnation += 1
        link = replica.link = Link(self.loop)
        clock = self.replica_clock(replica)
        jobs = LinkedJobs(self.jobs, link, self, replica)
        scheduler = Scheduler(jobs=jobs, lease_ms=LEASE_MS, grace_period_ms=GRACE_MS, clock=clock)
        for name, definition in CODE_SCHEDULES.items():
            scheduler.add_interval(
                name,
                definition.every_ms,
                self._code_handler(replica, replica.incarnation, name),
                **definition.options(),
            )
        scheduler.handler(STORED_HANDLER)(self._stored_handler(replica, replica.incarnation))
        store = cast(ScheduleStore, LinkedStore(self.store, link, self))
        control = ScheduleControl(
            scheduler,
            store,
            poll_interval_ms=self.config.poll_ms,
            listen=self.config.listen,
            heartbeat_ms=1_000,
            host=f"r{replica.index}",
            pid=replica.incarnation,
            clock=clock,
        )
        replica.scheduler, replica.control = scheduler, control
        self._watch_deferrals(replica, scheduler, control)
        self._watch_catch_up(scheduler, clock)
        self._set_state(replica, "up")
        bisect.insort(self.disturbed, self.loop.time())
        try:
            await control.start()
            await scheduler.start_all()
        except JobSchedulerUnavailableError:
            # Cut off while starting: as a process that failed its start.
            await self._crash(replica)

    def _watch_deferrals(
        self, replica: Replica, scheduler: Scheduler, control: ScheduleControl
    ) -> None:
        """Note the live fires that waited for the runs in their way (a backfill or catch-up
        run, or a previous run waiting on the database) and did not start by contract: replaced
        by a later fire while waiting or their successor due before those runs ended (a missed
        tick for the catch-up policy), or held by a pause applied while they waited."""
        sup = scheduler._sup
        deferred_missed, start_deferred = sup._deferred_missed, sup._start_deferred
        loop = self.loop

        def key(entry: Any, due: datetime) -> tuple[str, str]:
            return entry.name, entry.trigger.run_key(due) or ""

        def watched_missed(entry: Any, due: datetime, why: str) -> None:
            deferred_missed(entry, due, why)
            self.deferred_missed[key(entry, due)] = loop.time()

        def watched_start(entry: Any) -> None:
            due = sup._deferred.get(entry)
            start_deferred(entry)
            started = any(t == (entry, due) for t in sup._tasks.values())
            held = due is not None and entry not in sup._deferred and not started
            if held and control.paused(entry.name):
                assert due is not None
                self.deferred_gated[key(entry, due)] = loop.time()

        sup._deferred_missed = watched_missed  # type: ignore[method-assign]
        sup._start_deferred = watched_start  # type: ignore[method-assign]

    def _watch_catch_up(self, scheduler: Scheduler, clock: Callable[[], datetime]) -> None:
        """Note the ticks a catch-up chose that left its pending set unstarted because its
        catch-up window no longer held them (the sweep keeps only the window's)."""
        sup = scheduler._sup
        start_pending = sup.start_pending
        loop = self.loop

        def watched(entry: Any, instants: list[datetime], path: Any, *, log_level: int) -> None:
            before = set(entry.pending)
            start_pending(entry, instants, path, log_level=log_level)
            window_start = clock() - timedelta(milliseconds=entry.policy.catch_up_window_ms)
            for instant in before - set(entry.pending):
                if instant < window_start:
                    self.aged_out[entry.name, entry.trigger.run_key(instant) or ""] = loop.time()

        sup.start_pending = watched  # type: ignore[method-assign]

    def _catch_up_holds(self, name: str, instant: datetime) -> bool:
        """Whether a live replica's catch-up still has the tick of ``name`` at ``instant``."""
        for replica in self.replicas:
            entry = None if replica.scheduler is None else replica.scheduler._entries.get(name)
            if replica.state == "up" and entry is not None and instant in entry.pending:
                return True
        return False

    def _code_handler(self, replica: Replica, incarnation: int, name: str) -> Any:
        async def handle(tick: Tick) -> None:
            await self.run_handler(replica, incarnation, name, tick)

        return handle

    def _stored_handler(self, replica: Replica, incarnation: int) -> Any:
        async def handle(tick: Tick, args: dict[str, Any]) -> None:
            await self.run_handler(replica, incarnation, tick.schedule, tick)

        return handle

    async def crash(self, replica: Replica) -> None:
        if replica.state == "up":
            await self._crash(replica)

    async def _crash(self, replica: Replica) -> None:
        link, scheduler, control = replica.link, replica.scheduler, replica.control
        assert link is not None
        assert scheduler is not None
        assert control is not None
        link.dead = True
        now = self.loop.time()
        bisect.insort(self.disturbed, now)
        for run_id in list(replica.live):
            self._end(self.live_runs[run_id], "crashed")
        self._set_state(replica, "down")
        scheduler._sup._grace = 0.0  # a dead process lets nothing finish

        async def teardown() -> None:
            with contextlib.suppress(Exception):
                await control.aclose()
            with contextlib.suppress(Exception):
                await scheduler.aclose()

        replica.teardown = asyncio.create_task(teardown())

    async def stop(self, replica: Replica, slow_leave_s: float) -> None:
        if replica.state != "up":
            return
        link, scheduler, control = replica.link, replica.scheduler, replica.control
        assert link is not None
        assert scheduler is not None
        assert control is not None
        self._set_state(replica, "stopping")
        link.leave_delay_s = slow_leave_s
        bisect.insort(self.disturbed, self.loop.time())

        async def graceful() -> None:
            try:
                await control.aclose()
                await scheduler.aclose()
                for _ in range(3):
                    await asyncio.sleep(0)  # callbacks of the ticks' ends run
                if scheduler._sup.tasks:
                    self.later.append(
                        (
                            "tick_after_close",
                            f"r{replica.index}'s scheduler owns {scheduler._sup.tasks} task(s) "
                            "after aclose() returned",
                        )
                    )
            finally:
                link.dead = True  # the process has exited
                self._set_state(replica, "down")
                bisect.insort(self.disturbed, self.loop.time())

        replica.teardown = asyncio.create_task(graceful())

    def _set_state(self, replica: Replica, state: str) -> None:
        replica.state = state
        self.up_log.append((self.loop.time(), sum(r.state == "up" for r in self.replicas)))

    def partition(self, replica: Replica, ms: int) -> None:
        if replica.state != "up" or replica.link is None:
            return
        now = self.loop.time()
        replica.link.cut_until = max(replica.link.cut_until, now + ms / 1000)
        bisect.insort(self.disturbed, now)
        bisect.insort(self.disturbed, now + ms / 1000)

    # --- handlers ----------------------------------------------------------------------------

    def live_sources(self, replica: Replica, schedule: str) -> tuple[str, ...]:
        return tuple(
            sorted(
                self.live_runs[i].source
                for i in replica.live
                if self.live_runs[i].schedule == schedule
            )
        )

    async def run_handler(
        self, replica: Replica, incarnation: int, schedule: str, tick: Tick
    ) -> None:
        link = replica.link
        if replica.incarnation != incarnation or link is None or link.dead:
            return  # a dead process runs nothing
        run_key = tick.run_key or ""
        run = Run(
            schedule=schedule,
            run_key=run_key,
            replica=replica.index,
            incarnation=incarnation,
            source=current_path().value,
            attempt=tick.attempt,
            start=self.loop.time(),
        )
        previous = self.runs[(schedule, run_key)]
        self._on_start(run, replica, previous)
        nth = len(previous)
        previous.append(run)
        self.live_runs[id(run)] = run
        replica.live.add(id(run))
        self.runs_started += 1
        rng = random.Random(f"{self.seed}:{schedule}:{run_key}:{nth}")
        period = self._period_s(schedule)
        roll = rng.random()
        if roll < 0.62:
            outcome, duration = "ok", rng.uniform(0, 1.2 * period)
        elif roll < 0.9:
            outcome, duration = "fail", rng.uniform(0, 0.5 * period)
        else:
            outcome, duration = "ok" if rng.random() < 0.5 else "fail", rng.uniform(2, SLOW_MAX_S)
        try:
            await asyncio.sleep(duration)
        except asyncio.CancelledError:
            self._end(run, "crashed" if link.dead else "cancelled")
            raise
        try:
            link.check()
        except JobSchedulerUnavailableError:
            # Ended while cut off: its outcome cannot be recorded, the lease decides (abandoned).
            outcome = "cancelled"
        self._end(run, outcome)
        if outcome == "fail":
            raise RuntimeError("simulated handler failure")

    def _end(self, run: Run, outcome: str) -> None:
        if run.end is not None:
            return
        run.end = self.loop.time()
        run.outcome = outcome
        self.live_runs.pop(id(run), None)
        self.replicas[run.replica].live.discard(id(run))

    def _period_s(self, schedule: str) -> float:
        definition = self.defs_seen[schedule][-1][1]
        return (definition.every_ms if definition else 500) / 1000

    def _on_start(self, run: Run, replica: Replica, previous: list[Run]) -> None:
        name, key = run.schedule, run.run_key
        definition = self.defs_seen[name][-1][1]
        # A retry continues its first attempt's task: unleased if that one was.
        run.unleased = self._unleased(name, run.start) or any(
            r.unleased and (r.replica, r.incarnation) == (run.replica, run.incarnation)
            for r in previous
        )
        live = [r for r in previous if r.end is None]
        if live:
            unleased = run.unleased or any(r.unleased for r in live)
            hole = "stored_nonexclusive" if unleased else "concurrent_run"
            self.violate(
                hole,
                f"{name} {key} started on r{run.replica} ({run.source}, attempt {run.attempt}) "
                f"while r{live[0].replica} ({live[0].source}) still runs it",
            )
        if definition is not None and definition.exclusive and not run.unleased:
            previous = [r for r in previous if not r.unleased]
            abandoned = sum(1 for r in previous if r.abandoned)
            allowed = (self.retries_seen[name] + 1) * (1 + self.releases[(name, key)]) + abandoned
            if len(previous) + 1 > allowed:
                self.violate(
                    "too_many_runs",
                    f"{name} {key}: run {len(previous) + 1} on r{run.replica} ({run.source}); "
                    f"allowed {allowed} (retries {self.retries_seen[name]}, "
                    f"{self.releases[(name, key)]} release(s), {abandoned} abandoned)",
                )
        control = replica.control
        if (
            control is not None
            and control.paused(name)
            and run.source not in ("trigger", "backfill")
        ):
            hole = "paused_started"
            if replica.state == "stopping":
                hole = "stop_ungates_paused"
            elif run.attempt > 1:
                hole = "pause_retries"
            self.violate(
                hole,
                f"{name} {key} ({run.source}, attempt {run.attempt}) started on r{run.replica} "
                f"({replica.state}), which holds it paused",
            )
        if key.startswith("trigger:"):
            action_id = int(key.split(":", 1)[1])
            action = self.actions.get(action_id)
            stored = self.stored.get(name)
            if action is not None and stored is not None and stored.generation != action.generation:
                self.violate(
                    "remove_open_actions",
                    f"trigger {action_id} of {name} generation {action.generation} ran in "
                    f"generation {stored.generation} (removed and created again)",
                )
            request = self.trigger_requests.get(action_id)
            if request is not None:
                ran = self.request_runs[request]
                ran.add(action_id)
                if len(ran) > 1:
                    self.violate(
                        "trigger_idempotency",
                        f"request {request} of {name} ran as triggers {sorted(ran)}",
                    )

    def _unleased(self, name: str, t: float) -> bool:
        """Whether some replica may run ``name`` without its lease at ``t``: a non-exclusive
        definition now, or one the store replaced less than a propagation ago."""
        since = t - self.config.poll_ms / 1000 - 2.0
        recent = [d for at, d in self.defs_seen[name] if at >= since]
        recent.append(self._definition_at(name, since))
        return any(d is not None and not d.exclusive for d in recent)

    def note_release(self, lock_keys: Sequence[str]) -> None:
        """A backfill is about to reopen these ticks' FAIL rows (a new attempt budget each)."""
        rows = self.jobs._rows
        for key in lock_keys:
            row = rows.get(key)
            if (
                row is not None
                and row.status is JobSchedulerStatus.FAIL
                and "released_by" not in (row.data or {})
                and self.jobs._attempts.get(key, 1) > 0
            ):
                self.releases[(row.code, row.run_key or "")] += 1

    # --- operator actions ----------------------------------------------------------------------

    async def apply(self, step: Step) -> None:
        kind, args = step.kind, step.args
        now = self.loop.time()
        if kind in ("crash", "stop", "partition") and not self.config.faults:
            return
        try:
            if kind == "pause":
                await self.admin.pause(args[0], actor="sim")
                self.paused[args[0]].append([now, math.inf])
                self.schedule_events[args[0]].append(now)
            elif kind == "resume":
                await self.admin.resume(args[0], actor="sim")
                self.paused[args[0]][-1][1] = now
                self.schedule_events[args[0]].append(now)
            elif kind == "trigger":
                await self._trigger(*args)
            elif kind == "backfill":
                await self._backfill(*args)
            elif kind in ("create", "update"):
                await self._store(kind, args[0], args[1], partial=args[2] if args[2:] else False)
            elif kind == "remove":
                await self.admin.remove(args[0], actor="sim")
                if args[0] in self.stored:
                    self._defined(args[0], None)
                else:
                    # A code schedule no live replica declared: its row (and pause) is
                    # forgotten, and the next replica to start declares it afresh.
                    self.schedule_events[args[0]].append(now)
                    if self.paused[args[0]] and self.paused[args[0]][-1][1] == math.inf:
                        self.paused[args[0]][-1][1] = now
            elif kind == "crash":
                if args[0] < len(self.replicas):
                    await self.crash(self.replicas[args[0]])
            elif kind == "stop":
                if args[0] < len(self.replicas):
                    await self.stop(self.replicas[args[0]], (0.0, 0.5, 1.5)[step.advance_ms % 3])
            elif kind == "start":
                if args[0] < len(self.replicas):
                    await self.start_replica(self.replicas[args[0]])
            elif kind == "partition":
                if args[0] < len(self.replicas):
                    self.partition(self.replicas[args[0]], args[1])
            elif kind == "skew" and args[0] < len(self.replicas):
                self.replicas[args[0]].skew_ms = args[1]
        except (ScheduleControlError, InvalidScheduleError):
            pass  # refused: nothing changed

    async def _trigger(self, name: str, request: str, twice: bool) -> None:
        accepts_request = "request_id" in inspect.signature(self.admin.trigger).parameters
        extra: dict[str, Any] = {"request_id": request} if accepts_request else {}
        for _ in range(2 if twice else 1):
            action = await self.admin.trigger(name, actor="sim", **extra)
            self.trigger_requests[action.id] = request
            if action.id not in self.actions:
                definition = self.defs_seen[name][-1][1]
                retries = definition.retries if definition else 0
                lease_s = (definition.lease_ms if definition else LEASE_MS) / 1000
                bound = (retries + 1) * (SLOW_MAX_S + 1.5) + self.config.poll_ms / 1000 + 3
                bound += lease_s  # a crashed owner's lease runs out first
                self.actions[action.id] = OpenAction(
                    action.id,
                    "trigger",
                    name,
                    self._generation(name),
                    self.loop.time(),
                    bound,
                )

    async def _backfill(self, name: str, start_ms: int, end_ms: int, concurrency: int) -> None:
        now = self.db_now()
        action = await self.admin.backfill(
            name,
            now - timedelta(milliseconds=start_ms),
            now - timedelta(milliseconds=end_ms),
            actor="sim",
            concurrency=concurrency,
        )
        definition = self.defs_seen[name][-1][1]
        retries = definition.retries if definition else 0
        lease_s = (definition.lease_ms if definition else LEASE_MS) / 1000
        ticks = int(action.params.get("ticks", 1))
        bound = ticks * (retries + 1) * (SLOW_MAX_S + 1.5) + 3 * lease_s + 5
        self.actions[action.id] = OpenAction(
            action.id, "backfill", name, self._generation(name), self.loop.time(), bound
        )

    def _generation(self, name: str) -> int:
        stored = self.stored.get(name)
        return 0 if stored is None else stored.generation

    async def _store(self, kind: str, name: str, definition: Def, *, partial: bool) -> None:
        before = self.stored[name].definition
        if partial:
            # Only the interval: every other field keeps its value.
            await self.admin.update(
                name, handler=STORED_HANDLER, every_ms=definition.every_ms, actor="sim"
            )
        else:
            call = self.admin.create if kind == "create" else self.admin.update
            await call(
                name,
                handler=STORED_HANDLER,
                every_ms=definition.every_ms,
                options=definition.options(),
                actor="sim",
            )
        if kind == "create":
            self.stored[name].generation += 1
        row = self.store._rows[name]
        options = row.options
        actual = Def(
            int(row.expression),
            retries=options["retries"],
            backoff_ms=options["retry_backoff_ms"],
            catch_up=options["catch_up"],
            overlap=options["overlap"],
            exclusive=options["exclusive"],
            window_ms=options["catch_up_window_ms"],
            lease_ms=options["lease_ms"],
        )
        self._defined(name, actual)
        expected = replace(before, every_ms=definition.every_ms) if before else None
        if partial and expected is not None and actual != expected:
            self.violate(
                "update_patch",
                f"update of {name} naming only every_ms={definition.every_ms}: "
                f"{expected} became {actual}",
            )

    def _defined(self, name: str, definition: Def | None) -> None:
        now = self.loop.time()
        self.definition_events[name].append(now)
        self.stored[name].definition = definition
        self.defs_seen[name].append((now, definition))
        self.schedule_events[name].append(now)
        if definition is not None:
            self.retries_seen[name] = max(self.retries_seen.get(name, 0), definition.retries)
        # A removed (or re-created) schedule starts unpaused.
        if self.paused[name] and self.paused[name][-1][1] == math.inf and definition is None:
            self.paused[name][-1][1] = now

    # --- checks after every step ---------------------------------------------------------------

    def check(self) -> None:
        while self.later:
            self.violate(*self.later.pop(0))
        if self.capture.errors:
            self.violate("unexpected_task_error", self.capture.errors[0])
            self.capture.errors.clear()
        now = self.loop.time()
        for name in self.defs_seen:
            self._check_ticks(name, now)
        self._check_actions(now)

    def _lost_with_replicas(self, name: str, t: float, window_end: float, margin: float) -> bool:
        """Whether no replica was up at some moment after ``t``, and none started from then on
        while the catch-up window still held ``t`` (``margin`` before its end) with ``name``
        neither paused nor changed around that start."""
        down = next((at for at, count in self.up_log if at > t and count == 0), None)
        if down is None:
            return False
        previous = 0
        for at, count in self.up_log:
            started = count > previous
            previous = count
            if at <= down or not started or at >= window_end - margin:
                continue
            if (
                not self._paused_at(name, at)
                and self._quiet([lo for lo, _ in self.paused[name]], at, at + margin)
                and self._quiet(self.definition_events[name], at, at + margin)
            ):
                return False
        return True

    def _up_at(self, t: float) -> bool:
        i = bisect.bisect_right(self.up_log, (t, math.inf)) - 1
        return self.up_log[i][1] > 0

    def _quiet(self, events: list[float], lo: float, hi: float) -> bool:
        i = bisect.bisect_left(events, lo)
        return i >= len(events) or events[i] > hi

    def _definition_at(self, name: str, t: float) -> Def | None:
        seen = self.defs_seen[name]
        i = bisect.bisect_right([s for s, _ in seen], t) - 1
        return seen[i][1] if i >= 0 else None

    def _paused_at(self, name: str, t: float) -> bool:
        return any(lo <= t < hi for lo, hi in self.paused[name])

    def _check_ticks(self, name: str, now: float) -> None:
        horizon = 2.5
        catch_horizon = 3 * LEASE_MS / 1000 + 3
        resume_horizon = self.config.poll_ms / 1000 + 2
        until = now - catch_horizon
        since = self.checked_until.get(name, 0.5)
        if until <= since:
            return
        self.checked_until[name] = until
        definition = self._definition_at(name, since)
        every = (definition or self.defs_seen[name][-1][1] or Def(1_000)).every_ms
        first = math.ceil((_BASE_MS + since * 1000) / every)
        last = math.floor((_BASE_MS + until * 1000) / every)
        before = self.config.poll_ms / 1000 + 1.0
        for k in range(first, last + 1):
            t = (k * every - _BASE_MS) / 1000
            definition = self._definition_at(name, t)
            if definition is None or not definition.exclusive or definition.every_ms != every:
                continue
            run_key = IntervalTrigger(every).run_key(BASE + timedelta(seconds=t)) or ""
            key = (name, run_key)
            ran = any(r.source != "trigger" for r in self.runs.get(key, ()))
            if ran:
                continue
            skip = self.skips.get(key)
            row = self.jobs._rows.get(JobAcquireOptions(code=name, run_key=run_key).lock_key)
            skipped = None if row is None or row.data is None else row.data.get("skipped")
            quiet = (
                self._quiet(self.disturbed, t - before, t + horizon)
                and self._quiet(self.schedule_events[name], t - before, t + catch_horizon)
                and self._definition_at(name, t - before) == definition
                and not self._paused_at(name, t - before)
                and not self._paused_at(name, t + horizon)
                and self._up_at(t)
            )
            # A later pause holds the resume's catch-up back; the next resume runs what it held,
            # if the catch-up window still has the tick then (so only a pause that lasts until
            # the window's end excuses it). Changes of the definition end the catch-up too.
            window_end = t + definition.window_ms / 1000
            held_to_window_end = any(
                t < lo < t + catch_horizon and hi > window_end - resume_horizon
                for lo, hi in self.paused[name]
            )
            # A catch-up that chose the tick runs its ticks one after the other, and the live
            # ticks first: the schedule's own runs (up to SLOW_MAX_S each) may keep it waiting
            # until its window no longer holds it, as they would keep any missed tick (the hole
            # is a tick no catch-up chose).
            outlasted = key in self.aged_out or self._catch_up_holds(
                name, BASE + timedelta(seconds=t)
            )
            # Every replica that held the resume's catch-up stopped before it reached the tick,
            # and none started afterwards while the window still held it (a start-up catch-up
            # runs the pause's skips): nothing was left to run it.
            lost_with_replicas = self._lost_with_replicas(name, t, window_end, resume_horizon)
            if (
                skipped == "paused"
                and definition.catch_up == "all"
                and not self._paused_at(name, t)
                and self._quiet(self.disturbed, t, t + resume_horizon)
                and self._quiet(self.schedule_events[name], t, t + resume_horizon)
                and self._quiet(self.definition_events[name], t, t + catch_horizon)
                and not held_to_window_end
                and not outlasted
                and not lost_with_replicas
            ):
                self.violate(
                    "resume_gap",
                    f"{name} {run_key}: recorded 'skipped: paused' {self._since_resume(name, t)}, "
                    "never caught up",
                )
                continue
            if row is None and key in self.deferred_gated:
                continue  # a pause applied while it waited: a missed tick, by contract
            if row is None and key in self.deferred_missed:
                # Replaced by a later fire while it waited for the runs in its way, or its
                # successor due before they ended: a missed tick, without a row (missed_ticks
                # lists it: check_missed_reports), that the catch-up policy decides about.
                # Under "all" the sweep runs it if its window still holds it once the schedule
                # is free here, which runs of its own (up to SLOW_MAX_S each) may outlast: as
                # the schedule's own overlap skips would.
                continue
            if not quiet:
                continue
            if skipped == "overlap":
                blockers = skip[1] if skip is not None else ()
                if blockers and all(b in ("backfill", "catch_up", "sweep") for b in blockers):
                    self.violate(
                        "backfill_starves_live",
                        f"{name} {run_key}: skipped as overlap while only {list(blockers)} "
                        "ran on the replica that recorded it",
                    )
                continue
            status = None if row is None else row.status.value
            self.violate(
                "clean_tick_lost",
                f"{name} {run_key} (t={t:.3f}s): no run; row {status} skipped={skipped!r}; "
                f"replicas {[r.state for r in self.replicas]}",
            )

    def _since_resume(self, name: str, t: float) -> str:
        ends = [hi for _, hi in self.paused[name] if hi <= t]
        return f"{t - max(ends):.3f}s after the resume" if ends else "outside any pause"

    def _check_actions(self, now: float) -> None:
        for action_id in list(self.actions):
            stored = self.store._actions.get(action_id)
            if stored is None or stored.finished_at is not None:
                self.done_actions.append((now, self.actions.pop(action_id)))
        for action_id, open_action in sorted(self.actions.items()):
            stored = self.store._actions[action_id]
            name = open_action.schedule
            calm_since = max(
                open_action.requested,
                self._last(self.disturbed, now),
                self._last(self.schedule_events[name], now),
            )
            # A schedule's actions run one after the other (overlap): each may wait for those
            # before it that were still open when the cluster became calm.
            bound = open_action.bound_s + sum(
                other.bound_s
                for ended, other in self.done_actions
                if other.schedule == name and other.action_id < action_id and ended >= calm_since
            )
            bound += sum(
                other.bound_s
                for other_id, other in self.actions.items()
                if other.schedule == name and other_id < action_id
            )
            changed = not self._quiet(self.definition_events[name], open_action.requested, now)
            generation_now = self._generation(name)
            if changed and now - open_action.requested > bound:
                current = self.stored[name].definition if name in self.stored else None
                gone = current is None or generation_now != open_action.generation
                hole = "backfill_stall" if open_action.kind == "backfill" else None
                if open_action.kind == "trigger" and gone:
                    hole = "remove_open_actions"
                if hole is not None and self._up_at(now):
                    self.violate(
                        hole,
                        f"{open_action.kind} {action_id} of {name} still open "
                        f"{now - open_action.requested:.1f}s after it was requested; the "
                        f"schedule was {'removed' if gone else 'updated'} meanwhile; "
                        f"progress {stored.progress}",
                    )
                    del self.actions[action_id]
                continue
            if not changed and now - calm_since > bound and self._up_at(now):
                self.violate(
                    "action_never_finishes",
                    f"{open_action.kind} {action_id} of {name} open for "
                    f"{now - open_action.requested:.1f}s (calm for {now - calm_since:.1f}s); "
                    f"progress {stored.progress}",
                )
                del self.actions[action_id]

    @staticmethod
    def _last(events: list[float], now: float) -> float:
        i = bisect.bisect_right(events, now)
        return events[i - 1] if i else -math.inf

    async def check_missed_reports(self) -> None:
        """``missed_ticks`` of every code schedule over the episode against the lease rows."""
        replica = next((r for r in self.replicas if r.state == "up"), None)
        if replica is None or replica.scheduler is None:
            return
        end = self.db_now() - timedelta(seconds=5)
        for name, definition in CODE_SCHEDULES.items():
            trigger = IntervalTrigger(definition.every_ms)
            reported = {
                m.run_key: m
                for m in await replica.scheduler.missed_ticks(name, BASE, end, jobs=self.jobs)
            }
            at = trigger.next_after(BASE - timedelta(microseconds=1))
            while at is not None and at < end:
                run_key = trigger.run_key(at) or ""
                row = self.jobs._rows.get(JobAcquireOptions(code=name, run_key=run_key).lock_key)
                succeeded = row is not None and row.status is JobSchedulerStatus.SUCCESS
                missed = reported.get(run_key)
                if succeeded == (missed is not None):
                    self.violate(
                        "missed_report",
                        f"{name} {run_key}: row {None if row is None else row.status.value}, "
                        f"missed_ticks {'lists' if missed else 'omits'} it",
                    )
                ran = sum(1 for r in self.runs.get((name, run_key), ()) if r.source != "trigger")
                lock = JobAcquireOptions(code=name, run_key=run_key).lock_key
                # The mark is the row's given_back column (MissedTick.given_back carries its
                # reason); the row's data only repeats it for operators.
                reason = self.jobs._given_back.get(lock) if row is not None else None
                if row is not None and GIVEN_BACK in (row.data or {}) and reason is None:
                    reason = "<data only>"
                if (
                    missed is not None
                    and reason is not None
                    and (missed.given_back != reason or (ran == 0 and (missed.attempts or 0) > 0))
                ):
                    self.violate(
                        "given_back_reporting",
                        f"{name} {run_key}: given back ({reason!r}), handler ran {ran} time(s); "
                        f"missed_ticks reports given_back={missed.given_back!r}, "
                        f"{missed.attempts} attempt(s) ({missed.status})",
                    )
                at = trigger.next_after(at)

    # --- the episode ---------------------------------------------------------------------------

    async def run(self, steps: Sequence[Step], drain_s: float = 15.0) -> None:
        self.driver = asyncio.current_task()
        for replica in self.replicas:
            await self.start_replica(replica)
        try:
            for number, step in enumerate(steps):
                self.step_no = number
                await self.apply(step)
                await asyncio.sleep(step.advance_ms / 1000)
                self.check()
            self.step_no = len(steps)
            for replica in self.replicas:  # the cluster heals, then everything settles
                if replica.state == "down":
                    await self.start_replica(replica)
            elapsed = 0.0
            while elapsed < drain_s:
                await asyncio.sleep(0.5)
                elapsed += 0.5
                self.check()
            await self.check_missed_reports()
        finally:
            await self.close()

    async def close(self) -> None:
        for replica in self.replicas:
            if replica.state == "up" and replica.link is not None:
                replica.link.dead = True
                await self._crash(replica)
        tasks = [r.teardown for r in self.replicas if r.teardown is not None]
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
        for replica in self.replicas:  # older incarnations' teardowns are done by now too
            replica.teardown = None


@contextlib.contextmanager
def loop_monotonic(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Make the lease code's client deadlines follow the loop's (simulated) clock."""
    shim = types.SimpleNamespace(monotonic=loop.time, time=time.time, sleep=time.sleep)
    modules = (lease_model, lease_run, memory_module)
    saved = [m.time for m in modules]
    try:
        for module in modules:
            module.time = shim  # type: ignore[attr-defined]
        yield
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.time = original  # type: ignore[attr-defined]


@contextlib.contextmanager
def seeded_ids(seed: int) -> Iterator[None]:
    """Draw the replicas' ids and the lease rows' ids and tokens from ``seed``: a replica's id
    ranks it among each instant's owners, so random ids would make every episode a new one."""
    rng = random.Random(f"ids:{seed}")
    shim = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=rng.getrandbits(128), version=4))
    modules = (plane_module, memory_module)
    saved = [m.uuid for m in modules]
    try:
        for module in modules:
            module.uuid = shim  # type: ignore[attr-defined]
        yield
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.uuid = original  # type: ignore[attr-defined]


@contextlib.contextmanager
def quiet_logs(capture: logging.Handler) -> Iterator[None]:
    """Only errors reach our capture (and nothing reaches pytest's: it would cost most of the
    run)."""
    logger = logging.getLogger("sdcore")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.ERROR)
    logger.propagate = False
    logger.addHandler(capture)
    try:
        yield
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)
        logger.propagate = propagate


@dataclass(slots=True)
class Outcome:
    """What an episode did: its steps, the runs, the gated holes, and the violation if any."""

    seed: int
    config: Config
    steps: int
    runs: int
    gated: dict[str, int]
    first_gated: dict[str, str]
    violation: Violation | None
    sim_seconds: float
    aged_out: frozenset[tuple[str, str]] = frozenset()  # (schedule, run key): Sim.aged_out


def run_episode(
    seed: int, steps: Sequence[Step], holes: frozenset[str], drain_s: float = 15.0
) -> Outcome:
    """Run one episode on a fresh loop-time loop (deterministic for ``seed`` and ``steps``)."""
    config = Config.draw(seed)

    async def main() -> Outcome:
        loop = asyncio.get_running_loop()
        sim = Sim(seed, config, holes)
        violation = None
        with loop_monotonic(loop), seeded_ids(seed), quiet_logs(sim.capture):
            try:
                await sim.run(steps, drain_s)
            except Violation as exc:
                violation = exc
        return Outcome(
            seed=seed,
            config=config,
            steps=len(steps),
            runs=sim.runs_started,
            gated=dict(sim.gated),
            first_gated=dict(sim.first_gated),
            violation=violation,
            sim_seconds=loop.time(),
            aged_out=frozenset(sim.aged_out),
        )

    burst = timer_module.BURST
    timer_module.BURST = config.burst
    try:
        with asyncio.Runner(
            loop_factory=lambda: looptime.new_event_loop(start=0, noop_cycles=1)
        ) as runner:
            return runner.run(main())
    finally:
        timer_module.BURST = burst


def shrink(
    seed: int,
    steps: list[Step],
    hole: str,
    holes: frozenset[str],
    budget_s: float,
) -> list[Step]:
    """Remove steps (chunks, then one at a time) while the episode still fails with ``hole``."""
    deadline = time.monotonic() + budget_s

    def fails(candidate: list[Step]) -> bool:
        outcome = run_episode(seed, candidate, holes)
        return outcome.violation is not None and outcome.violation.hole == hole

    current = list(steps)
    chunk = max(1, len(current) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        index = 0
        removed = False
        while index < len(current) and time.monotonic() < deadline:
            candidate = current[:index] + current[index + chunk :]
            if candidate and fails(candidate):
                current = candidate
                removed = True
            else:
                index += chunk
        if not removed:
            chunk //= 2
    return current
