"""A queue processor ``SDCORE["PROCESSORS"]`` names: each job becomes one ``TickRow``."""

from __future__ import annotations

import os
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.utils import timezone

from sdcore.queues import Job, Processor


def _record(job_id: str, label: str) -> None:
    from tickapp.models import TickRow  # type: ignore[import-not-found]

    close_old_connections()
    try:
        TickRow.objects.create(
            schedule=f"job:{label}",
            scheduled_at=timezone.now(),
            idempotency_key=job_id,
            fencing_token=0,
            pid=os.getpid(),
        )
    finally:
        close_old_connections()


class Recorder(Processor):
    queue = "recorded"

    async def process(self, job: Job) -> Any:
        await sync_to_async(_record, thread_sensitive=False)(job.id or "", job.data["label"])
        return job.data["label"]
