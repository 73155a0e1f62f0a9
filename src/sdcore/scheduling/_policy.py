"""Per-schedule policies (overlap, catch-up, retries, timing) and their validation at registration.

Everything numeric is range-checked here, so that nothing a schedule was registered with can fail
later in ``start_all()`` or in the timer loop (an ``OverflowError`` from a huge interval, say).
"""

from __future__ import annotations

import contextvars
import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypedDict

from sdcore._internal.validation import boolean, int_between
from sdcore.job_scheduler import (
    DEFAULT_HEARTBEAT_MS,
    AttemptBudget,
    InvalidJobIdentityOptionsError,
    JobAcquireOptions,
)
from sdcore.job_scheduler._attempts import MAX_BACKOFF_MS
from sdcore.job_scheduler._options import js_trim, resolve_timing
from sdcore.scheduling._cron import InvalidScheduleError, SchedulingError
from sdcore.scheduling._triggers import ScheduleKind

# Node's timers hold at most 2**31 - 1 ms (24.8 days); NestJS's setInterval/setTimeout silently
# turn a longer delay into 1 ms. sdcore refuses such periods instead.
MAX_PERIOD_MS = 2**31 - 1
MAX_WINDOW_MS = 31 * 24 * 3_600_000
MAX_RETRIES = 100
MAX_NAME_LENGTH = 64
DEFAULT_WINDOW_MS = 3_600_000

KNOWN_OPTIONS = frozenset(
    {
        "exclusive",
        "overlap",
        "catch_up",
        "catch_up_window_ms",
        "retries",
        "retry_backoff_ms",
        "jitter_ms",
        "lease_ms",
        "heartbeat_ms",
        "max_runtime_ms",
    }
)


class Overlap(enum.StrEnum):
    """May a tick start while this schedule's previous run is still running?

    ``SKIP``: not on this process (NestJS ``waitForCompletion``); ``ALLOW``: yes;
    ``SKIP_CLUSTER``: not anywhere in the cluster (costs a guard lease per tick).
    """

    SKIP = "skip"
    ALLOW = "allow"
    SKIP_CLUSTER = "skip_cluster"


class CatchUp(enum.StrEnum):
    """What to do about ticks that did not run (see the scheduling docs)."""

    OFF = "off"
    LATEST = "latest"
    ALL = "all"


class StartPath(enum.StrEnum):
    """How a tick was started (every path goes through the same policy checks)."""

    FIRE = "fire"
    CATCH_UP = "catch_up"
    SWEEP = "sweep"
    TRIGGER = "trigger"
    BACKFILL = "backfill"


# How the running tick started; set by TickStarter.launch for the tick's task only.
_PATH: contextvars.ContextVar[StartPath] = contextvars.ContextVar(
    "sdcore_tick_path", default=StartPath.FIRE
)


def current_path() -> StartPath:
    """How the tick running in this task (or its worker thread) was started."""
    return _PATH.get()


