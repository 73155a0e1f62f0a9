"""The instrumentation seam: what core code reports, and to whom.

Every instrumented component (the job scheduler, the scheduler's tick runner, the outbox and its
relay, the queue workers) holds a :class:`Telemetry` hub in its ``telemetry`` attribute, the
shared empty :data:`NOOP` unless a :class:`~sdcore.runtime.Runtime` (or the user) installs
observers (``sdcore.metrics``, ``sdcore.tracing``). A hook on the hot path is one method call
that loops over an empty tuple when nothing is installed: no label dict, no scope object, no
clock read. Observers must not raise; a hub isolates them anyway (an observer's error is logged
once per hook and never reaches the run it observes).

A tick run is reported as a :class:`RunScope`: :meth:`Telemetry.tick_scope` (``None`` when the
hub is empty) before an attempt, :meth:`Telemetry.tick_started` when the handler is about to
run (the lease is known then), :meth:`Telemetry.tick_finished` with the outcome. A scope that
never started (the tick ran elsewhere) finishes as a no-op.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

__all__ = [
    "FAILURE",
    "LOST_LEASE",
    "NOOP",
    "SKIPPED_OVERLAP",
    "SKIPPED_PAUSE",
    "SUCCESS",
    "TRACE_CONTEXT_OPTION",
    "BatchScope",
    "Observer",
    "RunScope",
    "Telemetry",
    "trace_json",
    "trace_option",
]

T = TypeVar("T")

# Tick outcomes (the ``outcome`` label of ``sdcore_schedule_runs_total``).
SUCCESS = "success"
FAILURE = "failure"
LOST_LEASE = "lost_lease"
SKIPPED_OVERLAP = "skipped_overlap"
SKIPPED_PAUSE = "skipped_pause"

# The BullMQ job option that carries the W3C trace context of the transaction that wrote the
# outbox row (``{"traceparent": …, "tracestate": …}``); BullMQ stores unknown options as given.
TRACE_CONTEXT_OPTION = "sdcoreTrace"

_log = logging.getLogger("sdcore.telemetry")


class RunScope:
    """One attempt of one tick, as observers see it.

    Attributes:
        schedule: The schedule's name.
        run_key: The tick's run key (``None`` for ``initial`` schedules).
        scheduled_at: The scheduled instant (UTC).
        attempt: The attempt number (1 for the first).
        fencing_token: The lease's fencing token (``None`` without a lease).
        started: ``time.perf_counter()`` when the handler started (``None``: it did not).
        lag_s: Scheduled instant → handler start, seconds.
        path: How the tick was started: ``fire`` (at its instant), ``catch_up`` or ``sweep``
            (a missed tick started late), ``trigger`` or ``backfill`` (an operator's).
        state: Per-observer state (a tracing observer keeps its span here).
    """

    __slots__ = (
        "attempt",
        "fencing_token",
        "lag_s",
        "path",
        "run_key",
        "schedule",
        "scheduled_at",
        "started",
        "state",
        "task",
        "thread",
    )

    def __init__(self, schedule: str) -> None:
        self.schedule = schedule
        self.run_key: str | None = None
        self.scheduled_at: datetime | None = None
        self.attempt = 0
        self.fencing_token: int | None = None
        self.started: float | None = None
        self.lag_s = 0.0
        self.path = "fire"
        self.state: dict[str, Any] = {}
        # Where the handler started: a context attached there can only be detached there.
        self.thread = 0
        self.task: asyncio.Task[Any] | None = None

    def same_context(self) -> bool:
        """Whether the caller runs where :meth:`Telemetry.tick_started` ran (thread and task)."""
        if threading.get_ident() != self.thread:
            return False
        try:
            return asyncio.current_task() is self.task
        except RuntimeError:  # no loop in this thread
            return self.task is None


class BatchScope:
    """One relay batch: the claimed messages and, once recorded, how many went out.

    Attributes:
        messages: The claimed outbox messages (``OutboxMessage``).
        started: ``time.perf_counter()`` at the claim's end.
        state: Per-observer state.
    """

    __slots__ = ("messages", "started", "state")

    def __init__(self, messages: Sequence[Any]) -> None:
        self.messages = messages
        self.started = time.perf_counter()
        self.state: dict[str, Any] = {}


class Observer:
    """Receives sdcore's events; subclass it and override what you need (all are no-ops)."""

    def tick_started(self, run: RunScope) -> None:
        """A tick's handler is about to run (``run.lag_s`` is set)."""

    def tick_finished(self, run: RunScope, outcome: str, duration_s: float) -> None:
        """A started tick attempt ended: ``success``, ``failure`` or ``lost_lease``."""

    def tick_skipped(self, schedule: str, outcome: str) -> None:
        """A tick was skipped on purpose: ``skipped_overlap`` or ``skipped_pause``."""

    def lease_acquired(self, job: str) -> None:
        """A ``run_exclusive`` / tick lease was won and its work starts (one lease held more)."""

    def lease_released(self, job: str, lost: bool) -> None:
        """That work ended (one lease held less); ``lost``: ownership was lost."""

    def heartbeat_failed(self, job: str) -> None:
        """A heartbeat could not confirm a lease (error or no answer; it is retried)."""

    def relay_batch_started(self, batch: BatchScope) -> None:
        """The relay claimed a batch and is about to publish it."""

    def relay_batch_finished(
        self, batch: BatchScope, results: Sequence[BaseException | None]
    ) -> None:
        """The batch's outcomes are recorded (``None`` per published message)."""

    def relay_error(self, reason: str) -> None:
        """A relay round failed: ``broker_unavailable``, ``database_unavailable`` or ``error``."""

    def relay_round(self) -> None:
        """A relay round completed (whether or not it found rows)."""

    def job_started(self, queue: str, job: Any) -> Any:
        """A queue processor starts ``job``; the return value is given to :meth:`job_finished`."""
        return None

    def job_finished(
        self, queue: str, job: Any, token: Any, error: BaseException | None, duration_s: float
    ) -> None:
        """``job`` ended (``error`` is ``None`` when it completed)."""

    def trace_context(self) -> Mapping[str, str] | None:
        """The current trace context to store with an outbox row (W3C keys), or ``None``."""
        return None


class Telemetry:
    """A hub of observers; components call its hooks.

    Args:
        observers: The observers, called in order.
    """

    __slots__ = ("_observers", "_warned")

    def __init__(self, observers: Sequence[Observer] = ()) -> None:
        self._observers: tuple[Observer, ...] = tuple(observers)
        self._warned: set[str] = set()

    @property
    def enabled(self) -> bool:
        """Whether any observer is installed."""
        return bool(self._observers)

    @property
    def observers(self) -> tuple[Observer, ...]:
        """The installed observers."""
        return self._observers

    def add(self, observer: Observer) -> None:
        """Install ``observer`` (after the others)."""
        if self is NOOP:
            raise RuntimeError("NOOP is shared: build a Telemetry() of your own")
        if not isinstance(observer, Observer):
            raise TypeError(f"observer must be a sdcore Observer, got {type(observer).__name__}")
        self._observers = (*self._observers, observer)

    def _failed(self, hook: str, observer: Observer) -> None:
        if hook not in self._warned:
            self._warned.add(hook)
            _log.exception(
                "telemetry observer %s failed in %s (further failures there are not logged)",
                type(observer).__name__,
                hook,
                extra={"action": "telemetry_failed"},
            )

    def _each(self, hook: str, *args: Any) -> None:
        for observer in self._observers:
            try:
                getattr(observer, hook)(*args)
            except Exception:  # noqa: BLE001 - an observer never breaks what it observes
                self._failed(hook, observer)

    # --- ticks ---------------------------------------------------------------------------

    def tick_scope(self, schedule: str) -> RunScope | None:
        """A scope for one attempt of a tick of ``schedule``, or ``None`` when disabled."""
        return RunScope(schedule) if self._observers else None

    def tick_started(self, run: RunScope | None, tick: Any) -> None:
        """The handler of ``tick`` (a ``sdcore.scheduling.Tick``) is about to run."""
        if run is None:
            return
        run.started = time.perf_counter()
        run.run_key = tick.run_key
        run.scheduled_at = tick.scheduled_at
        run.attempt = tick.attempt
        lease = tick.lease
        run.fencing_token = None if lease is None else lease.fencing_token
        run.lag_s = max(0.0, time.time() - tick.scheduled_at.timestamp())
        run.thread = threading.get_ident()
        try:
            run.task = asyncio.current_task()
        except RuntimeError:
            run.task = None
        self._each("tick_started", run)

    def tick_finished(self, run: RunScope | None, outcome: str) -> None:
        """The attempt ended with ``outcome``; a no-op if its handler never started."""
        if run is None or run.started is None:
            return
        duration = time.perf_counter() - run.started
        self._each("tick_finished", run, outcome, duration)
        run.started = None

    def tick_skipped(self, schedule: str, outcome: str) -> None:
        """A tick of ``schedule`` was skipped on purpose."""
        self._each("tick_skipped", schedule, outcome)

    # --- leases --------------------------------------------------------------------------

    def lease_acquired(self, job: str) -> None:
        """A lease of ``job`` was won and its work starts."""
        self._each("lease_acquired", job)

    def lease_released(self, job: str, lost: bool) -> None:
        """The work of a lease of ``job`` ended; ``lost``: ownership was lost."""
        self._each("lease_released", job, lost)

    def heartbeat_failed(self, job: str) -> None:
        """A heartbeat of ``job`` failed."""
        self._each("heartbeat_failed", job)

    # --- outbox and relay ----------------------------------------------------------------

    def relay_batch_started(self, messages: Sequence[Any]) -> BatchScope | None:
        """The relay claimed ``messages``; ``None`` when disabled."""
        if not self._observers:
            return None
        batch = BatchScope(messages)
        self._each("relay_batch_started", batch)
        return batch

    def relay_batch_finished(
        self, batch: BatchScope | None, results: Sequence[BaseException | None]
    ) -> None:
        """The batch's outcomes are recorded."""
        if batch is not None:
            self._each("relay_batch_finished", batch, results)

    def relay_error(self, reason: str) -> None:
        """A relay round failed for ``reason``."""
        self._each("relay_error", reason)

    def relay_round(self) -> None:
        """A relay round completed."""
        self._each("relay_round")

    def trace_context(self) -> Mapping[str, str] | None:
        """The trace context to write with an outbox row, or ``None`` (no tracing, no span)."""
        for observer in self._observers:
            try:
                carrier = observer.trace_context()
            except Exception:  # noqa: BLE001
                self._failed("trace_context", observer)
                continue
            if carrier:
                return carrier
        return None

    # --- queue processors ----------------------------------------------------------------

    async def process(self, queue: str, job: Any, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``fn(job)`` as the processing of ``job`` from ``queue``, reported to observers."""
        observers = self._observers
        if not observers:
            return await fn(job)
        tokens: list[Any] = []
        for observer in observers:
            try:
                tokens.append(observer.job_started(queue, job))
            except Exception:  # noqa: BLE001
                self._failed("job_started", observer)
                tokens.append(None)
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            return await fn(job)
        except BaseException as exc:
            error = exc
            raise
        finally:
            duration = time.perf_counter() - started
            for observer, token in zip(observers, tokens, strict=True):
                try:
                    observer.job_finished(queue, job, token, error, duration)
                except Exception:  # noqa: BLE001
                    self._failed("job_finished", observer)


def trace_json(hub: Telemetry) -> str | None:
    """The trace context of the current span as JSON text for the outbox row, or ``None``."""
    if not hub._observers:
        return None
    carrier = hub.trace_context()
    return None if not carrier else json.dumps(dict(carrier), separators=(",", ":"))


def trace_option(message: Any) -> dict[str, Any]:
    """The BullMQ job option carrying an outbox message's trace context (empty without one)."""
    carrier = getattr(message, "trace_context", None)
    return {TRACE_CONTEXT_OPTION: carrier} if carrier else {}


NOOP = Telemetry()
"""The empty hub every component starts with (shared; :meth:`Telemetry.add` refuses it)."""
