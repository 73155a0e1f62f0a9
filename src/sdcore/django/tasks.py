"""A Django 6 ``django.tasks`` backend: tasks go through sdcore's outbox, ``manage.py sdcore run``
runs them.

``TASKS = {"default": {"BACKEND": "sdcore.django.tasks.SdcoreBackend"}}``. ``task.enqueue()``
writes an outbox row on Django's connection (``SDCORE["DATABASE"]``): inside
``transaction.atomic()`` it joins that transaction, so a task exists only if the block commits;
outside one it commits at once, on its own (Django's autocommit). The relay of ``manage.py
sdcore run`` moves the row to a BullMQ queue in ``SDCORE["REDIS_URL"]`` (one per Django queue,
``OPTIONS["QUEUE_PREFIX"] + queue_name``), and the same worker's queue processors run it: once
per enqueue while the worker lives, again after a worker died mid-task (BullMQ's lock expiry).

Supported: ``priority`` (BullMQ job priority), ``queue_name`` (listed in ``QUEUES``),
``run_after`` (a BullMQ delay: never before it), ``takes_context``, async task functions,
``aenqueue``, ``get_result``/``aget_result`` (the outbox row, then the BullMQ job while Redis
keeps it: a week by default) and Django's ``task_enqueued``/``task_started``/``task_finished``
signals. :func:`enqueue_on_tick` enqueues a task once per tick of a ``schedules.py`` schedule.

Importing this module on Django before 6.0 raises ``ImportError`` naming the version needed.
"""

from __future__ import annotations

import django

if django.VERSION < (6, 0):
    raise ImportError(
        "sdcore.django.tasks is a backend of django.tasks, which Django 6.0 added: this is "
        f"Django {django.get_version()}. Upgrade to Django 6 (`pip install 'django>=6'`, "
        "Python 3.12 or newer), or enqueue with sdcore.django.enqueue_once on Django 5.2"
    )

import json
import math
import os
import socket
import traceback
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections, connections, transaction
from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus, task_backends
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TASK_MAX_PRIORITY, TaskError
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from sdcore.queues import Job, Processor
    from sdcore.runtime import Runtime
    from sdcore.scheduling import Tick

__all__ = ["SdcoreBackend", "enqueue_on_tick"]

DEFAULT_QUEUE_PREFIX = "django-tasks."
# The idempotency keys of the outbox rows of this backend: KEY_PREFIX + the result id.
KEY_PREFIX = "django-task:"
_QUEUE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_MAX_QUEUE = 100


def _bullmq_priority(priority: int) -> int:
    """Django's -100..100 (higher first) as BullMQ's 1..201 (lower first)."""
    return int(TASK_MAX_PRIORITY) + 1 - priority


