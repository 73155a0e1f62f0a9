"""``Alerting``: a missed, failed or overrunning tick pages someone, once per incident.

How "once per incident, not once per replica" is kept: every replica observes its own ticks (the
telemetry seam) and scans the lease table for ticks nobody ran, so several replicas may notice
one problem. None of them decides alone: the decision is a short transaction under an advisory
lock on the schedule, which reads the alerts outbox and writes the alert rows in the same commit
(:mod:`sdcore.alerting._incidents`). The outbox's idempotency keys are derived from (schedule,
kind, run key, sink), so even two decisions that raced past the read would write one row. The
tick's lease owner is *not* the one to decide: a killed replica's tick has no owner left to
tell anyone, and a tick nobody started never had one. Delivery then goes through the outbox: a
crash after the commit loses nothing (another replica's relay delivers the row), and a webhook
that is down is retried with backoff.

What is noticed, per cron or interval schedule:

- ``missed``: a tick started late by start-up catch-up or the sweep, or taken over from a replica
  that died mid-run (its lease expired), or, found by the periodic scan, a tick with no row
  ``missed_after_ms`` after the last of its owners could ask for it, 2 s after its instant (this
  works with ``catch_up="off"`` too);
- ``failed``: a tick's last attempt (``retries + 1``) raised;
- ``overrun``: a run still going after the schedule's ``max_runtime_ms``;
- ``resolved``: the next success of the schedule after one of those, of a tick run on time (the
  late runs of missed ticks, one after the other after an outage, are part of the incident).

Check-in sinks (Sentry Crons, Healthchecks) are sent every attempt's start and end from the
replica that runs it, directly (a check-in replayed late would lie).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg_pool import AsyncConnectionPool

from sdcore._internal.telemetry import FAILURE, LOST_LEASE, SUCCESS, Observer
from sdcore._internal.validation import at_least, int_between
from sdcore.alerting._incidents import IncidentLog, Problem
from sdcore.alerting._model import AlertKind, InvalidAlertingConfigError, check_in_id
from sdcore.alerting._observer import LATE_PATHS, AlertObserver, Finished, Overran, Started
from sdcore.alerting._publisher import WebhookPublisher, send
from sdcore.alerting._scan import MissedScan
from sdcore.alerting._sinks import CheckIn, CheckInSink, CheckInStatus, WebhookSink
from sdcore.job_scheduler import BaseJobScheduler
from sdcore.outbox import Outbox, OutboxRelay, PostgresOutboxStore

if TYPE_CHECKING:
    import httpx

    from sdcore.scheduling import ScheduleInfo, Scheduler, ScheduleStore

__all__ = ["Alerting"]

MAX_QUEUED = 100_000  # events waiting for the alerting loop; more are dropped (and logged)
_CHECK_INS_AT_ONCE = 32
_CLEAR_S = 1.0
T = TypeVar("T")
_DECISION_TRIES = 3
_HISTORY_LOOKBACK = 50  # runs read back to find the previous attempt of a retried tick
_Event = Started | Finished | Overran


class Alerting:
    """Alerts on missed, failed and overrunning ticks, through webhook and check-in sinks.

    Wire it on a :class:`~sdcore.runtime.Runtime` (``Runtime(dsn, alerting=Alerting([...]))``),
    which installs :attr:`observer`, starts it before the scheduler and stops it after. Needs
    ``sdcore[alerting]`` (httpx).

    Args:
        sinks: :class:`WebhookSink` (incidents, through the alerts outbox) and check-in sinks
            (:class:`SentryCronsSink`, :class:`HealthchecksSink`, or your own
            :class:`CheckInSink`). Names must be unique.
        table: The alerts outbox table (a table of its own: the relay that delivers it posts
            to webhooks, not to BullMQ).
        schema: Its schema (``None``: the ``search_path``).
        max_attempts: Delivery attempts of a webhook alert before its row is ``DEAD``.
        retry_base_ms: First retry delay of a failed delivery (doubled each time).
        retry_max_ms: Largest retry delay.
        poll_interval_ms: How often the alerts relay looks for rows.
        missed_after_ms: The periodic scan calls a tick with no row missed this long after the
            last of its owners could ask for it, 2 s after its instant (longer than a replica
            takes to start a tick; at least 1 s).
        missed_window_ms: How far back the first scan looks (alerts on ticks missed while every
            replica was down, within this window).
        scan_interval_ms: How often each replica scans (``None``: no scan; missed ticks are then
            noticed only when catch-up starts them).
        logger_name: Logger of alert decisions and delivery problems.

    Raises:
        InvalidAlertingConfigError: No sink, two sinks with one name, or a sink of no known kind.
        TypeError: A numeric option that is not an int.
        ValueError: A numeric option out of range.
    """

    def __init__(
        self,
        sinks: Sequence[WebhookSink | CheckInSink],
        *,
        table: str = "sdcore_alerts",
        schema: str | None = None,
        max_attempts: int = 20,
        retry_base_ms: int = 1_000,
        retry_max_ms: int = 300_000,
        poll_interval_ms: int = 1_000,
        missed_after_ms: int = 60_000,
        missed_window_ms: int = 3_600_000,
        scan_interval_ms: int | None = 30_000,
        logger_name: str = "sdcore.alerting",
    ) -> None:
        if not sinks:
            raise InvalidAlertingConfigError("sinks", "give at least one sink")
        names = [getattr(s, "name", None) for s in sinks]
        if len(set(names)) != len(names):
            raise InvalidAlertingConfigError("sinks", f"sink names must be unique, got {names}")
        self.webhooks = {s.name: s for s in sinks if isinstance(s, WebhookSink)}
        self.check_ins: list[CheckInSink] = []
        for sink in sinks:
            if isinstance(sink, WebhookSink):
                continue
            if not callable(getattr(sink, "requests", None)):
                raise InvalidAlertingConfigError(
                    "sinks", f"{sink!r:.60} is neither a WebhookSink nor a CheckInSink"
                )
            self.check_ins.append(sink)
        self.outbox = Outbox(table=table, schema=schema, max_attempts=max_attempts, notify=False)
        self._retry = (
            at_least("retry_base_ms", retry_base_ms, 1),
            at_least("retry_max_ms", retry_max_ms, 1),
        )
        self._poll_ms = at_least("poll_interval_ms", poll_interval_ms, 10)
        self._missed_after = timedelta(
            milliseconds=int_between("missed_after_ms", missed_after_ms, 1_000, 2**31 - 1)
        )
        self._window = timedelta(
            milliseconds=int_between("missed_window_ms", missed_window_ms, 1_000, 2**40)
        )
        self._scan_s = (
            None
            if scan_interval_ms is None
            else int_between("scan_interval_ms", scan_interval_ms, 100, 2**31 - 1) / 1000
        )
        self._log = logging.getLogger(logger_name)
        self.observer: Observer = AlertObserver(self._post)
        """The observer to install on the telemetry hub of the scheduler."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        self._queue: asyncio.Queue[_Event] | None = None
        self._dropped = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sending: set[asyncio.Task[Any]] = set()  # check-ins in flight
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._late_runs: set[int] = set()  # attempts started here that run a missed tick
        self._check_in_slots: asyncio.Semaphore | None = None
        # Until when (loop time) a success of a schedule need not ask whether an incident is open.
        self._clear: dict[str, float] = {}
        self._client: httpx.AsyncClient | None = None
        self._relay: OutboxRelay | None = None
        self._incidents: IncidentLog | None = None
        self._scheduler: Scheduler | None = None
        self._jobs: BaseJobScheduler | None = None
        self._history: ScheduleStore | None = None
        self._scan: MissedScan | None = None

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran and :meth:`stop` has not since."""
        return self._loop is not None

    async def start(
        self,
        pool: AsyncConnectionPool[Any],
        scheduler: Scheduler,
        *,
        jobs: BaseJobScheduler | None = None,
        history: ScheduleStore | None = None,
        ensure_schema: bool = True,
        relay: bool = True,
    ) -> None:
        """Create the alerts table (``ensure_schema``), start the relay (``relay``), the
        alerting loop and the scan.

        Args:
            pool: Where the alerts table is.
            scheduler: Whose schedules are watched (their options: retries, max_runtime_ms).
            jobs: The scheduler's lease table, for the scan (``None``: no scan).
            history: The control plane's run history (``None``: without it, a tick taken
                over from a dead replica is told from a retry only past its retries).
            ensure_schema: Apply the alerts table's migrations first.
            relay: Run the alerts relay here (deliver webhooks).

        Raises:
            RuntimeError: Already started.
        """
        import httpx

        if self._loop is not None:
            raise RuntimeError("this Alerting is already started")
        if ensure_schema:
            await self.outbox.ensure_schema(pool)
        self._scheduler = scheduler
        self._jobs = jobs
        self._history = history
        self._client = httpx.AsyncClient(follow_redirects=False)
        self._incidents = IncidentLog(pool, self.outbox, list(self.webhooks), self._log)
        self._queue = asyncio.Queue(MAX_QUEUED)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._clear = {}
        self._check_in_slots = asyncio.Semaphore(_CHECK_INS_AT_ONCE)
        self._scan = MissedScan(self._missed_after, self._window, datetime.now(UTC), self._log)
        self._spawn(self._drain(), "sdcore-alerting")
        if self._scan_s is not None and jobs is not None and self.webhooks:
            self._spawn(self._scan_loop(self._scan_s), "sdcore-alerting-scan")
        if relay and self.webhooks:
            try:
                self._relay = OutboxRelay(
                    PostgresOutboxStore(pool, outbox=self.outbox),
                    WebhookPublisher(self.webhooks, client=self._client),
                    poll_interval_ms=self._poll_ms,
                    retry_base_ms=self._retry[0],
                    retry_max_ms=self._retry[1],
                    logger_name=self._log.name,
                )
                await self._relay.start()
            except BaseException:
                self._relay = None
                await self.stop(0.0)  # what started here stops: a failed start holds nothing
                raise

    async def stop(self, grace_s: float = 10.0) -> None:
        """Decide what is queued and send the check-ins in flight (within ``grace_s``), then
        stop the relay and the loops."""
        if self._loop is None:
            return
        queue = self._queue
        self._loop = None  # events from now on are dropped
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._late_runs.clear()
        deadline = asyncio.get_running_loop().time() + max(grace_s, 0.0)
        if queue is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(queue.join(), max(grace_s, 0.0))
        if self._sending:
            left = deadline - asyncio.get_running_loop().time()
            await asyncio.wait(set(self._sending), timeout=max(left, 0.0))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._relay is not None:
            await self._relay.stop(grace_s)
            self._relay = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _spawn(self, coro: Any, name: str, *, sending: bool = False) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if sending:
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    # --- events from the observer (any thread) ------------------------------------------------

    def _post(self, event: Started | Finished) -> None:
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() == self._thread:
            self._put(event)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._put, event)

    def _put(self, event: _Event) -> None:
        queue = self._queue
        if queue is None or self._loop is None:
            return
        try:
            queue.put_nowait(event)
        except asyncio.QueueFull:
            self._dropped += 1
            if self._dropped % 1000 == 1:
                self._log.error(
                    "alerting is %d events behind; %d dropped so far",
                    MAX_QUEUED,
                    self._dropped,
                    extra={"action": "alert_events_dropped"},
                )

    # --- the alerting loop --------------------------------------------------------------------

    async def _drain(self) -> None:
        queue = self._queue
        assert queue is not None  # noqa: S101 - set by start
        while True:
            event = await queue.get()
            try:
                await self._handle(event)
            except Exception:  # noqa: BLE001 - one event's failure never stops alerting
                self._log.exception(
                    "alerting could not handle %s",
                    type(event).__name__,
                    extra={"action": "alert_failed"},
                )
            finally:
                queue.task_done()

    async def _handle(self, event: _Event) -> None:
        if isinstance(event, Overran):
            self._timers.pop(event.started.token, None)
            reason = f"still running after {event.limit_ms} ms (max_runtime_ms)"
            await self._decide(_problem(AlertKind.OVERRUN, event.started, reason))
            return
        info = self._info(event.schedule)
        if isinstance(event, Started):
            self._check_in(event, info, CheckInStatus.STARTED, None)
            if info is not None and info.max_runtime_ms is not None and self._loop is not None:
                limit = info.max_runtime_ms
                delay = max(0.0, limit / 1000 - (self._loop.time() - event.at))
                self._timers[event.token] = self._loop.call_later(
                    delay, self._put, Overran(started=event, limit_ms=limit)
                )
            how = await self._late(event, info)
            if how is not None:
                self._late_runs.add(event.token)
                reason = f"not run at its instant: {how}"
                await self._decide(_problem(AlertKind.MISSED, event, reason))
            return
        timer = self._timers.pop(event.token, None)
        if timer is not None:
            timer.cancel()
        late = event.token in self._late_runs
        self._late_runs.discard(event.token)
        if event.cancelled:
            return  # a shutdown ended it: another replica's sweep takes the tick over
        if event.outcome == SUCCESS:
            self._check_in(event, info, CheckInStatus.SUCCEEDED, event.duration_s)
            incidents = self._incidents
            loop_time = asyncio.get_running_loop().time()
            if late or incidents is None or self._clear.get(event.schedule, 0.0) > loop_time:
                # A missed tick run late does not resolve: catch-up after an outage runs one
                # after the other, and the outage is one incident until a tick runs on time.
                return
            resolved = await self._retrying(
                lambda: incidents.resolve(
                    event.schedule, event.run_key, event.scheduled_at, event.attempt
                )
            )
            if resolved is None:
                # Nothing was open: the successes of the next second need not ask again (an
                # incident this replica opens clears this; one another replica opens is
                # resolved by a later success, at most a second of ticks later).
                self._clear[event.schedule] = loop_time + _CLEAR_S
            return
        if event.outcome in (FAILURE, LOST_LEASE):
            self._check_in(event, info, CheckInStatus.FAILED, event.duration_s)
        retries = 0 if info is None else info.retries
        if event.outcome == FAILURE and event.attempt >= retries + 1:
            reason = f"its last attempt ({event.attempt} of {retries + 1}) failed"
            await self._decide(_problem(AlertKind.FAILED, event, reason))

    async def _late(self, event: Started, info: ScheduleInfo | None) -> str | None:
        """Why the attempt ``event`` starts a tick that was missed, or ``None`` (it was not).

        A tick is missed when catch-up or the sweep starts it, or when this attempt takes it over
        from a replica that died mid-run: an attempt past the retry budget can only be that (an
        abandoned attempt is re-run whatever the budget), and within it the run history tells
        (the takeover closed the previous attempt as abandoned).
        """
        if not self.webhooks:
            return None  # no sink takes incidents
        if event.path in LATE_PATHS:
            return "its replica stopped mid-run" if event.attempt > 1 else "it never started"
        if event.attempt < 2 or event.run_key is None:
            return None
        taken_over = "taken over from a replica that stopped mid-run"
        if info is not None and event.attempt > info.retries + 1:
            return taken_over
        if self._history is None:
            return None
        try:
            runs = await self._history.history(event.schedule, _HISTORY_LOOKBACK)
        except Exception as exc:  # noqa: BLE001 - judged without it
            self._log.warning("alerting: run history unreadable: %s", exc)
            return None
        for run in runs:
            if run.run_key == event.run_key and run.attempt == event.attempt - 1:
                abandoned = run.status == "RUNNING" or (run.error or "").startswith("abandoned")
                return taken_over if abandoned else None
        return None

    def _info(self, name: str) -> ScheduleInfo | None:
        from sdcore.scheduling import ScheduleNotFoundError

        if self._scheduler is None:
            return None
        try:
            return self._scheduler.get(name)
        except ScheduleNotFoundError:
            return None  # removed since

    async def _decide(self, problem: Problem | None) -> None:
        incidents = self._incidents
        if problem is None:
            return  # an initial schedule's run: no run key to name an incident by
        self._clear.pop(problem.schedule, None)
        if incidents is not None:
            await self._retrying(lambda: incidents.open(problem))

    async def _retrying(self, decision: Callable[[], Awaitable[T]]) -> T | None:
        """Run a decision, again on a database error (it reads before it writes: idempotent);
        ``None`` when it could not be recorded."""
        import psycopg

        for attempt in range(1, _DECISION_TRIES + 1):
            try:
                return await decision()
            except psycopg.Error as exc:
                if attempt == _DECISION_TRIES:
                    self._log.error(
                        "alerting: could not record a decision: %s",
                        exc,
                        extra={"action": "alert_not_recorded"},
                    )
                    return None
                await asyncio.sleep(0.2 * 2**attempt)
        return None

    # --- check-ins ----------------------------------------------------------------------------

    def _check_in(
        self,
        event: Started | Finished,
        info: ScheduleInfo | None,
        status: CheckInStatus,
        duration_s: float | None,
    ) -> None:
        if not self.check_ins or info is None:
            return
        check_in = CheckIn(
            schedule=event.schedule,
            run_key=event.run_key,
            attempt=event.attempt,
            status=status,
            check_in_id=check_in_id(event.schedule, event.run_key, event.attempt),
            duration_s=duration_s,
            kind=info.kind.value,
            expression=info.expression,
            time_zone=info.time_zone,
            max_runtime_ms=info.max_runtime_ms,
        )
        for sink in self.check_ins:
            for request in sink.requests(check_in):
                name = f"sdcore-check-in:{sink.name}"
                self._spawn(self._send_check_in(sink, request), name, sending=True)

    async def _send_check_in(self, sink: CheckInSink, request: Any) -> None:
        client, slots = self._client, self._check_in_slots
        if client is None or slots is None:
            return
        async with slots:
            for attempt in range(3):
                try:
                    await send(client, request, sink.timeout_s)
                    return
                except Exception as exc:  # noqa: BLE001 - logged; a check-in is best effort
                    if attempt == 2:
                        self._log.warning(
                            "check-in to %s failed: %s",
                            sink.name,
                            exc,
                            extra={"action": "check_in_failed", "sink": sink.name},
                        )
                        return
                    await asyncio.sleep(0.5 * 2**attempt)

    # --- the scan -----------------------------------------------------------------------------

    async def _scan_loop(self, every_s: float) -> None:
        while True:
            try:
                await self.scan()
            except Exception:  # noqa: BLE001 - the next round tries again
                self._log.exception("alerting scan failed", extra={"action": "alert_scan_failed"})
            await asyncio.sleep(every_s)

    async def scan(self, now: datetime | None = None) -> int:
        """Look for ticks nobody ran now (see :class:`~sdcore.alerting._scan.MissedScan`); it
        runs every ``scan_interval_ms`` by itself.

        Returns:
            The missed ticks found (each alerted once per incident, cluster-wide).
        """
        scheduler, jobs, scan = self._scheduler, self._jobs, self._scan
        if scheduler is None or jobs is None or scan is None:
            return 0
        found = await scan.missed(scheduler, jobs, datetime.now(UTC) if now is None else now)
        for problem in found:
            await self._decide(problem)
        return len(found)


def _problem(kind: AlertKind, event: Started | Finished, reason: str) -> Problem | None:
    """The problem ``event``'s attempt shows (``None`` for a tick without a run key)."""
    if event.run_key is None:
        return None
    return Problem(
        kind=kind,
        schedule=event.schedule,
        run_key=event.run_key,
        scheduled_at=event.scheduled_at,
        attempt=event.attempt,
        reason=reason,
    )
