"""``Processor``: the consumer of one BullMQ queue (NestJS ``@Processor`` + ``WorkerHost``)."""

from __future__ import annotations

import inspect
import re
from typing import Any

from sdcore._internal.validation import int_between
from sdcore.queues._bullmq import Job, UnrecoverableError
from sdcore.queues._errors import InvalidProcessorError

_QUEUE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")


class Processor:
    """Subclass it, set ``queue``, implement :meth:`process`; run it with :class:`Workers`.

    ```python
    class NotificationsProcessor(Processor):
        queue = "notifications"
        concurrency = 5

        async def process(self, job: Job) -> Any:
            await send_email(job.data["recipientId"], job.data["taskId"])
    ```

    Raising in :meth:`process` fails the attempt: BullMQ retries the job according to its own
    ``attempts`` and ``backoff`` options (set when it was added; exponential: ``2^(n−1) ×
    delay``). Raise ``UnrecoverableError`` to fail at once without further attempts. BullMQ
    delivers at least once (a worker killed mid-job leaves the job to be run again after its lock
    expires), so :meth:`process` must be idempotent.

    Attributes:
        queue: The queue name (``[A-Za-z0-9_.-]``, 1–100 characters).
        concurrency: Jobs processed at once by this processor (1–1000).
        lock_duration_ms: How long a job's lock lasts without renewal (renewed every half);
            a job whose worker stops renewing is treated as stalled and run again.
    """

    queue: str
    concurrency: int = 1
    lock_duration_ms: int = 30_000

    async def process(self, job: Job) -> Any:
        """Handle one job; the return value is stored as the job's ``returnvalue``.

        Raises:
            Exception: Any error fails this attempt (retried while attempts remain).
        """
        raise NotImplementedError(f"{type(self).__name__}.process is not implemented")

    async def on_completed(self, job: Job, result: Any) -> None:
        """Called after a job completed (like ``@OnWorkerEvent('completed')``).

        Runs in the background, after BullMQ stored the result; an error here is logged and
        changes nothing about the job.
        """

    async def on_failed(self, job: Job, error: BaseException, final: bool) -> None:
        """Called after every failed attempt (like ``@OnWorkerEvent('failed')``).

        The final failure is also logged by :class:`Workers` (``action="job_failed_final"``)
        whether or not this is overridden. An error here is logged and changes nothing.

        Args:
            job: The job; ``job.attemptsMade`` already counts this attempt.
            error: What :meth:`process` raised.
            final: ``True`` when no attempt remains (the job is now in the failed set).
        """


def is_final_attempt(job: Job, error: BaseException | None = None) -> bool:
    """Tell whether a failed attempt was the last one (call it from a ``failed`` listener).

    ``job.attemptsMade >= job.opts["attempts"]`` (a job without ``attempts`` has one), or the
    error was an ``UnrecoverableError``.
    """
    if error is not None and isinstance(error, UnrecoverableError):
        return True
    opts = job.opts or {}
    attempts = opts.get("attempts") or 1
    try:
        allowed = max(int(attempts), 1)
    except (TypeError, ValueError):
        allowed = 1
    return int(job.attemptsMade or 0) >= allowed


def check_processor(processor: object) -> Processor:
    """Validate a processor before any worker starts.

    Raises:
        InvalidProcessorError: Not a :class:`Processor`, a bad queue, concurrency or lock
            duration, or a hook that is not ``async def``.
    """
    name = type(processor).__name__
    if not isinstance(processor, Processor):
        raise InvalidProcessorError(name, "must be an instance of sdcore.queues.Processor")
    queue = getattr(processor, "queue", None)
    if not isinstance(queue, str) or not _QUEUE_NAME.fullmatch(queue):
        raise InvalidProcessorError(
            name, "queue must be 1-100 characters from [A-Za-z0-9_.-] (':' separates BullMQ keys)"
        )
    for attr, low, high in (("concurrency", 1, 1000), ("lock_duration_ms", 1000, 24 * 3600_000)):
        value = getattr(processor, attr)
        int_between(attr, value, low, high, error=lambda r: InvalidProcessorError(name, r.message))
    for hook in ("process", "on_completed", "on_failed"):
        if not inspect.iscoroutinefunction(getattr(processor, hook)):
            raise InvalidProcessorError(name, f"{hook} must be an async def")
    if type(processor).process is Processor.process:
        raise InvalidProcessorError(name, "process is not implemented")
    return processor