class SdcoreBackend(BaseTaskBackend):  # type: ignore[misc]
    """``django.tasks`` through sdcore's transactional outbox, run by ``manage.py sdcore run``.

    Settings: ``QUEUES`` (default ``["default"]``; it must list every queue, since the worker
    consumes those only) and ``OPTIONS``: ``QUEUE_PREFIX`` (default ``"django-tasks."``: Django's
    queue ``default`` is the BullMQ queue ``django-tasks.default``) and ``CONCURRENCY`` (tasks
    of one queue run at once per worker, each in a thread; default 1).

    Raises:
        django.core.exceptions.ImproperlyConfigured: An empty ``QUEUES``, a queue whose BullMQ
            name is not 1-100 characters of ``[A-Za-z0-9_.-]``, an unknown option or a bad
            ``CONCURRENCY``.
    """

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        options = dict(self.options)
        unknown = sorted(set(options) - {"QUEUE_PREFIX", "CONCURRENCY"})
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS'] has unknown key(s) {', '.join(map(repr, unknown))}:"
                " use 'CONCURRENCY', 'QUEUE_PREFIX'"
            )
        prefix = options.get("QUEUE_PREFIX", DEFAULT_QUEUE_PREFIX)
        concurrency = options.get("CONCURRENCY", 1)
        if not isinstance(prefix, str):
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']['QUEUE_PREFIX'] must be a str, got {prefix!r}"
            )
        if (
            not isinstance(concurrency, int)
            or isinstance(concurrency, bool)
            or not 1 <= concurrency <= 1000
        ):
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']['CONCURRENCY'] must be an int in 1..1000, "
                f"got {concurrency!r}"
            )
        if not self.queues:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['QUEUES'] is empty: list the queues, since manage.py sdcore "
                "run consumes the listed queues only"
            )
        self.queue_prefix: str = prefix
        self.concurrency: int = concurrency
        for name in sorted(self.queues):
            queue = self.bullmq_queue(name)
            if not (1 <= len(queue) <= _MAX_QUEUE and set(queue) <= _QUEUE_CHARS):
                raise ImproperlyConfigured(
                    f"TASKS[{alias!r}]: the queue {name!r} would be the BullMQ queue {queue!r},"
                    " which must be 1-100 characters from [A-Za-z0-9_.-]"
                )

    def bullmq_queue(self, queue_name: str) -> str:
        """The BullMQ queue of a Django queue name (``QUEUE_PREFIX + queue_name``)."""
        return f"{self.queue_prefix}{queue_name}"

    def enqueue(self, task: Task, args: Sequence[Any], kwargs: Mapping[str, Any]) -> TaskResult:
        """Write the task's outbox row: in the caller's ``transaction.atomic()`` (it exists only
        if that commits) or, outside one, in a transaction of its own that commits at once.

        ``task_enqueued`` is sent when the row commits (never for a rolled-back one).

        Raises:
            InvalidTask: The task does not suit this backend (Django's checks), or its module
                path does not import back to it (a task defined in ``manage.py shell``), so
                no worker could find it.
            TypeError: ``args``/``kwargs`` are not JSON (Django's ``normalize_json``).
            django.db.DatabaseError: The database refused the row (no outbox table: run
                ``manage.py migrate``).
        """
        return self._enqueue(task, args, kwargs, result_id=str(uuid.uuid4()), delay=True)

    def _enqueue(
        self,
        task: Task,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        result_id: str,
        delay: bool,
    ) -> TaskResult:
        from sdcore.django._outbox import enqueue_once
        from sdcore.django._settings import SdcoreSettings

        self.validate_task(task)
        _check_importable(task)
        args = normalize_json(list(args))
        kwargs = normalize_json(dict(kwargs))
        now = timezone.now()
        options: dict[str, Any] = {"priority": _bullmq_priority(task.priority), "attempts": 1}
        if task.run_after is not None and delay:
            wait_ms = math.ceil((task.run_after - now).total_seconds() * 1000)
            options["delay"] = min(max(wait_ms, 0), 2**31 - 1)
        payload = {
            "id": result_id,
            "task": task.module_path,
            "backend": self.alias,
            "queue_name": task.queue_name,
            "priority": task.priority,
            "run_after": None if task.run_after is None else task.run_after.isoformat(),
            "args": args,
            "kwargs": kwargs,
        }
        result = _new_result(task, result_id, args, kwargs, self.alias, enqueued_at=now)
        alias = SdcoreSettings.from_django().database

        def write() -> None:
            enqueue_once(
                idempotency_key=KEY_PREFIX + result_id,
                queue=self.bullmq_queue(task.queue_name),
                name=task.name[:200],
                payload=payload,
                options=options,
                using=alias,
            )
            transaction.on_commit(
                lambda: task_enqueued.send(type(self), task_result=result), using=alias
            )

        # In the caller's atomic() the row joins its transaction (and an error raised before
        # any SQL leaves that transaction usable: no atomic() of ours marks it for rollback);
        # outside one, the row is a transaction of its own, committed at once.
        if connections[alias].in_atomic_block:
            write()
        else:
            with transaction.atomic(using=alias):
                write()
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """The task's state: ``READY`` while its row waits in the outbox or its job waits in
        BullMQ, then ``RUNNING``, ``SUCCESSFUL`` (with the return value) or ``FAILED`` (with
        the error), as the BullMQ job says; ``FAILED`` too when the relay gave the row up.

        Raises:
            TaskResultDoesNotExist: No such task (never enqueued, rolled back, its outbox row
                pruned, or its BullMQ job removed: a week after it finished by default).
        """
        from sdcore._internal.identifiers import qualified
        from sdcore.django._runtime import get_runtime
        from sdcore.django._settings import SdcoreSettings

        runtime = get_runtime()
        alias = SdcoreSettings.from_django().database
        table = qualified(runtime.outbox.table, runtime.outbox.schema)
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT payload, job_id, status, created_at, last_error FROM "  # noqa: S608 - checked
                f"{table.as_string(None)} WHERE idempotency_key = %s",
                [KEY_PREFIX + str(result_id)],
            )
            row = cursor.fetchone()
        if row is None:
            raise TaskResultDoesNotExist(result_id)
        payload, job_id, status, created_at, last_error = row
        if isinstance(payload, str):
            payload = json.loads(payload)
        task = _task_of(payload)
        result = _new_result(
            task,
            str(result_id),
            payload["args"],
            payload["kwargs"],
            self.alias,
            enqueued_at=created_at,
        )
        if status == "PENDING":
            return result
        if status == "DEAD":
            error = TaskError(
                exception_class_path="sdcore.outbox.OutboxError",
                traceback=f"the outbox relay gave the task up: {last_error}",
            )
            return _replace(result, status=TaskResultStatus.FAILED, errors=[error])
        job = _read_job(runtime, self.bullmq_queue(payload["queue_name"]), job_id)
        if job is None:
            raise TaskResultDoesNotExist(result_id)
        return _from_job(result, job)

    def check(self, **kwargs: Any) -> list[Any]:
        """A warning when ``SDCORE["REDIS_URL"]`` is unset: the tasks would wait in the outbox."""
        from django.core import checks

        from sdcore.django._settings import SdcoreSettings

        if SdcoreSettings.from_django().redis_url is None:
            return [
                checks.Warning(
                    f"TASKS[{self.alias!r}] uses sdcore.django.tasks.SdcoreBackend but "
                    "SDCORE['REDIS_URL'] is not set: tasks are stored in the outbox and run by "
                    "no worker until one with REDIS_URL runs `manage.py sdcore run`",
                    id="sdcore.W001",
                )
            ]
        return []

    def processors(self) -> list[Processor]:
        """The queue processors ``manage.py sdcore run`` runs: one per queue in ``QUEUES``."""
        return [
            _make_processor(self.bullmq_queue(name), self.concurrency)
            for name in sorted(self.queues)
        ]


