"""``AlertObserver``: the telemetry hooks that feed :class:`~sdcore.alerting.Alerting`.

A hook only copies what it needs from the :class:`RunScope` into an event and hands it to the
alerting loop (thread-safely: a plain handler's start is reported from its worker thread). No
I/O happens in a hook, so a tick never waits on an alert.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sdcore._internal.telemetry import Observer, RunScope

__all__ = ["AlertObserver", "Finished", "Overran", "Started"]

# The paths by which a tick starts late because it was missed: start-up catch-up and the sweep
# (a tick that never started, or whose replica died mid-run and whose lease expired).
LATE_PATHS = frozenset({"catch_up", "sweep"})
_STATE = "sdcore.alerting"


@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """An attempt's handler started here."""

    token: int
    schedule: str
    run_key: str | None
    scheduled_at: datetime | None
    attempt: int
    path: str
    at: float  # time.monotonic()


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """An attempt ended here: ``success``, ``failure`` or ``lost_lease``."""

    token: int
    schedule: str
    run_key: str | None
    scheduled_at: datetime | None
    attempt: int
    outcome: str
    duration_s: float
    cancelled: bool  # ended by a cancellation (shutdown), not by its handler


@dataclass(frozen=True, slots=True, kw_only=True)
class Overran:
    """An attempt started here is still running past its schedule's ``max_runtime_ms``."""

    started: Started
    limit_ms: int


class AlertObserver(Observer):
    """Reports tick starts and ends to ``post`` (which must accept calls from any thread)."""

    def __init__(self, post: Callable[[Started | Finished], None]) -> None:
        self._post = post
        self._tokens = itertools.count(1)

    def tick_started(self, run: RunScope) -> None:
        token = next(self._tokens)
        run.state[_STATE] = token
        self._post(
            Started(
                token=token,
                schedule=run.schedule,
                run_key=run.run_key,
                scheduled_at=run.scheduled_at,
                attempt=run.attempt,
                path=str(run.path),
                at=time.monotonic(),
            )
        )

    def tick_finished(self, run: RunScope, outcome: str, duration_s: float) -> None:
        token = run.state.get(_STATE)
        if not isinstance(token, int):
            return  # started before this observer was installed
        self._post(
            Finished(
                token=token,
                schedule=run.schedule,
                run_key=run.run_key,
                scheduled_at=run.scheduled_at,
                attempt=run.attempt,
                outcome=outcome,
                duration_s=duration_s,
                cancelled=_cancelling(),
            )
        )


def _cancelling() -> bool:
    """Whether the current task is being cancelled (a shutdown ends the run, not its handler)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return False
    return task is not None and task.cancelling() > 0
