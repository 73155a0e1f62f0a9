"""Public fakes for users' own unit tests: the in-memory twins of the PostgreSQL backends, a
recording publisher and a controllable clock.

Each ``Memory…`` double sits next to its PostgreSQL twin and is held to the same contract suite:
:class:`MemoryJobScheduler` (``JobSchedulerService``), :class:`MemoryOutboxStore`
(``PostgresOutboxStore``) and :class:`MemoryScheduleStore` (``PostgresScheduleStore``; it needs
the ``sdcore[scheduling]`` extra and is imported on first use).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sdcore.job_scheduler._memory import MemoryJobScheduler
from sdcore.outbox._memory_store import MemoryOutboxRow, MemoryOutboxStore

if TYPE_CHECKING:
    from sdcore.scheduling._memory_store import MemoryScheduleStore

__all__ = [
    "FakeClock",
    "MemoryJobScheduler",
    "MemoryOutboxRow",
    "MemoryOutboxStore",
    "MemoryScheduleStore",
    "RecordingPublisher",
]

# Names of earlier releases, kept for one release: each warns and names its replacement.
_RENAMED = {
    "InMemoryJobScheduler": "MemoryJobScheduler",
    "InMemoryScheduleStore": "MemoryScheduleStore",
}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"sdcore.testing.{name} is deprecated; use sdcore.testing.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new] if new in globals() else __getattr__(new)
    # The schedules double needs the scheduling extra (cronsim): imported on first use only.
    if name == "MemoryScheduleStore":
        from sdcore.scheduling._memory_store import MemoryScheduleStore

        return MemoryScheduleStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class FakeClock:
    """A wall clock that only moves when told to.

    Args:
        start: The initial instant (aware); defaults to 2026-01-01T00:00:00Z.
    """

    def __init__(self, start: datetime | None = None) -> None:
        start = start or datetime(2026, 1, 1, tzinfo=UTC)
        if start.tzinfo is None:
            raise ValueError("FakeClock needs an aware datetime")
        self._now = start.astimezone(UTC)

    def __call__(self) -> datetime:
        """Return the current instant (aware, UTC)."""
        return self._now

    def advance(self, *, ms: int = 0, seconds: float = 0) -> datetime:
        """Move the clock forward (or back, with negative values) and return the new instant."""
        self._now += timedelta(milliseconds=ms, seconds=seconds)
        return self._now

    def set(self, instant: datetime) -> None:
        """Jump to an aware instant."""
        if instant.tzinfo is None:
            raise ValueError("FakeClock needs an aware datetime")
        self._now = instant.astimezone(UTC)


class RecordingPublisher:
    """An outbox publisher for tests: keeps messages in memory, deduplicated by job id like BullMQ.

    Attributes:
        jobs: ``{(queue, job_id): message}`` of everything published (first publish wins).
        publishes: Every publish call's messages, duplicates included.
        unavailable: While ``True``, every publish raises ``PublisherUnavailableError``.
        fail: Job names whose messages fail (with ``ValueError``), as a poison message would.
    """

    def __init__(self) -> None:
        from sdcore.outbox import OutboxMessage

        self.jobs: dict[tuple[str, str], OutboxMessage] = {}
        self.publishes: list[OutboxMessage] = []
        self.unavailable = False
        self.fail: set[str] = set()

    async def publish(self, messages: Sequence[Any]) -> list[BaseException | None]:
        """Record ``messages``; see the class attributes for injected failures."""
        from sdcore.outbox import PublisherUnavailableError

        if self.unavailable:
            raise PublisherUnavailableError("injected: broker unavailable")
        results: list[BaseException | None] = []
        for message in messages:
            self.publishes.append(message)
            if message.name in self.fail:
                results.append(ValueError(f"injected: {message.name} is poison"))
                continue
            self.jobs.setdefault((message.queue, message.job_id), message)
            results.append(None)
        return results
