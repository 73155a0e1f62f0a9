"""With ``SDCORE_DJANGO_TASK_TICKS`` set: a per-second schedule that enqueues a task per tick."""

import os

from sdcore.django import scheduler

if os.environ.get("SDCORE_DJANGO_TASK_TICKS"):
    from taskapp.tasks import record  # type: ignore[import-not-found]

    from sdcore.django.tasks import enqueue_on_tick

    @scheduler.interval(1_000, name="task-every-second")
    def every_second(tick):  # type: ignore[no-untyped-def]
        label = f"tick-{tick.scheduled_at.isoformat()}"
        first = enqueue_on_tick(record, tick, label)
        again = enqueue_on_tick(record, tick, label)  # the same tick again: a no-op
        assert again.id == first.id
