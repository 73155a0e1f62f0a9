"""``SchedulingSettings`` and ``ControlSettings``: a Runtime's scheduler and control plane."""

from __future__ import annotations

from dataclasses import dataclass

from sdcore._internal.validation import boolean, int_between, text
from sdcore.scheduling._cron import InvalidScheduleError, load_zone

__all__ = ["ControlSettings", "SchedulingSettings"]

_MAX_MS = 2**53 - 1  # the Scheduler's bound on a lease


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulingSettings:
    """The scheduler a :class:`~sdcore.Runtime` runs: the schedules declared on it fire here.

    ``Runtime(scheduling=None)`` declares schedules but runs none of them (an API-only
    replica); ``runtime.scheduler`` still exists, so that module-level decorators work.

    Attributes:
        time_zone: Default IANA zone of cron schedules.
        lease_ms: Default lease of a schedule that names none (the Scheduler's ``lease_ms``).

    Raises:
        ValueError: An unknown zone or a value out of range (naming the field and the value).
        TypeError: A value of the wrong type (the same).
    """

    time_zone: str = "UTC"
    lease_ms: int = 300_000

    def __post_init__(self) -> None:
        text("time_zone", self.time_zone)
        try:
            load_zone(self.time_zone)
        except InvalidScheduleError:
            raise ValueError(
                f"time_zone must be an IANA zone name, got {self.time_zone!r:.40}"
            ) from None
        int_between("lease_ms", self.lease_ms, 3, _MAX_MS)


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlSettings:
    """The schedules control plane a :class:`~sdcore.Runtime` runs beside its scheduler.

    Pause, resume, trigger, backfill and stored schedules reach this replica through it, and
    its schedules and their runs are recorded in the database (``sdcore schedules …``, the
    dashboard). ``Runtime(control=None)``: the schedules run as declared and nothing else
    reaches them. It runs only with the scheduler (``scheduling`` not ``None``).

    Attributes:
        listen: Changes arrive by LISTEN/NOTIFY and by polling; ``False`` polls only
            (implied by ``PoolSettings(transaction_pooling=True)``, which also keeps every
            statement unprepared).
        poll_interval_ms: How often the control plane polls for changes.
        heartbeat_ms: How often this replica records that it is alive.

    Raises:
        ValueError: A value out of range (naming the field and the value).
        TypeError: A value of the wrong type (the same).
    """

    listen: bool = True
    poll_interval_ms: int = 1_000
    heartbeat_ms: int = 5_000

    def __post_init__(self) -> None:
        boolean("listen", self.listen)
        int_between("poll_interval_ms", self.poll_interval_ms, 10, 3_600_000)
        int_between("heartbeat_ms", self.heartbeat_ms, 10, 3_600_000)
