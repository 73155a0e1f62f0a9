"""``Workers``: run processors as bullmq ``Worker``s, with the Python client's traps handled."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from redis import exceptions as redis_errors

from sdcore._internal.errors import error_text
from sdcore._internal.lifecycle import AsyncStartStop
from sdcore._internal.redact import redact_text
from sdcore._internal.redis_url import check_cluster_prefix
from sdcore._internal.supervisor import Supervisor
from sdcore._internal.telemetry import NOOP, Telemetry
from sdcore._internal.validation import at_least
from sdcore.queues._bullmq import Worker
from sdcore.queues._processor import Processor, check_processor, is_final_attempt
from sdcore.queues._publisher import DEFAULT_PREFIX, check_prefix
from sdcore.queues._redis import (
    RedisServerInfo,
    check_redis_server,
    is_cluster_url,
    queues_enabled,
    worker_connection,
)

# While bullmq's closes are pending, how often a lost cancellation of the idle wait is re-sent.
NUDGE_S = 0.5


@dataclass(slots=True)
class _Entry:
    processor: Processor
    worker: Any
    task: asyncio.Task[None] | None = None
    running: bool = False


class Workers(AsyncStartStop):
    """Run a list of :class:`Processor` s, one bullmq ``Worker`` each (NestJS ``WorkerHost``).

    ```python
    async with Workers([NotificationsProcessor()], redis_url=url):
        await stop_requested.wait()
    ```

    Start-up, per worker, before it takes a job: read the Redis version on the worker's blocking
    connection (without it the Python worker rounds every blocking wait up to whole seconds, so a
    200 ms backoff retries after ~1.1 s), and once per host check the eviction policy and
    persistence (warnings, see :func:`check_redis_server`). If Redis is down this waits in the
    background; :meth:`wait_ready` tells when every worker runs.

    Hooks run as background tasks held here (bullmq's emitter calls listeners synchronously and
    never awaits a coroutine), never raise into bullmq (a raising ``completed`` listener would
    make BullMQ fail the job with "Missing lock"), and are awaited on close. Every final failure
    is logged at ERROR with ``extra={"action": "job_failed_final", "queue", "job_id",
    "job_name", "attempts"}``; retried attempts at WARNING (``action="job_retry"``).

    Closing waits for running jobs (``grace_s=None``, the default, waits as long as they run);
    after ``grace_s`` they are cancelled and stay active in Redis until their lock expires, then
    BullMQ runs them again.

    Args:
        processors: One per queue.
        redis_url: ``redis://…`` (each worker opens two connections, ``decode_responses=True``),
            ``redis+sentinel://host:port[,host:port…]/service_name[/db]`` (each worker
            follows the master the sentinels name) or ``redis+cluster://host:port[,…]`` (each
            worker's commands go to the master of its queue's slot).
        prefix: BullMQ key prefix (must match the producers'). On Redis Cluster it must hold
            a hash tag (``{bull}``) so a queue's keys share one slot.
        stalled_interval_ms: How often each worker looks for jobs whose lock expired.
        max_stalled_count: Times a job may stall before it fails.
        check_server: Check the eviction policy and persistence at start.
        logger_name: Logger for job failures, hook errors and warnings.

    Raises:
        InvalidProcessorError: A processor is invalid.
        TypeError: A prefix or stall option of the wrong type.
        ValueError: Two processors for one queue, no processor, a bad URL, prefix or interval,
            or, on Redis Cluster, a prefix without a hash tag.
    """

    telemetry: Telemetry = NOOP  # observers of processed jobs (sdcore.metrics, sdcore.tracing)

    def __init__(
        self,
        processors: Sequence[Processor],
        *,
        redis_url: str,
        prefix: str = DEFAULT_PREFIX,
        stalled_interval_ms: int = 30_000,
        max_stalled_count: int = 1,
        check_server: bool = True,
        logger_name: str = "sdcore.queues",
    ) -> None:
        checked = [check_processor(p) for p in processors]
        if not checked:
            raise ValueError("Workers needs at least one processor")
        queues = [p.queue for p in checked]
        if len(set(queues)) != len(queues):
            raise ValueError(f"one processor per queue, got {sorted(queues)}")
        if not queues_enabled(redis_url):
            raise ValueError("redis_url is required (use queues_enabled() to make queues optional)")
        at_least("stalled_interval_ms", stalled_interval_ms, 100)
        at_least("max_stalled_count", max_stalled_count, 0)
        self._processors = checked
        self._url = redis_url.strip()
        self._prefix = check_prefix(prefix)
        if is_cluster_url(self._url):
            check_cluster_prefix(self._prefix)
        self._stalled_interval = stalled_interval_ms
        self._max_stalled = max_stalled_count
        self._check = check_server
        self._logger_name = logger_name
        self._log = logging.getLogger(logger_name)
        self._entries: list[_Entry] = []
        # Owns the workers' run loops and the hook tasks; a crash is logged, never lost.
        self._tasks = Supervisor("sdcore-queues", logger=self._log)
        self._ready = asyncio.Event()
        self._server: RedisServerInfo | None = None
        self._closing = False

    @property
    def server(self) -> RedisServerInfo | None:
        """What the start-up check read (``None`` until it ran)."""
        return self._server

    @property
    def ready(self) -> bool:
        """Whether every worker has started taking jobs."""
        return self._ready.is_set()

    async def wait_ready(self) -> None:
        """Wait until every worker takes jobs (Redis reachable, version read)."""
        await self._ready.wait()

    async def stop(self) -> None:
        """Same as :meth:`close` with no grace bound (what leaving ``async with`` calls)."""
        await self.close()

    async def start(self) -> None:
        """Create the workers and start them in the background (returns at once)."""
        if self._entries or self._closing:
            return
        await self._tasks.start()
        for processor in self._processors:
            entry = _Entry(processor, self._worker(processor))
            self._entries.append(entry)
        for index, entry in enumerate(self._entries):
            # Not restarted: a bullmq Worker whose run() raised is not known to run again.
            entry.task = self._tasks.spawn(
                f"worker-{entry.processor.queue}",
                functools.partial(self._run, entry, check=self._check and index == 0),
                restart=False,
            )

    def _worker(self, processor: Processor) -> Any:
        async def handler(job: Any, token: str) -> Any:
            # Two positional parameters: bullmq then passes no AbortSignal.
            return await self.telemetry.process(processor.queue, job, processor.process)

        worker = Worker(
            processor.queue,
            handler,
            {
                "connection": worker_connection(self._url),
                "prefix": self._prefix,
                "concurrency": processor.concurrency,
                "lockDuration": processor.lock_duration_ms,
                "stalledInterval": self._stalled_interval,
                "maxStalledCount": self._max_stalled,
                "name": type(processor).__name__,
                "autorun": False,
            },
        )
        worker.on("completed", lambda job, result: self._completed(processor, job, result))
        worker.on("failed", lambda job, error: self._failed(processor, job, error))
        worker.on("error", lambda error, job=None: self._error(processor, error, job))
        worker.on("stalled", lambda job_id, *_: self._stalled(processor, job_id))
        return worker

    async def _run(self, entry: _Entry, *, check: bool) -> None:
        worker = entry.worker
        delay = 0.5
        while True:
            try:
                if check and self._server is None:
                    self._server = await check_redis_server(
                        worker.client, logger_name=self._logger_name
                    )
                # The Python Worker never reads the version itself; until it does, its
                # capabilities say "no sub-second blocking timeouts" and waits are rounded up.
                await worker.blockingRedisConnection.getRedisVersion()
                break
            except (Warning, redis_errors.ResponseError) as exc:
                # bullmq warns about the eviction policy with warnings.warn (under "-W error"
                # that raises; our check has logged it), or INFO is denied by an ACL: run
                # anyway, and blocking waits may be rounded up to whole seconds.
                self._log.warning(
                    "could not read the Redis version for queue %r: %s",
                    entry.processor.queue,
                    exc,
                    extra={"action": "worker_version_unknown", "queue": entry.processor.queue},
                )
                break
            except Exception as exc:  # noqa: BLE001 - Redis down at start: wait, log, retry
                self._log.warning(
                    "worker for queue %r cannot start yet (%s); retrying in %.1f s",
                    entry.processor.queue,
                    redact_text(error_text(exc)[:300]),
                    delay,
                    extra={"action": "worker_waiting_for_redis", "queue": entry.processor.queue},
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        entry.running = True
        if all(e.running for e in self._entries):
            self._ready.set()
        await worker.run()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            self._tasks.spawn("hook", lambda: coro, restart=False)
        except RuntimeError:
            coro.close()  # closing: the event came after the hooks were awaited
            raise

    async def _hook(self, processor: Processor, hook: str, job: Any, *args: Any) -> None:
        try:
            await getattr(processor, hook)(job, *args)
        except Exception:  # noqa: BLE001 - a hook must never reach bullmq
            self._log.exception(
                "%s.%s failed for job %s",
                type(processor).__name__,
                hook,
                getattr(job, "id", None),
                extra={
                    "action": "hook_failed",
                    "queue": processor.queue,
                    "job_id": getattr(job, "id", None),
                },
            )

    def _completed(self, processor: Processor, job: Any, result: Any) -> None:
        try:
            self._spawn(self._hook(processor, "on_completed", job, result))
        except Exception:  # noqa: BLE001 - a listener must never raise into bullmq
            self._log.exception("completed listener failed", extra={"action": "hook_failed"})

    def _failed(self, processor: Processor, job: Any, error: BaseException) -> None:
        try:
            final = is_final_attempt(job, error)
            attempts = job.attemptsMade
            allowed = (job.opts or {}).get("attempts") or 1
            extra = {
                "queue": processor.queue,
                "job_id": job.id,
                "job_name": job.name,
                "attempts": attempts,
            }
            text = redact_text(error_text(error)[:500])
            if final:
                self._log.error(
                    "job %s (%r on queue %r) failed after %d attempt(s): %s",
                    job.id,
                    job.name,
                    processor.queue,
                    attempts,
                    text,
                    exc_info=error,
                    extra={"action": "job_failed_final", **extra},
                )
            else:
                self._log.warning(
                    "job %s (%r on queue %r) failed attempt %d of %d, BullMQ will retry: %s",
                    job.id,
                    job.name,
                    processor.queue,
                    attempts,
                    allowed,
                    text,
                    extra={"action": "job_retry", **extra},
                )
            self._spawn(self._hook(processor, "on_failed", job, error, final))
        except Exception:  # noqa: BLE001 - a listener must never raise into bullmq
            self._log.exception("failed listener failed", extra={"action": "hook_failed"})

    def _error(self, processor: Processor, error: BaseException, job: Any) -> None:
        with contextlib.suppress(Exception):  # a listener must never raise into bullmq
            self._log.warning(
                "worker for queue %r: %s",
                processor.queue,
                redact_text(error_text(error)[:500]),
                extra={
                    "action": "worker_error",
                    "queue": processor.queue,
                    "job_id": getattr(job, "id", None),
                },
            )

    def _stalled(self, processor: Processor, job_id: Any) -> None:
        with contextlib.suppress(Exception):  # a listener must never raise into bullmq
            self._log.warning(
                "job %s on queue %r stalled (its worker stopped renewing the lock); BullMQ runs"
                " it again",
                job_id,
                processor.queue,
                extra={"action": "job_stalled", "queue": processor.queue, "job_id": job_id},
            )

    async def _closing_wait(
        self, closes: list[asyncio.Future[Any]], limit_s: float | None
    ) -> set[asyncio.Future[Any]]:
        """Wait for bullmq's closes (at most ``limit_s``); return those still pending.

        A closing bullmq worker cancels its idle wait for the next job (``BZPOPMIN``) once, and
        its close then waits for that wait to end. That one cancellation can be lost (rarely,
        with Python 3.11, redis-py 8.1 and bullmq 3.4): the wait's task is marked *cancelling*
        yet goes on reading the reply inside redis-py's ``asyncio.timeout`` around the read, and
        the close hangs with it. So while the closes are pending, a wait for the next job that
        is still running is cancelled again.
        """
        loop = asyncio.get_running_loop()
        deadline = None if limit_s is None else loop.time() + limit_s
        pending = set(closes)
        while pending:
            step = NUDGE_S if deadline is None else min(NUDGE_S, deadline - loop.time())
            if step <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=step)
            for entry in self._entries:
                waiting = entry.worker.waiting
                if pending and waiting is not None and not waiting.done():
                    waiting.cancel()
        return pending

    async def _past_startup(self, limit_s: float = 5.0) -> None:
        # Worker.run() first names its connections (CLIENT SETNAME) and only then sets
        # ``running``. Closed inside that window, bullmq closes the blocking connection while
        # the command is in flight and the command reopens it: a leaked socket. So wait.
        deadline = asyncio.get_running_loop().time() + limit_s
        for entry in self._entries:
            while (  # noqa: ASYNC110 - bullmq exposes only a flag, no event
                entry.task is not None
                and not entry.task.done()
                and not entry.worker.running
                and asyncio.get_running_loop().time() < deadline
            ):
                await asyncio.sleep(0.01)

    async def close(self, grace_s: float | None = None) -> None:
        """Stop taking jobs, wait for running jobs and hooks, close the connections.

        Args:
            grace_s: Longest wait for running jobs; ``None`` waits as long as they run. After
                it, running jobs are cancelled (BullMQ re-runs them once their lock expires).
        """
        if self._closing:
            return
        self._closing = True
        starting = [e.task for e in self._entries if not e.running and e.task is not None]
        for task in starting:
            task.cancel()
        if starting:
            await asyncio.wait(starting)
        await self._past_startup()
        closes = [asyncio.ensure_future(e.worker.close()) for e in self._entries]
        if closes:
            pending = await self._closing_wait(closes, grace_s)
            if pending:
                self._log.warning(
                    "jobs still running after %.1f s: cancelling them",
                    grace_s or 0.0,
                    extra={"action": "workers_close_forced"},
                )
                for entry in self._entries:
                    entry.worker.cancelProcessing()
                await self._closing_wait(closes, None)
        runs = [e.task for e in self._entries if e.task is not None]
        if runs:
            await asyncio.wait(runs)  # a run that crashed was logged by the supervisor
        await self._tasks.aclose(grace_s)  # hooks: awaited, cancelled after grace_s