@functools.lru_cache(maxsize=256)
def _shared_budget(max_attempts: int, backoff_ms: int) -> AttemptBudget:
    return AttemptBudget(max_attempts=max_attempts, backoff_ms=backoff_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPolicy:
    """Per-schedule execution options (validated by :func:`build_policy`)."""

    exclusive: bool
    overlap: Overlap
    catch_up: CatchUp
    catch_up_window_ms: int
    retries: int
    retry_backoff_ms: int
    jitter_ms: int
    lease_ms: int
    heartbeat_ms: int
    max_runtime_ms: int | None = None
    # The tick's attempt budget (one object per policy: a burst asks for it once per tick; equal
    # budgets are one object, so 10,000 schedules add no object per schedule).
    _budget: AttemptBudget | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def budget(self) -> AttemptBudget:
        """The tick's attempt budget across the cluster: ``retries + 1`` runs."""
        budget = self._budget
        if budget is None:
            budget = _shared_budget(self.retries + 1, self.retry_backoff_ms)
            object.__setattr__(self, "_budget", budget)
        return budget

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (doubling, capped)."""
        return float(min(self.retry_backoff_ms * 2 ** max(attempt - 1, 0), MAX_BACKOFF_MS)) / 1000


class ScheduleOptions(TypedDict, total=False):
    """Per-schedule options (all optional; see the scheduling docs).

    Attributes:
        exclusive: Run each tick on one replica only (default: ``True`` when the scheduler has
            ``jobs``).
        overlap: ``"skip"`` (default), ``"allow"`` or ``"skip_cluster"``.
        catch_up: ``"off"`` (default), ``"latest"`` or ``"all"`` missed ticks.
        catch_up_window_ms: How far back catch-up looks (default 1 hour, at most 31 days).
        retries: Further runs of a failed tick across the cluster, never past the next tick
            (default 0, at most 100).
        retry_backoff_ms: Wait before the first retry, doubled each time (default 1,000).
        jitter_ms: Random delay of the fire moment; the run key is unchanged (default 0).
        lease_ms: Lease of each tick (default: the scheduler's).
        heartbeat_ms: Heartbeat interval (default ``min(60 s, lease_ms // 3)``).
        max_runtime_ms: A run longer than this raises an ``overrun`` alert
            (:mod:`sdcore.alerting`); the run goes on (default ``None``: no limit).
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
    max_runtime_ms: int | None


class ScheduleNotFoundError(SchedulingError, KeyError):
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
    expression: str = ""
    """The cron expression, or the interval in ms as text (empty for other kinds)."""
    retries: int = 0
    max_runtime_ms: int | None = None


def check_ms(
    schedule: str | None, option: str, value: object, *, minimum: int, maximum: int = 2**53 - 1
) -> int:
    """Validate an integer option (milliseconds or a count) and return it.

    Raises:
        InvalidScheduleError: Not an int, or outside ``[minimum, maximum]``.
    """
    return int_between(
        option, value, minimum, maximum, error=lambda r: InvalidScheduleError(schedule, r.message)
    )


def check_name(name: object) -> str:
    """Validate a schedule name with the lease's identity rules (it is the job code).

    Raises:
        InvalidScheduleError: Not a str, not trimmed (JavaScript ``trim()``), empty, too long, a
            NUL, or not valid Unicode (a lone surrogate).
    """
    if not isinstance(name, str) or not js_trim(name) or name != js_trim(name):
        raise InvalidScheduleError(
            None, f"schedule name must be a non-empty trimmed str, got {name!r:.80}"
        )
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidScheduleError(name, f"name must hold at most {MAX_NAME_LENGTH} characters")
    try:
        JobAcquireOptions(code=name, run_key="-")
    except InvalidJobIdentityOptionsError as exc:
        shown = name.encode("utf-8", "backslashreplace").decode()
        raise InvalidScheduleError(shown, str(exc)) from None
    return name


@functools.lru_cache(maxsize=1024)
def _shared_policy(policy: RunPolicy) -> RunPolicy:
    """Equal policies are one object (10,000 schedules with the same options hold one): the
    cache answers an equal policy with the first one it kept, as ``_shared_budget`` does."""
    return policy


def build_policy(
    name: str, options: Mapping[str, Any], *, has_jobs: bool, default_lease_ms: int
) -> RunPolicy:
    """Validate a schedule's options and return its policy.

    Raises:
        InvalidScheduleError: An unknown option or a value out of range.
    """
    unknown = sorted(set(options) - KNOWN_OPTIONS)
    if unknown:
        raise InvalidScheduleError(name, f"unknown option(s): {', '.join(unknown)}")
    exclusive = options.get("exclusive", has_jobs)
    boolean("exclusive", exclusive, error=lambda r: InvalidScheduleError(name, r.message))
    if exclusive and not has_jobs:
        raise InvalidScheduleError(name, "exclusive=True needs a job scheduler (jobs=...)")
    try:
        overlap = Overlap(options.get("overlap", Overlap.SKIP))
        catch_up = CatchUp(options.get("catch_up", CatchUp.OFF))
    except ValueError as exc:
        raise InvalidScheduleError(name, str(exc)) from None
    lease = options.get("lease_ms", default_lease_ms)
    heartbeat = options.get(
        "heartbeat_ms",
        min(DEFAULT_HEARTBEAT_MS, check_ms(name, "lease_ms", lease, minimum=3) // 3),
    )
    try:
        lease, heartbeat = resolve_timing(lease, heartbeat)
    except ValueError as exc:
        raise InvalidScheduleError(name, str(exc)) from None
    if catch_up is not CatchUp.OFF and not exclusive:
        raise InvalidScheduleError(
            name, "catch_up needs an exclusive schedule (missed ticks are read from the lease)"
        )
    return _shared_policy(
        RunPolicy(
            exclusive=exclusive,
            overlap=overlap,
            catch_up=catch_up,
            catch_up_window_ms=check_ms(
                name,
                "catch_up_window_ms",
                options.get("catch_up_window_ms", DEFAULT_WINDOW_MS),
                minimum=1,
                maximum=MAX_WINDOW_MS,
            ),
            retries=check_ms(
                name, "retries", options.get("retries", 0), minimum=0, maximum=MAX_RETRIES
            ),
            retry_backoff_ms=check_ms(
                name,
                "retry_backoff_ms",
                options.get("retry_backoff_ms", 1_000),
                minimum=1,
                maximum=MAX_BACKOFF_MS,
            ),
            jitter_ms=check_ms(
                name, "jitter_ms", options.get("jitter_ms", 0), minimum=0, maximum=MAX_PERIOD_MS
            ),
            lease_ms=lease,
            heartbeat_ms=heartbeat,
            max_runtime_ms=check_max_runtime(name, options.get("max_runtime_ms")),
        )
    )


def check_max_runtime(name: str, value: object) -> int | None:
    """Validate ``max_runtime_ms``: ``None``, or a positive int of at most :data:`MAX_PERIOD_MS`.

    Raises:
        InvalidScheduleError: Naming the schedule and the option.
    """
    if value is None:
        return None
    return check_ms(name, "max_runtime_ms", value, minimum=1, maximum=MAX_PERIOD_MS)
