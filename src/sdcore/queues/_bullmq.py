"""The one place that imports the untyped ``bullmq`` package, and a typed view of its jobs."""

from __future__ import annotations

import copy
from typing import Any, Protocol

from bullmq import Queue, UnrecoverableError, Worker  # type: ignore[import-untyped]

__all__ = ["Job", "Queue", "UnrecoverableError", "Worker", "sibling_queue"]


def sibling_queue(template: Any, name: str) -> Any:
    """Return a bullmq ``Queue`` named ``name`` that shares ``template``'s Redis connection.

    ``Queue(name, opts)`` builds a ``RedisConnection`` of its own, which reads and registers
    every one of bullmq's Lua scripts again (about 280 KB per queue). The sibling shares the
    template's connection and its registered scripts through the backend's ``forQueue`` (what
    bullmq's flows use for a child's queue) and differs only in the per-queue fields that
    ``Queue.__init__`` sets from its backend. A bullmq without backends gets a plain ``Queue``.
    """
    backend = getattr(template, "backend", None)
    for_queue = getattr(backend, "forQueue", None)
    if for_queue is None:
        return Queue(name, template.opts)
    own = for_queue(name, template.prefix)
    queue = copy.copy(template)
    queue.name = name
    queue.backend = own
    queue.redisConnection = own.connection
    queue.client = own.conn
    queue.scripts = own.scripts
    queue.keys = own.keys
    queue.qualifiedName = own.qualifiedName
    queue._job_scheduler = None
    return queue


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
