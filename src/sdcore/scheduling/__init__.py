"""Cluster-safe scheduling: cron, interval, timeout and initial schedules on top of the lease.

Every replica fires every tick; with a job scheduler exactly one replica runs it, because the
tick's identity (schedule name + the *scheduled* UTC instant) is the same everywhere.
Needs the ``sdcore[scheduling]`` extra (cronsim, tzdata).
"""

try:
    import cronsim  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("sdcore.scheduling needs cronsim: pip install 'sdcore[scheduling]'") from exc

import warnings
from typing import TYPE_CHECKING, Any

from sdcore.scheduling._admin import ScheduleAdmin
from sdcore.scheduling._catch_up import MissedTick
from sdcore.scheduling._control import (
    ActionKind,
    ControlAction,
    ControlWriteUncertainError,
    LiveVersion,
    RunRecord,
    ScheduleControlError,
    ScheduleState,
    ScheduleStore,
)
from sdcore.scheduling._cron import DayRule, InvalidScheduleError, SchedulingError
from sdcore.scheduling._expressions import CronExpression
from sdcore.scheduling._pg_store import PostgresScheduleStore
from sdcore.scheduling._plane import ScheduleControl
from sdcore.scheduling._policy import (
    CatchUp,
    Overlap,
    ScheduleInfo,
    ScheduleNotFoundError,
    ScheduleOptions,
)
from sdcore.scheduling._scheduler import Scheduler
from sdcore.scheduling._settings import ControlSettings, SchedulingSettings
from sdcore.scheduling._triggers import ScheduleKind, Tick, format_run_key

__all__ = [
    "ActionKind",
    "CatchUp",
    "ControlAction",
    "ControlSettings",
    "ControlWriteUncertainError",
    "CronExpression",
    "DayRule",
    "InvalidScheduleError",
    "LiveVersion",
    "MissedTick",
    "Overlap",
    "PostgresScheduleStore",
    "RunRecord",
    "ScheduleAdmin",
    "ScheduleControl",
    "ScheduleControlError",
    "ScheduleInfo",
    "ScheduleKind",
    "ScheduleNotFoundError",
    "ScheduleOptions",
    "ScheduleState",
    "ScheduleStore",
    "Scheduler",
    "SchedulingError",
    "SchedulingSettings",
    "Tick",
    "format_run_key",
]

if not TYPE_CHECKING:  # type checkers keep reporting unknown names (and these) as errors

    def __getattr__(name: str) -> Any:
        """Resolve the names that left this module, with a DeprecationWarning, for one release."""
        if name == "TickOutcome":
            warnings.warn(
                "sdcore.scheduling.TickOutcome is deprecated and goes away in the next release: "
                "private now: no public API returns it",
                DeprecationWarning,
                stacklevel=2,
            )
            from sdcore.scheduling._runner import TickOutcome

            return TickOutcome
        if name == "InMemoryScheduleStore":
            warnings.warn(
                "sdcore.scheduling.InMemoryScheduleStore is deprecated; "
                "use sdcore.testing.MemoryScheduleStore",
                DeprecationWarning,
                stacklevel=2,
            )
            from sdcore.scheduling._memory_store import MemoryScheduleStore

            return MemoryScheduleStore
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
