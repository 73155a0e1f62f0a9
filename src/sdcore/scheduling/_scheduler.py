"""``Scheduler``: the registry of schedules and the one timer loop that fires them."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Literal, Self, TypedDict, TypeVar, Unpack
from zoneinfo import ZoneInfo

from sdcore.job_scheduler import (
    DEFAULT_HEARTBEAT_MS,
    BaseJobScheduler,
    JobAcquireOptions,
    JobSchedulerError,
    JobSchedulerStatus,
)
from sdcore.job_scheduler._options import resolve_timing
from sdcore.scheduling._cron import CronSpec, DayRule, InvalidScheduleError, load_zone
from sdcore.scheduling._runner import (
    CatchUp,
    Handler,
    Overlap,
    RunPolicy,
    TickRunner,
    utcnow,
)
from sdcore.scheduling._triggers import (
    CronTrigger,
    IntervalTrigger,
    OnceTrigger,
    ScheduleKind,
    Trigger,
    expected_instants,
    make_tick,
)

H = TypeVar("H", bound=Handler)
MAX_RANGE_TICKS = 10_000
_MAX_SLEEP = 30.0


class ScheduleOptions(TypedDict, total=False):
    """Per-schedule options (all optional; see the scheduling docs).

    Attributes:
        exclusive: Run each tick on one replica only (default: ``True`` when the scheduler has
            ``jobs``).
        overlap: ``"skip"`` (default), ``"allow"`` or ``"skip_cluster"``.
        catch_up: ``"off"`` (default), ``"latest"`` or ``"all"`` missed ticks at start-up.
        catch_up_window_ms: How far back catch-up looks (default 1 hour).
        retries: Re-runs of a failed tick, never past the next tick (default 0).
        retry_backoff_ms: First retry delay, doubled each time (default 1,000).
        jitter_ms: Random delay of the fire moment; the run key is unchanged (default 0).
        lease_ms: Lease of each tick (default: the scheduler's).
        heartbeat_ms: Heartbeat interval (default ``min(60 s, lease_ms // 3)``).
    """

    exclusive: bool
    overlap: Overlap | Literal["skip", "allow", "skip_cluster"]
    catch_up: CatchUp | Literal["off", "latest", "all"]
    catch_up_window_ms: int
    retries: int
    retry_backoff_ms: int
    jitter_ms: int
    lease_ms: int
    heartbeat_ms: int


class ScheduleNotFoundError(KeyError):
    """No schedule has this name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleInfo:
    """A schedule as the registry lists it."""

    name: str
    kind: ScheduleKind
    description: str
    time_zone: str
    exclusive: bool
    active: bool
    running: int
    next_fire_at: datetime | None
    next_fire_local: datetime | None


@dataclass(frozen=True, slots=True, kw_only=True)
class MissedTick:
    """An expected tick without a ``SUCCESS`` row (``status`` ``None``: it never started)."""

    scheduled_at: datetime
    run_key: str
    status: JobSchedulerStatus | None


class _Entry:
    __slots__ = (
        "active",
        "handler",
        "kind",
        "name",
        "next_at",
        "policy",
        "running",
        "trigger",
        "version",
        "zone",
    )

    def __init__(
        self, name: str, trigger: Trigger, handler: Handler, zone: ZoneInfo, policy: RunPolicy
    ) -> None:
        self.name = name
        self.kind = trigger.kind
        self.trigger = trigger
        self.handler = handler
        self.zone = zone
        self.policy = policy
        self.active = True
        self.running: set[asyncio.Task[Any]] = set()
        self.next_at: datetime | None = None
        self.version = 0


def _check_ms(schedule: str | None, option: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidScheduleError(
            schedule, f"{option} must be an int (ms), got {type(value).__name__}"
        )
    if not minimum <= value <= 2**53 - 1:
        raise InvalidScheduleError(
            schedule, f"{option} must be between {minimum} and 2**53 - 1, got {value}"
        )
    return value


class Scheduler:
    """Cron, interval, timeout and initial schedules; exclusive across replicas with ``jobs``.

    Args:
        jobs: A job scheduler (``JobSchedulerService``); ``None`` runs every tick on every process,
            as NestJS does.
        time_zone: Default IANA zone for cron schedules.
        lease_ms: Default lease of exclusive ticks (default 5 minutes).
        grace_period_ms: On exit, how long running handlers may finish before they are cancelled.
        clock: Wall clock returning aware UTC datetimes (inject one in tests).
        logger_name: Logger for tick events.

    Raises:
        InvalidScheduleError: A bad zone or option.
    """

    def __init__(
        self,
        *,
        jobs: BaseJobScheduler | None = None,
        time_zone: str = "UTC",
        lease_ms: int = 300_000,
        grace_period_ms: int = 10_000,
        clock: Callable[[], datetime] = utcnow,
        logger_name: str = "sdcore.scheduling",
    ) -> None:
        self._jobs = jobs
        self._zone = load_zone(time_zone)
        self._lease_ms = _check_ms(None, "lease_ms", lease_ms, minimum=3)
        self._grace = _check_ms(None, "grace_period_ms", grace_period_ms, minimum=0) / 1000
        self._clock = clock
        self._log = logging.getLogger(logger_name)
        self._runner = TickRunner(jobs, self._log)
        self._entries: dict[str, _Entry] = {}
        self._heap: list[tuple[datetime, int, int, _Entry]] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self._started_at: datetime | None = None
        self._closing = False

    # --- registration ------------------------------------------------------------------------

    def cron(
        self,
        expression: str,
        *,
        name: str | None = None,
        time_zone: str | None = None,
        day_rule: DayRule | str = DayRule.VIXIE,
        **options: Unpack[ScheduleOptions],
    ) -> Callable[[H], H]:
        """Decorate a handler to run on a cron expression (5 or 6 fields, macros, constants).

        ``day_rule`` chooses how day-of-month and day-of-week combine: ``"vixie"`` (default,
        as cronie) or ``"nestjs"`` (as npm ``cron``); see :class:`DayRule`.
        """
        return self._decorator(
            lambda h, n: self.add_cron(
                n, expression, h, time_zone=time_zone, day_rule=day_rule, **options
            ),
            name,
        )

    def interval(
        self, every_ms: int, *, name: str | None = None, **options: Unpack[ScheduleOptions]
    ) -> Callable[[H], H]:
        """Decorate a handler to run every ``every_ms`` on the shared epoch grid."""
        return self._decorator(lambda h, n: self.add_interval(n, every_ms, h, **options), name)

    def timeout(self, delay_ms: int, *, name: str | None = None) -> Callable[[H], H]:
        """Decorate a handler to run once per process, ``delay_ms`` after start."""
        return self._decorator(lambda h, n: self.add_timeout(n, delay_ms, h), name)

    def initial(
        self, *, name: str | None = None, **options: Unpack[ScheduleOptions]
    ) -> Callable[[H], H]:
        """Decorate a handler to run once per cluster, ever (``INITIAL`` lease; needs jobs)."""
        return self._decorator(lambda h, n: self.add_initial(n, h, **options), name)

    def _decorator(self, register: Callable[[H, str], None], name: str | None) -> Callable[[H], H]:
        def decorate(handler: H) -> H:
            register(handler, name if name is not None else getattr(handler, "__name__", ""))
            return handler

        return decorate

    def add_cron(
        self,
        name: str,
        expression: str,
        handler: Handler,
        *,
        time_zone: str | None = None,
        day_rule: DayRule | str = DayRule.VIXIE,
        **options: Unpack[ScheduleOptions],
    ) -> None:
        """Register a cron schedule (see :meth:`cron`); usable while running."""
        zone = self._zone if time_zone is None else load_zone(time_zone, name)
        spec = CronSpec.parse(expression, zone, name, day_rule=day_rule)
        self._add(name, CronTrigger(spec), handler, zone, options)

    def add_interval(
        self, name: str, every_ms: int, handler: Handler, **options: Unpack[ScheduleOptions]
    ) -> None:
        """Register an interval schedule (see :meth:`interval`)."""
        every = _check_ms(name, "every_ms", every_ms, minimum=1)
        self._add(name, IntervalTrigger(every), handler, self._zone, options)

    def add_timeout(self, name: str, delay_ms: int, handler: Handler) -> None:
        """Register a one-shot, per-process schedule (see :meth:`timeout`)."""
        delay = _check_ms(name, "delay_ms", delay_ms, minimum=0)
        # Added while running: the delay counts from now, as NestJS's addTimeout does.
        base = None if self._started_at is None else self._clock()
        trigger = OnceTrigger(ScheduleKind.TIMEOUT, delay, base)
        self._add(name, trigger, handler, self._zone, {"exclusive": False})

    def add_initial(self, name: str, handler: Handler, **options: Unpack[ScheduleOptions]) -> None:
        """Register a once-per-cluster schedule (see :meth:`initial`)."""
        if self._jobs is None:
            raise InvalidScheduleError(name, "initial schedules need a job scheduler (jobs=...)")
        base = None if self._started_at is None else self._clock()
        trigger = OnceTrigger(ScheduleKind.INITIAL, 0, base)
        self._add(name, trigger, handler, self._zone, {**options, "exclusive": True})

    def _add(
        self,
        name: object,
        trigger: Trigger,
        handler: Handler,
        zone: ZoneInfo,
        options: Mapping[str, Any],
    ) -> None:
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise InvalidScheduleError(
                None, f"schedule name must be a non-empty trimmed str, got {name!r:.80}"
            )
        if len(name) > 64 or "\x00" in name:
            raise InvalidScheduleError(name, "name must hold at most 64 characters and no NUL")
        if name in self._entries:
            raise InvalidScheduleError(name, "a schedule with this name already exists")
        if not callable(handler):
            raise InvalidScheduleError(name, "handler must be callable")
        entry = _Entry(name, trigger, handler, zone, self._policy(name, options))
        self._entries[name] = entry
        if self._started_at is not None:
            self._arm(entry, self._clock())

    def _policy(self, name: str, options: Mapping[str, Any]) -> RunPolicy:
        known = {
            "exclusive",
            "overlap",
            "catch_up",
            "catch_up_window_ms",
            "retries",
            "retry_backoff_ms",
            "jitter_ms",
            "lease_ms",
            "heartbeat_ms",
        }
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidScheduleError(name, f"unknown option(s): {', '.join(unknown)}")
        exclusive = options.get("exclusive", self._jobs is not None)
        if not isinstance(exclusive, bool):
            raise InvalidScheduleError(name, "exclusive must be a bool")
        if exclusive and self._jobs is None:
            raise InvalidScheduleError(name, "exclusive=True needs a job scheduler (jobs=...)")
        try:
            overlap = Overlap(options.get("overlap", Overlap.SKIP))
            catch_up = CatchUp(options.get("catch_up", CatchUp.OFF))
        except ValueError as exc:
            raise InvalidScheduleError(name, str(exc)) from None
        lease = options.get("lease_ms", self._lease_ms)
        heartbeat = options.get(
            "heartbeat_ms",
            min(DEFAULT_HEARTBEAT_MS, _check_ms(name, "lease_ms", lease, minimum=3) // 3),
        )
        try:
            lease, heartbeat = resolve_timing(lease, heartbeat)
        except ValueError as exc:
            raise InvalidScheduleError(name, str(exc)) from None
        return RunPolicy(
            exclusive=exclusive,
            overlap=overlap,
            catch_up=catch_up,
            catch_up_window_ms=_check_ms(
                name, "catch_up_window_ms", options.get("catch_up_window_ms", 3_600_000), minimum=1
            ),
            retries=_check_ms(name, "retries", options.get("retries", 0), minimum=0),
            retry_backoff_ms=_check_ms(
                name, "retry_backoff_ms", options.get("retry_backoff_ms", 1_000), minimum=1
            ),
            jitter_ms=_check_ms(name, "jitter_ms", options.get("jitter_ms", 0), minimum=0),
            lease_ms=lease,
            heartbeat_ms=heartbeat,
        )

    # --- registry ----------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ScheduleNotFoundError(name) from None

    def get(self, name: str) -> ScheduleInfo:
        """Return one schedule. Raises ``ScheduleNotFoundError``."""
        return self._info(self._entry(name))

    def schedules(self) -> list[ScheduleInfo]:
        """Return every schedule, soonest next fire first (inactive ones last)."""
        infos = [self._info(entry) for entry in self._entries.values()]
        far = datetime.max.replace(tzinfo=self._zone)
        return sorted(infos, key=lambda i: (i.next_fire_at is None, i.next_fire_at or far, i.name))

    def _info(self, entry: _Entry) -> ScheduleInfo:
        upcoming = entry.next_at
        if upcoming is None and entry.active and self._started_at is None:
            upcoming = entry.trigger.next_after(self._clock())
        if not entry.active:
            upcoming = None
        return ScheduleInfo(
            name=entry.name,
            kind=entry.kind,
            description=entry.trigger.describe(),
            time_zone=entry.zone.key,
            exclusive=entry.policy.exclusive,
            active=entry.active,
            running=len(entry.running),
            next_fire_at=upcoming,
            next_fire_local=None if upcoming is None else upcoming.astimezone(entry.zone),
        )

    def stop(self, name: str) -> None:
        """Stop firing a schedule (a run in progress goes on)."""
        entry = self._entry(name)
        entry.active = False
        entry.version += 1
        entry.next_at = None

    def start(self, name: str) -> None:
        """Resume a stopped schedule from its next fire time after now."""
        entry = self._entry(name)
        if not entry.active:
            entry.active = True
            if self._started_at is not None:
                self._arm(entry, self._clock())

    def remove(self, name: str) -> None:
        """Stop and forget a schedule."""
        self.stop(name)
        del self._entries[name]

    # --- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start_all(self) -> None:
        """Start firing every active schedule (``async with scheduler`` calls this)."""
        if self._started_at is not None:
            return
        now = self._clock()
        self._started_at = now
        for entry in self._entries.values():
            if isinstance(entry.trigger, OnceTrigger):
                entry.trigger = OnceTrigger(entry.trigger.kind, entry.trigger.delay_ms, now)
            if entry.active:
                self._arm(entry, now)
        await self._catch_up(now)
        self._loop_task = asyncio.create_task(self._loop(), name="sdcore-scheduler")
        self._sweep_task = asyncio.create_task(self._sweep(), name="sdcore-scheduler-sweep")

    async def aclose(self) -> None:
        """Stop firing, let running handlers finish within the grace period, then cancel them."""
        self._closing = True
        for task in (self._loop_task, self._sweep_task):
            if task is not None:
                task.cancel()
                await asyncio.wait({task})
        self._loop_task = self._sweep_task = None
        running = {task for entry in self._entries.values() for task in entry.running}
        if running:
            _, pending = await asyncio.wait(running, timeout=self._grace)
            for task in pending:
                task.cancel()
            if pending:
                self._log.warning(
                    "cancelled %d run(s) still going after the grace period",
                    len(pending),
                    extra={"action": "shutdown_cancelled"},
                )
                await asyncio.wait(pending)

    def _arm(self, entry: _Entry, after: datetime) -> None:
        entry.version += 1
        if isinstance(entry.trigger, OnceTrigger):
            after = after - timedelta(microseconds=1)  # a one-shot may be due right now
        entry.next_at = entry.trigger.next_after(after)
        if entry.next_at is not None:
            heapq.heappush(self._heap, (entry.next_at, next(self._seq), entry.version, entry))
            self._compact()
        self._wake.set()

    def _compact(self) -> None:
        # stop/start/remove leave stale heap entries until their due time (a day, for a daily
        # job): rebuild the heap once they outnumber the live schedules.
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [
                item
                for item in self._heap
                if item[2] == item[3].version
                and item[3].active
                and self._entries.get(item[3].name) is item[3]
            ]
            heapq.heapify(self._heap)

    async def _loop(self) -> None:
        while True:
            now = self._clock()
            while self._heap and self._heap[0][0] <= now:
                due, _, version, entry = heapq.heappop(self._heap)
                if version != entry.version or not entry.active or entry.name not in self._entries:
                    continue
                try:
                    self._fire(entry, due, now)
                except Exception:  # noqa: BLE001 - one bad schedule must not stop the others
                    self._log.exception(
                        "schedule %r: could not fire; it is stopped",
                        entry.name,
                        extra={"action": "fire_failed", "schedule": entry.name},
                    )
                    entry.active = False
            delay = _MAX_SLEEP
            if self._heap:
                delay = min(delay, max(0.0, (self._heap[0][0] - self._clock()).total_seconds()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    def _fire(self, entry: _Entry, due: datetime, now: datetime) -> None:
        # Coalesce ticks that passed while the loop was blocked or the process suspended: fire
        # only the most recent one (missed ticks are what the catch-up policy is for).
        skipped = 0
        following = entry.trigger.next_after(due)
        while following is not None and following <= now and skipped < 100_000:
            due, following, skipped = following, entry.trigger.next_after(following), skipped + 1
        if skipped:
            self._log.info(
                "schedule %r: %d tick(s) passed while the loop was late; firing the latest",
                entry.name,
                skipped,
                extra={"action": "ticks_coalesced", "schedule": entry.name},
            )
        entry.version += 1
        entry.next_at = following
        if following is not None:
            heapq.heappush(self._heap, (following, next(self._seq), entry.version, entry))
        if entry.running and entry.policy.overlap is Overlap.SKIP:
            self._log.info(
                "schedule %r run %r: skipped, the previous run is still running here",
                entry.name,
                entry.trigger.run_key(due),
                extra={"action": "tick_overlap_skipped", "schedule": entry.name},
            )
            return
        self._spawn(entry, due, following)

    def _spawn(self, entry: _Entry, due: datetime, deadline: datetime | None) -> None:
        tick = make_tick(entry.name, entry.trigger, entry.zone, due)
        task = asyncio.create_task(
            self._runner.run(
                name=entry.name,
                kind=entry.kind,
                handler=entry.handler,
                policy=entry.policy,
                tick=tick,
                deadline=deadline,
                clock=self._clock,
            ),
            name=f"sdcore-tick:{entry.name}",
        )
        entry.running.add(task)
        task.add_done_callback(entry.running.discard)

    def _catch_up_entries(self) -> list[_Entry]:
        return [
            entry
            for entry in self._entries.values()
            if entry.active
            and entry.policy.catch_up is not CatchUp.OFF
            and entry.policy.exclusive
            and entry.kind in (ScheduleKind.CRON, ScheduleKind.INTERVAL)
        ]

    async def _catch_up(self, now: datetime, *, sweep: bool = False) -> None:
        """Run missed ticks of catch-up schedules.

        At start-up every tick of the window without ``SUCCESS`` counts. A periodic *sweep* (every
        ``lease_ms``) only takes ticks that never started or were left ``RUNNING`` (their owner
        died; the lease decides whether they expired) — ``FAIL`` is the retry policy's business.
        """
        for entry in self._catch_up_entries():
            policy = entry.policy
            start = now - timedelta(milliseconds=policy.catch_up_window_ms)
            end = now - timedelta(seconds=1) if sweep else now
            limit = 10 if policy.catch_up is CatchUp.LATEST else 1000
            try:
                missed = await self._missed(entry, start, end, self._jobs, keep_last=limit)
            except (JobSchedulerError, ValueError) as exc:
                self._log.warning(
                    "schedule %r: catch-up skipped: %s",
                    entry.name,
                    exc,
                    extra={"action": "catch_up_failed", "schedule": entry.name},
                )
                continue
            if sweep:
                missed = [tick for tick in missed if tick.status is not JobSchedulerStatus.FAIL]
            chosen = missed[-1:] if policy.catch_up is CatchUp.LATEST else missed[-100:]
            for tick in chosen:
                self._log.log(
                    logging.DEBUG if sweep and tick.status is not None else logging.INFO,
                    "schedule %r: catching up missed tick %r (%s)",
                    entry.name,
                    tick.run_key,
                    "never started" if tick.status is None else tick.status.value,
                    extra={"action": "catch_up", "schedule": entry.name, "run_key": tick.run_key},
                )
                self._spawn(entry, tick.scheduled_at, entry.next_at)

    async def _sweep(self) -> None:
        while True:
            entries = self._catch_up_entries()
            interval = max(1.0, min((e.policy.lease_ms for e in entries), default=30_000) / 1000)
            await asyncio.sleep(interval)
            if entries:
                try:
                    await self._catch_up(self._clock(), sweep=True)
                except Exception:  # noqa: BLE001 - the sweep must outlive a bad round
                    self._log.exception("catch-up sweep failed", extra={"action": "sweep_failed"})

    # --- missed ticks ------------------------------------------------------------------------

    def expected_ticks(self, name: str, start: datetime, end: datetime) -> list[datetime]:
        """Return the scheduled instants of ``name`` in ``[start, end)`` (at most 10,000)."""
        entry = self._entry(name)
        return expected_instants(entry.trigger, start, end, limit=MAX_RANGE_TICKS)

    async def missed_ticks(
        self, name: str, start: datetime, end: datetime, *, jobs: BaseJobScheduler | None = None
    ) -> list[MissedTick]:
        """Return the ticks of ``name`` in ``[start, end)`` that have no ``SUCCESS`` row.

        Args:
            name: The schedule.
            start: Range start (aware, inclusive).
            end: Range end (aware, exclusive).
            jobs: The job scheduler to ask (default: the scheduler's own).

        Raises:
            ScheduleNotFoundError: Unknown schedule.
            InvalidScheduleError: No job scheduler, or not a cron/interval schedule.
            ValueError: Unaware bounds or more than 10,000 ticks.
        """
        return await self._missed(self._entry(name), start, end, jobs or self._jobs)

    async def _missed(
        self,
        entry: _Entry,
        start: datetime,
        end: datetime,
        jobs: BaseJobScheduler | None,
        *,
        keep_last: int | None = None,
    ) -> list[MissedTick]:
        if jobs is None or entry.kind not in (ScheduleKind.CRON, ScheduleKind.INTERVAL):
            raise InvalidScheduleError(
                entry.name, "missed ticks need jobs and a cron or interval schedule"
            )
        if keep_last is None:
            instants = expected_instants(entry.trigger, start, end, limit=MAX_RANGE_TICKS)
        else:
            instants = expected_instants(entry.trigger, start, end, limit=keep_last, keep_last=True)
        keys: dict[str, tuple[datetime, str]] = {}
        for instant in instants:
            run_key = entry.trigger.run_key(instant)
            assert run_key is not None  # noqa: S101 - cron and interval ticks always have one
            keys[JobAcquireOptions(code=entry.name, run_key=run_key).lock_key] = (instant, run_key)
        statuses = await jobs.statuses(list(keys))
        return [
            MissedTick(scheduled_at=instant, run_key=run_key, status=statuses.get(key))
            for key, (instant, run_key) in keys.items()
            if statuses.get(key) is not JobSchedulerStatus.SUCCESS
        ]
