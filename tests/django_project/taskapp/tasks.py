"""``django.tasks`` tasks of the test app (Django 6, ``SDCORE_DJANGO_TASKS`` set)."""

import os

from django.tasks import task
from taskapp.models import TaskRun  # type: ignore[import-not-found]


@task  # type: ignore[untyped-decorator]
def record(label: str) -> str:
    TaskRun.objects.create(label=label, pid=os.getpid())
    return label


@task(takes_context=True, queue_name="other", priority=50)
def record_context(context, label):  # type: ignore[no-untyped-def]
    TaskRun.objects.create(label=label, attempt=context.attempt, pid=os.getpid())
    return {"id": context.task_result.id, "attempt": context.attempt}


@task  # type: ignore[untyped-decorator]
async def record_async(label: str) -> str:
    await TaskRun.objects.acreate(label=label, pid=os.getpid())
    return label


@task  # type: ignore[untyped-decorator]
def fail(label: str) -> None:
    raise ValueError(f"task {label} failed on purpose")
