"""Python ↔ Node BullMQ on a Redis Cluster of the test's own: a Node ``Worker`` on an ioredis
``Cluster`` runs the jobs sdcore's relay publishes, and a Python :class:`~sdcore.queues.Processor`
runs the jobs Node adds, both under a hash-tagged prefix.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import Outbox, OutboxRelay, PostgresOutboxStore
from sdcore.queues import BullMQPublisher, Job, Processor, Workers
from tests._servers import redis_cluster
from tests.interop.test_node_interop import _node

pytestmark = pytest.mark.slow
PREFIX = "{sd-interop}"
JOBS = 20


class Records(Processor):
    queue = "from-node"

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    async def process(self, job: Job) -> Any:
        self.data[job.id] = job.data
        return {"handledBy": "python"}


async def test_node_and_python_workers_share_jobs_on_a_cluster(
    pg_dsn: str, node_env: dict[str, str]
) -> None:
    outbox = Outbox(namespace="interop-cluster")
    keys = [f"order:{n}:shipped" for n in range(JOBS)]
    with redis_cluster() as group:
        async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False) as pool:
            await outbox.ensure_schema(pool)
            async with pool.connection() as conn, conn.transaction():
                for n, key in enumerate(keys):
                    await outbox.enqueue_once(
                        conn, idempotency_key=key, queue="emails", name="send", payload={"n": n}
                    )
            async with BullMQPublisher.from_url(group.url, prefix=PREFIX) as publisher:
                assert await OutboxRelay(PostgresOutboxStore(pool), publisher).run_once() == JOBS
        lines = await _node(node_env, "work", group.url, PREFIX, "emails", str(JOBS))
        assert not [line for line in lines if line["event"] == "error"]
        processed = {line["id"]: line for line in lines if line["event"] == "processed"}
        assert set(processed) == {outbox.job_id(key) for key in keys}
        assert sorted(line["data"]["n"] for line in processed.values()) == list(range(JOBS))
        seen = await _node(node_env, "inspect", group.url, PREFIX, "emails", *processed)
        assert {line["state"] for line in seen} == {"completed"}

        records = Records()
        async with Workers([records], redis_url=group.url, prefix=PREFIX) as workers:
            await asyncio.wait_for(workers.wait_ready(), 15)
            added = await _node(node_env, "add", group.url, PREFIX, "from-node", "3")
            deadline = time.monotonic() + 20
            while len(records.data) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        ids = [line["id"] for line in added]
        assert sorted(records.data) == sorted(ids)
        assert all(data["text"] == "héllo" for data in records.data.values())
