"""Python ↔ Node BullMQ on one Redis: the jobs sdcore publishes run on a real Node ``Worker``,
and the jobs Node's ``Queue.add`` creates run on a Python :class:`~sdcore.queues.Processor`,
retries included. Node's BullMQ version is pinned in ``package.json`` next to this file.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from bullmq import Queue  # type: ignore[import-untyped]
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import bullmq_job_id
from sdcore.outbox import Outbox, OutboxRelay, PostgresOutboxStore
from sdcore.queues import BullMQPublisher, Job, Processor, Workers
from tests.interop.conftest import REDIS_URL

SCRIPT = Path(__file__).resolve().parent / "interop.js"
LOSSY = {"neg_zero": -0.0, "e16": 1e16, "e300": 1e300, "tiny": 5e-324, "unicode": "ünï 🎉"}
pytestmark = pytest.mark.slow


async def _node(env: dict[str, str], *args: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Run ``node interop.js …`` and return its JSON lines."""
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(SCRIPT),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"node interop.js {args[0]} did not finish in {timeout} s")
    assert proc.returncode == 0, err.decode()[-2000:]
    return [json.loads(line) for line in out.decode().splitlines() if line.strip()]


async def test_node_worker_runs_jobs_published_by_the_relay(
    pg_dsn: str, node_env: dict[str, str], redis: aioredis.Redis, prefix: str
) -> None:
    keys = ["order:1:shipped", "12345", "ünïcødé-🎉"]
    options = {"attempts": 2, "backoff": {"type": "exponential", "delay": 100}}
    outbox = Outbox(namespace="interop")
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False) as pool:
        await outbox.ensure_schema(pool)
        async with pool.connection() as conn, conn.transaction():
            for key in keys:
                await outbox.enqueue_once(
                    conn,
                    idempotency_key=key,
                    queue="emails",
                    name="send",
                    payload={"key": key, "n": [1, 2.5, None, True], "big": 2**53 + 1, **LOSSY},
                    options=options,
                )
        async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
            assert await OutboxRelay(PostgresOutboxStore(pool), publisher).run_once() == 3
    lines = await _node(node_env, "work", REDIS_URL, prefix, "emails", "3")
    processed = {line["id"]: line for line in lines if line["event"] == "processed"}
    assert not [line for line in lines if line["event"] == "error"]
    assert set(processed) == {outbox.job_id(key) for key in keys}
    for key in keys:
        job = processed[outbox.job_id(key)]
        assert job["name"] == "send"
        # A JavaScript number rounds ints beyond 2^53 (Outbox(exact_numbers=True) refuses them);
        # jsonb already turned 1e16 into an int and -0.0 into 0.0 (the outbox reference's table).
        assert job["data"] == {
            "key": key,
            "n": [1, 2.5, None, True],
            "big": 2**53,
            "neg_zero": 0,
            "e16": 10**16,
            "e300": 1e300,
            "tiny": 5e-324,
            "unicode": "ünï 🎉",
        }
        assert type(job["data"]["e16"]) is int
        assert job["attemptsMade"] == 0
        assert job["opts"]["attempts"] == 2
        assert job["opts"]["backoff"] == {"type": "exponential", "delay": 100}
        assert job["opts"]["removeOnComplete"] == {"age": 7 * 24 * 3600}
    queue = Queue("emails", {"connection": redis, "prefix": prefix})
    for key in keys:
        done = await queue.getJob(outbox.job_id(key))
        assert await queue.getJobState(done.id) == "completed"
        assert done.returnvalue == {"handledBy": "node", "id": outbox.job_id(key)}


class FailsOnce(Processor):
    queue = "from-node"

    def __init__(self) -> None:
        self.attempts: dict[str, list[tuple[int, float]]] = {}
        self.data: dict[str, Any] = {}
        self.completed: list[str] = []

    async def process(self, job: Job) -> Any:
        self.attempts.setdefault(job.id, []).append((job.attemptsMade, time.monotonic()))
        self.data[job.id] = job.data
        if job.attemptsMade == 0:
            raise RuntimeError("first attempt fails")
        return {"handledBy": "python", "n": job.data["n"]}

    async def on_completed(self, job: Job, result: Any) -> None:
        self.completed.append(job.id)


async def test_python_processor_runs_jobs_added_by_node(
    node_env: dict[str, str], prefix: str
) -> None:
    processor = FailsOnce()
    async with Workers([processor], redis_url=REDIS_URL, prefix=prefix) as workers:
        await workers.wait_ready()
        added = await _node(node_env, "add", REDIS_URL, prefix, "from-node", "3")
        ids = [line["id"] for line in added]
        deadline = time.monotonic() + 20
        while len(processor.completed) < 3:
            assert time.monotonic() < deadline, processor.attempts
            await asyncio.sleep(0.05)
    assert sorted(processor.completed) == sorted(ids)
    for job_id in ids:
        attempts = processor.attempts[job_id]
        assert [made for made, _ in attempts] == [0, 1]
        assert 0.09 <= attempts[1][1] - attempts[0][1] <= 1.0  # backoff 100 ms, not rounded to 1 s
        n = int(processor.data[job_id]["n"])
        assert processor.data[job_id] == {"n": n, "text": "héllo", "nested": {"list": [1, 2, 3]}}
    seen = await _node(node_env, "inspect", REDIS_URL, prefix, "from-node", *ids)
    for line in seen:
        assert line["state"] == "completed"
        assert line["attemptsMade"] == 2
        assert line["returnvalue"]["handledBy"] == "python"


async def test_node_accepts_our_job_ids_but_not_raw_keys(
    node_env: dict[str, str], prefix: str
) -> None:
    """OB-08: Node refuses ``code:run``, ``12345``, ``0`` as custom ids, never ours (v1 and v2)."""
    keys = ["code:run", "12345", "0", "a:b:c", "tenant:42:report:2024-06"]
    raw = await _node(node_env, "ids", REDIS_URL, prefix, "ids", *keys)
    v2 = Outbox(namespace='app.public."out:box"')
    ids = [*map(bullmq_job_id, keys), *map(v2.job_id, keys)]
    ours = await _node(node_env, "ids", REDIS_URL, prefix, "ids", *ids)
    refused = {line["jobId"] for line in raw if not line["ok"]}
    # "a:b:c" passes only because Node keeps three-part ids for legacy repeatable jobs.
    assert refused == {"code:run", "12345", "0", "tenant:42:report:2024-06"}
    assert all(line["ok"] for line in ours), ours
    assert [line["id"] for line in ours] == ids
