"""The Celery app of the outbox-to-Celery acceptance tests, run by a real ``celery worker``.

Configured from the environment (the test starts the worker): ``SDCORE_CELERY_BROKER``,
``SDCORE_CELERY_QUEUE``, ``SDCORE_CELERY_DSN``, ``SDCORE_CELERY_TRANSPORT_OPTIONS`` (JSON).
Every delivery of a task is counted in ``deliveries`` (its own autocommit connection, outside
the task's transaction); the task's effect, a row in ``effects``, is written under
``exactly_once``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import psycopg
from celery import Celery, signals  # type: ignore[import-untyped]

from sdcore.outbox.celery import exactly_once

DSN = os.environ["SDCORE_CELERY_DSN"]
app = Celery("sdcore_celery_acceptance", broker=os.environ["SDCORE_CELERY_BROKER"])
app.conf.update(
    task_default_queue=os.environ["SDCORE_CELERY_QUEUE"],
    task_acks_late=True,
    task_ignore_result=True,
    worker_prefetch_multiplier=64,
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options=json.loads(os.environ.get("SDCORE_CELERY_TRANSPORT_OPTIONS", "{}")),
)
_counter: dict[int, psycopg.Connection[Any]] = {}


@signals.task_prerun.connect  # type: ignore[untyped-decorator]
def count_delivery(task_id: str | None = None, **_: Any) -> None:
    conn = _counter.get(os.getpid())
    if conn is None or conn.closed:
        conn = _counter[os.getpid()] = psycopg.connect(DSN, autocommit=True)
    conn.execute("INSERT INTO deliveries (task_id) VALUES (%s)", (task_id,))


@app.task(name="effects.apply")  # type: ignore[untyped-decorator]
@exactly_once(DSN)
def apply(conn: psycopg.Connection[Any], key: str) -> None:
    conn.execute("INSERT INTO effects (key) VALUES (%s)", (key,))