def enqueue_on_tick(task: Task, tick: Tick, *args: Any, **kwargs: Any) -> TaskResult:
    """Enqueue ``task`` once for a schedule's tick, from a ``schedules.py`` handler.

    The result id is derived from the schedule and its instant, so a retried or repeated tick
    (or every replica of a schedule that is not exclusive) enqueues it once: the later calls
    are no-ops returning the same id. The arguments must be the same each time.

    Raises:
        TypeError: ``task`` is not a ``django.tasks.Task`` on an :class:`SdcoreBackend`.
        InvalidTask: The task has ``run_after`` (a tick enqueues for now).
        OutboxKeyConflictError: The same tick enqueued it before with other arguments.
    """
    backend = task.get_backend() if isinstance(task, Task) else None
    if not isinstance(backend, SdcoreBackend):
        raise TypeError(
            "enqueue_on_tick needs a django.tasks Task of an sdcore.django.tasks.SdcoreBackend,"
            f" got {task!r}"
        )
    if task.run_after is not None:
        raise InvalidTask("enqueue_on_tick enqueues for the tick: the task must have no run_after")
    seed = f"{tick.schedule}@{tick.scheduled_at.isoformat()}:{task.module_path}"
    result_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"sdcore-django-tasks:{seed}"))
    return backend._enqueue(task, args, kwargs, result_id=result_id, delay=False)


