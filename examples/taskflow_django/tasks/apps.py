"""The ``tasks`` app: the event listener, and the notification processor when Redis is on."""

from __future__ import annotations

from django.apps import AppConfig


class TasksConfig(AppConfig):  # type: ignore[misc]
    name = "tasks"

    def ready(self) -> None:
        from django.conf import settings
        from sdcore.django import get_runtime

        from tasks.events import TASK_STATUS_CHANGED, bus
        from tasks.notifications import on_status_changed

        bus.on(TASK_STATUS_CHANGED, on_status_changed)
        runtime = get_runtime()
        if runtime.queues_enabled:
            # Imported only with Redis: sdcore.queues needs bullmq and redis. Every process
            # declares it; only ``manage.py sdcore run`` starts the Runtime that runs it.
            from tasks.processors import NotificationsProcessor

            runtime.processors.append(NotificationsProcessor(settings.TASKFLOW_NOTIFY_QUEUE))
