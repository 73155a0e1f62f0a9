"""The one place that imports the untyped ``bullmq`` package, and a typed view of its jobs."""

from __future__ import annotations

from typing import Any, Protocol

from bullmq import Queue, UnrecoverableError, Worker  # type: ignore[import-untyped]

__all__ = ["Job", "Queue", "UnrecoverableError", "Worker"]


class Job(Protocol):
    """What a processor can rely on in the ``bullmq.Job`` it receives (a structural view).

    ``attemptsMade`` counts finished attempts: it is ``0`` while the first attempt runs, and
    already includes the failed attempt when ``on_failed`` is called. ``opts`` holds the job
    options as added, e.g. ``attempts`` and ``backoff``.
    """

    id: str
    name: str
    data: Any
    opts: dict[str, Any]
    attemptsMade: int
    attemptsStarted: int
    timestamp: int
    processedOn: int
    finishedOn: int
    failedReason: str | None
    returnvalue: Any

    async def updateProgress(self, progress: Any) -> None:
        """Store the job's progress (a number or a JSON object)."""

    async def log(self, logRow: str) -> int:
        """Append a line to the job's log; return the number of lines."""