def register_processors(runtime: Runtime, tasks: Mapping[str, Any]) -> None:
    """Add the processors of every :class:`SdcoreBackend` of ``settings.TASKS`` to ``runtime``
    (once per BullMQ queue).

    Raises:
        django.core.exceptions.ImproperlyConfigured: A backend is configured but
            ``SDCORE["REDIS_URL"]`` is not: the worker could run none of its tasks.
    """
    queues = {getattr(p, "queue", None) for p in runtime.processors}
    for alias, params in tasks.items():
        backend_class = import_string(params["BACKEND"])
        if not (isinstance(backend_class, type) and issubclass(backend_class, SdcoreBackend)):
            continue
        if not runtime.queues_enabled:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}] uses sdcore.django.tasks.SdcoreBackend: manage.py sdcore run "
                "runs its tasks from BullMQ queues, so set SDCORE['REDIS_URL']"
            )
        for processor in task_backends[alias].processors():
            if processor.queue not in queues:
                queues.add(processor.queue)
                runtime.processors.append(processor)


def _new_result(
    task: Task,
    result_id: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    alias: str,
    *,
    enqueued_at: datetime | None,
) -> TaskResult:
    return TaskResult(
        task=task,
        id=result_id,
        status=TaskResultStatus.READY,
        enqueued_at=enqueued_at,
        started_at=None,
        finished_at=None,
        last_attempted_at=None,
        args=list(args),
        kwargs=dict(kwargs),
        backend=alias,
        errors=[],
        worker_ids=[],
    )


def _replace(result: TaskResult, **changes: Any) -> TaskResult:
    """``TaskResult`` is frozen: a changed copy (its return value kept)."""
    fields = {
        name: getattr(result, name)
        for name in (
            "task",
            "id",
            "status",
            "enqueued_at",
            "started_at",
            "finished_at",
            "last_attempted_at",
            "args",
            "kwargs",
            "backend",
            "errors",
            "worker_ids",
        )
    }
    return_value = changes.pop("return_value", result._return_value)
    copy = TaskResult(**{**fields, **changes})
    object.__setattr__(copy, "_return_value", return_value)
    return copy


def _check_importable(task: Task) -> None:
    """The worker finds a task by its module path: refuse one that does not lead back to it."""
    try:
        found = import_string(task.module_path)
    except ImportError:
        found = None
    if not isinstance(found, Task) or found.func is not task.func:
        raise InvalidTask(
            f"the task {task.module_path!r} does not import by that path, so no worker could"
            " run it: define it with @task at the top level of an importable module"
        )


def _task_of(data: Mapping[str, Any]) -> Task:
    """The enqueued task: the module-level ``Task`` at ``data["task"]``, with the priority, queue
    and ``run_after`` it was enqueued with."""
    path = data["task"]
    try:
        found = import_string(path)
    except ImportError as exc:
        raise ImportError(f"the task {path!r} does not import: {exc}") from exc
    if not isinstance(found, Task):
        raise TypeError(f"{path!r} is not a django.tasks Task (decorate it with @task)")
    run_after = data.get("run_after")
    return found.using(
        priority=data["priority"],
        queue_name=data["queue_name"],
        backend=data["backend"],
        run_after=None if run_after is None else datetime.fromisoformat(run_after),
    )


def _ms(value: object) -> datetime | None:
    """A BullMQ millisecond timestamp (0 or missing: ``None``) as an aware datetime."""
    try:
        number = int(str(value))
    except ValueError:
        return None
    return datetime.fromtimestamp(number / 1000, UTC) if number > 0 else None


def _error_of(exc: BaseException) -> TaskError:
    kind = type(exc)
    return TaskError(
        exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
        traceback="".join(traceback.format_exception(exc)),
    )


def _read_job(runtime: Runtime, queue: str, job_id: str) -> dict[str, str] | None:
    """The BullMQ job's hash (``{prefix}:{queue}:{id}``), or ``None`` when Redis has none."""
    from sdcore._internal.redis_client import open_redis

    url = runtime.redis_url
    if url is None:
        return None

    async def read() -> dict[str, str]:
        client = open_redis(url, decode_responses=True, socket_timeout_s=5.0, connect_timeout_s=5.0)
        try:
            found = await client.hgetall(f"{runtime._prefix}:{queue}:{job_id}")
        finally:
            await client.aclose()
        return {str(field): str(value) for field, value in found.items()}

    return async_to_sync(read)() or None


