"""The BullMQ publisher's memory against the number of distinct queue names.

One ``BullMQPublisher`` publishes one small job to each of ``--queues`` distinct queue names
(``tenant-0`` …), ``--batch`` messages per ``publish`` call, under a fresh key prefix of the
Redis at ``--redis-url`` (its keys are deleted at the end). After each tenth of the names the
Python heap is measured with tracemalloc after a GC, and the process's RSS is read. No database:
the messages are made in memory.

Run: ``python benchmarks/publisher_queues.py [--queues 10000] [--batch 500]``; the current
figure is in docs/benchmarks.md#outbox.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import tracemalloc
import uuid
from datetime import UTC, datetime

import redis.asyncio as aioredis

from sdcore.outbox import OutboxMessage, check_options
from sdcore.outbox._model import job_id_v2
from sdcore.queues import BullMQPublisher


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def run(url: str, queues: int, batch: int) -> None:
    prefix = f"sdcore-bench-{uuid.uuid4().hex[:10]}"
    options = check_options(None)
    now = datetime.now(UTC)
    tracemalloc.start()
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    print(f"{'queues':>7} | {'heap MB':>8} {'KB/queue':>9} | {'RSS MB':>7}")
    step = max(queues // 10, 1)
    async with BullMQPublisher.from_url(url, prefix=prefix, check_server=False) as publisher:
        for start in range(0, queues, batch):
            messages = [
                OutboxMessage(
                    id=i,
                    idempotency_key=f"k{i}",
                    queue=f"tenant-{i}",
                    name="job",
                    job_id=job_id_v2("bench", f"k{i}"),
                    payload={"i": i},
                    options=options,
                    attempts=1,
                    max_attempts=10,
                    created_at=now,
                )
                for i in range(start, min(start + batch, queues))
            ]
            results = await publisher.publish(messages)
            assert all(r is None for r in results), results
            done = start + len(messages)
            if done % step < batch or done == queues:
                gc.collect()
                heap = (tracemalloc.get_traced_memory()[0] - base) / 2**20
                print(f"{done:>7} | {heap:>8.1f} {heap * 1024 / done:>9.1f} | {rss_mb():>7.0f}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MB")
    client = aioredis.Redis.from_url(url)
    keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
    for first in range(0, len(keys), 1000):
        await client.delete(*keys[first : first + 1000])
    await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--redis-url", default=os.environ.get("SDCORE_BENCH_REDIS_URL", "redis://127.0.0.1:6379")
    )
    parser.add_argument("--queues", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()
    asyncio.run(run(args.redis_url, args.queues, args.batch))


if __name__ == "__main__":
    main()
