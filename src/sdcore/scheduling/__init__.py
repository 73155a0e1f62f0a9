"""Cluster-safe scheduling: cron, interval, timeout and initial schedules on top of the lease.

Every replica fires every tick; with a job scheduler exactly one replica runs it, because the
tick's identity (schedule name + the *scheduled* UTC instant) is the same everywhere.
Needs the ``sdcore[scheduling]`` extra (cronsim, tzdata).
"""

try:
    import cronsim  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("sdcore.scheduling needs cronsim: pip install 'sdcore[scheduling]'") from exc

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
from sdcore.scheduling._memory_store import InMemoryScheduleStore
from sdcore.scheduling._pg_store import PostgresScheduleStore
from sdcore.scheduling._plane import ScheduleControl
from sdcore.scheduling._policy import (
    CatchUp,
    Overlap,
    ScheduleInfo,
    ScheduleNotFoundError,
    ScheduleOptions,
)
from sdcore.scheduling._runner import TickOutcome
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
    "InMemoryScheduleStore",
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
    "TickOutcome",
    "format_run_key",
]