def _from_job(result: TaskResult, job: Mapping[str, str]) -> TaskResult:
    """The result as the BullMQ job's hash tells it (what the processor stored: the return
    value, or the error's class and traceback)."""
    started = _ms(job.get("processedOn"))
    finished = _ms(job.get("finishedOn"))
    # "ats" counts the attempts started, a run again after a stall too; "atm" the finished ones.
    attempts = max(int(job.get(name) or 0) for name in ("ats", "atm", "attemptsMade"))
    # BullMQ keeps no worker name per attempt: the count is right, the names are not known.
    workers = ["unknown"] * attempts
    changes: dict[str, Any] = {
        "started_at": started,
        "last_attempted_at": started,
        "finished_at": finished,
        "worker_ids": workers,
    }
    if finished is None:
        status = TaskResultStatus.RUNNING if started is not None else TaskResultStatus.READY
        return _replace(result, status=status, **changes)
    if job.get("failedReason") is not None:
        try:
            error = TaskError(**json.loads(job["failedReason"]))
        except (ValueError, TypeError):
            error = TaskError(exception_class_path="Exception", traceback=job["failedReason"])
        return _replace(result, status=TaskResultStatus.FAILED, errors=[error], **changes)
    return_value = json.loads(job.get("returnvalue") or "null")
    return _replace(
        result, status=TaskResultStatus.SUCCESSFUL, return_value=return_value, **changes
    )


class _TaskFailed(Exception):
    """What the processor raises for a task that raised: its message is the ``TaskError`` as
    JSON, which BullMQ stores as the job's ``failedReason``."""


WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


def _run(data: Mapping[str, Any], job: Job) -> Any:
    """Run one task in this thread, as Django's immediate backend does (signals included),
    with the thread's connection recycled around it."""
    task = _task_of(data)
    backend = task_backends[data["backend"]]
    started = timezone.now()
    # This attempt included: attemptsStarted counts it (and a run again after a stall).
    attempts = max(int(job.attemptsStarted or 0), int(job.attemptsMade or 0) + 1)
    result = _replace(
        _new_result(
            task,
            data["id"],
            data["args"],
            data["kwargs"],
            data["backend"],
            enqueued_at=_ms(job.timestamp),
        ),
        status=TaskResultStatus.RUNNING,
        started_at=started,
        last_attempted_at=started,
        worker_ids=[WORKER_ID] * attempts,
    )
    close_old_connections()
    try:
        task_started.send(type(backend), task_result=result)
        try:
            if task.takes_context:
                value = task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
            else:
                value = task.call(*result.args, **result.kwargs)
            value = normalize_json(value)
        except Exception as exc:
            error = _error_of(exc)
            done = _replace(
                result, status=TaskResultStatus.FAILED, finished_at=timezone.now(), errors=[error]
            )
            task_finished.send(type(backend), task_result=done)
            reason = {
                "exception_class_path": error.exception_class_path,
                "traceback": error.traceback,
            }
            raise _TaskFailed(json.dumps(reason)) from exc
        done = _replace(
            result,
            status=TaskResultStatus.SUCCESSFUL,
            finished_at=timezone.now(),
            return_value=value,
        )
        task_finished.send(type(backend), task_result=done)
        return value
    finally:
        close_old_connections()


def _make_processor(queue: str, concurrency: int) -> Processor:
    """The :class:`~sdcore.queues.Processor` of one BullMQ queue of tasks."""
    from sdcore.queues import Processor

    class TasksProcessor(Processor):
        async def process(self, job: Job) -> Any:
            return await sync_to_async(_run, thread_sensitive=False)(job.data, job)

    processor = TasksProcessor()
    processor.queue = queue
    processor.concurrency = concurrency
    return processor
