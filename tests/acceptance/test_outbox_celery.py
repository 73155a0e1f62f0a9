"""The outbox relayed to a real Celery worker over RabbitMQ: 10,000 messages, relay kills, cuts.

The campaign (``_celery_campaign.py``): relays ``kill -9``-ed twice, every broker connection
cut once, a ``celery worker`` process running each task under ``exactly_once``; every row ends
``PUBLISHED`` and every effect is written once. The shared RabbitMQ is reached through a proxy
of the test's; its queue (a unique name) is deleted after.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from kombu.connection import Connection

from tests.acceptance._celery_campaign import Broker, campaign

AMQP_URL = os.environ.get("SDCORE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
# The campaign fails on a stage that stops making progress (_celery_campaign.Stall), not on
# the total, which grows with the machine's load (45 s quiet, 98 s beside the suite and others).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _clean(queue: str) -> None:
    conn: Any = Connection(AMQP_URL)  # type: ignore[no-untyped-call]
    with conn:
        conn.default_channel.queue_delete(queue)
        conn.default_channel.exchange_delete(queue)


def _url(port: int) -> str:
    parts = urlsplit(AMQP_URL)
    credentials = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    netloc = f"{credentials}@127.0.0.1:{port}" if credentials else f"127.0.0.1:{port}"
    return parts._replace(netloc=netloc).geturl()


async def test_10000_tasks_run_once_through_relay_kills_and_cut_connections(
    pg_dsn: str, tmp_path: Path
) -> None:
    parts = urlsplit(AMQP_URL)
    broker = Broker(
        name="rabbitmq", target=(parts.hostname or "127.0.0.1", parts.port or 5672), url=_url,
        clean=_clean,
    )  # fmt: skip
    await campaign(pg_dsn, tmp_path, broker, messages=10_000)
