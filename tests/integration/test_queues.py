"""``sdcore.queues`` against a real Redis (and PostgreSQL for the outbox): RELIABILITY.md §5.6.

- Publisher: job id, name, data and options in Redis; re-publishing is a no-op (OB-01/06/07);
  Node-safe ids (OB-08); ``decode_responses`` enforced; OOM and a dead port are "unavailable"
  (OB-02/OB-05); an ambiguous publish (response lost) is deduplicated (OB-06); a too-large job
  fails alone (OB-13); start-up warnings for eviction policy and persistence (OB-03/OB-04).
- Outbox end to end: commit → relay → processor; rollback publishes nothing (OB-12); a late
  commit is still published (OB-11); SIGKILL between publish and mark (OB-01); Redis down then
  back (OB-02); a poison row dead-letters while the others flow (OB-13); four relays (OB-09).
- Workers: retry gaps follow the backoff (not rounded to whole seconds), final
  failure hook and log, hooks that raise, graceful close, start while Redis is down.

Every test uses its own key prefix and deletes its keys. Private Redis servers (for OOM and
config changes) run on free loopback ports so the shared server is never reconfigured.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from bullmq import Queue, Worker  # type: ignore[import-untyped]
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import bullmq_job_id
from sdcore.outbox import (
    Outbox,
    OutboxMessage,
    OutboxRelay,
    PostgresOutboxStore,
    PublisherUnavailableError,
    check_options,
)
from sdcore.queues import (
    BullMQPublisher,
    InvalidProcessorError,
    Job,
    JobTooLargeError,
    Processor,
    RedisClientError,
    RedisUnavailableError,
    Workers,
    check_redis_server,
    queues_enabled,
)
from tests._servers import free_port, redis_server

REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
ROOT = Path(__file__).resolve().parents[2]


def _report(line: str) -> None:
    """The RELIABILITY.md metric line (shown with ``pytest -s``)."""
    print(line)  # noqa: T201


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis server of this test alone (so CONFIG SET, OOM and shutdowns harm no one)."""
    with redis_server(tmp_path) as server:
        yield server.url


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """A pool on a fresh database with the outbox table."""
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=6, open=False) as p:
        await Outbox().ensure_schema(p)
        yield p


def _message(
    key: str,
    *,
    queue: str = "q",
    name: str = "job",
    payload: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> OutboxMessage:
    return OutboxMessage(
        id=1,
        idempotency_key=key,
        queue=queue,
        name=name,
        job_id=bullmq_job_id(key),
        payload={"key": key} if payload is None else payload,
        options=check_options(options),
        attempts=1,
        max_attempts=10,
        created_at=datetime.now(UTC),
    )


async def _job_keys(client: aioredis.Redis, prefix: str, queue: str) -> list[str]:
    head = f"{prefix}:{queue}:"
    return [
        key
        async for key in client.scan_iter(match=f"{head}sd*", count=1000)
        if ":" not in key[len(head) :]
    ]


async def _until(
    check: Callable[[], Awaitable[bool]], *, timeout: float = 15.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _rows(pool: AsyncConnectionPool[Any]) -> list[tuple[Any, ...]]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT idempotency_key, status, attempts, last_error FROM outbox ORDER BY id"
        )
        rows: list[tuple[Any, ...]] = await cur.fetchall()
        return rows


async def _job_ids(pool: AsyncConnectionPool[Any]) -> dict[str, str]:
    """The job id the outbox stored for each key (v2: derived from the outbox's identity)."""
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT idempotency_key, job_id FROM outbox")
        return {key: job_id for key, job_id in await cur.fetchall()}


async def _enqueue(pool: AsyncConnectionPool[Any], keys: Sequence[str], queue: str) -> None:
    async with pool.connection() as conn, conn.transaction():
        for key in keys:
            await Outbox().enqueue_once(
                conn, idempotency_key=key, queue=queue, name="note", payload={"key": key}
            )


class Recorder(Processor):
    """Records every attempt; fails the first ``fail_times`` attempts of each job."""

    def __init__(self, queue: str, *, fail_times: int = 0, sleep_s: float = 0.0) -> None:
        self.queue = queue
        self.fail_times = fail_times
        self.sleep_s = sleep_s
        self.attempts: list[tuple[str, int, float]] = []
        self.done: list[str] = []
        self.failures: list[tuple[str, bool, int]] = []
        self.completed: list[tuple[str, Any]] = []

    async def process(self, job: Job) -> Any:
        self.attempts.append((job.id, job.attemptsMade, time.monotonic()))
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)
        if job.attemptsMade < self.fail_times:
            raise RuntimeError(f"planned failure {job.attemptsMade + 1}")
        self.done.append(job.id)
        return {"ok": job.data.get("key")}

    async def on_completed(self, job: Job, result: Any) -> None:
        self.completed.append((job.id, result))

    async def on_failed(self, job: Job, error: BaseException, final: bool) -> None:
        self.failures.append((job.id, final, job.attemptsMade))


# --------------------------------------------------------------------------- publisher


async def test_publish_writes_the_job(redis: aioredis.Redis, prefix: str) -> None:
    options = {"attempts": 3, "backoff": {"type": "exponential", "delay": 200}, "priority": 0}
    message = _message("order:42:email", name="send", payload={"to": "a@b.c"}, options=options)
    async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
        assert await publisher.publish([message]) == [None]
    assert message.job_id.startswith("sd-")
    job = await Queue("q", {"connection": redis, "prefix": prefix}).getJob(message.job_id)
    assert job is not None
    assert (job.id, job.name, job.data) == (message.job_id, "send", {"to": "a@b.c"})
    assert job.opts["attempts"] == 3
    assert job.opts["backoff"] == {"type": "exponential", "delay": 200}
    assert job.opts["removeOnComplete"] == {"age": 7 * 24 * 3600}
    assert job.opts["removeOnFail"] == {"age": 7 * 24 * 3600}
    assert await redis.lrange(f"{prefix}:q:wait", 0, -1) == [message.job_id]


async def test_ping_says_whether_redis_answers_and_a_refusal_is_no_timeout(prefix: str) -> None:
    """``ping()`` is how the relay tells an outage from a job too slow for the link; a refused
    connection is an outage with no ``timeout_s`` (only a write that timed out carries one)."""
    message = _message("ping:1")
    async with (
        BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as up,
        BullMQPublisher.from_url(
            f"redis://127.0.0.1:{free_port()}", prefix=prefix, check_server=False
        ) as down,
    ):
        assert await up.ping() is True
        assert await down.ping() is False
        with pytest.raises(PublisherUnavailableError) as refused:
            await down.publish([message])
    assert refused.value.timeout_s is None


async def test_publishing_twice_keeps_one_job(redis: aioredis.Redis, prefix: str) -> None:
    """OB-01/OB-06/OB-07: the same job id is a no-op while the job is kept (even completed)."""
    first = _message("dup-key", payload={"v": 1})
    again = _message("dup-key", payload={"v": 2})
    other = _message("other-key")
    async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
        assert await publisher.publish([first, other]) == [None, None]
        assert await publisher.publish([again, first]) == [None, None]
        assert len(await _job_keys(redis, prefix, "q")) == 2
        assert await redis.llen(f"{prefix}:q:wait") == 2
        recorder = Recorder("q")
        async with Workers([recorder], redis_url=REDIS_URL, prefix=prefix) as workers:
            await workers.wait_ready()
            await _until(lambda: _true(len(recorder.completed) == 2), what="2 jobs")
            # Completed jobs are kept by age: a re-publish now still finds the job.
            assert await publisher.publish([again]) == [None]
            await asyncio.sleep(0.3)
        assert sorted(recorder.done) == sorted([first.job_id, other.job_id])
    job = await Queue("q", {"connection": redis, "prefix": prefix}).getJob(first.job_id)
    assert job.data == {"v": 1}


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize(
    "key",
    ["code:run", "12345", "a:b:c", "ünïcødé 🎉 key", "x" * 1000, "0"],
    ids=["colon", "digits", "colons", "unicode", "long", "zero"],
)
async def test_job_ids_are_node_safe(redis: aioredis.Redis, prefix: str, key: str) -> None:
    """OB-08: whatever the idempotency key, the job id is ``sd-`` + 64 hex digits."""
    message = _message(key)
    assert message.job_id[:3] == "sd-"
    assert len(message.job_id) == 67
    assert set(message.job_id[3:]) <= set("0123456789abcdef")
    async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
        assert await publisher.publish([message]) == [None]
    assert await _job_keys(redis, prefix, "q") == [f"{prefix}:q:{message.job_id}"]


async def test_client_must_decode_responses(redis: aioredis.Redis, prefix: str) -> None:
    raw = aioredis.Redis.from_url(REDIS_URL)
    try:
        with pytest.raises(RedisClientError, match="decode_responses=True"):
            BullMQPublisher(raw)
    finally:
        await raw.aclose()
    with pytest.raises(RedisClientError, match=r"redis\.asyncio\.Redis"):
        BullMQPublisher("redis://localhost")  # type: ignore[arg-type]
    # A client the caller owns is used and left open.
    async with BullMQPublisher(redis, prefix=prefix) as publisher:
        assert await publisher.publish([_message("shared")]) == [None]
    assert await redis.ping()


def test_queues_enabled() -> None:
    assert not queues_enabled(None)
    assert not queues_enabled("")
    assert not queues_enabled("   ")
    assert queues_enabled("redis://localhost:6379/0")
    assert queues_enabled("rediss://user:secret@cache:6380")
    with pytest.raises(ValueError, match="redis://"):
        queues_enabled("localhost:6379")


def test_import_without_bullmq_names_the_extra() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'bullmq' or name.startswith('bullmq.'):\n"
        "            raise ImportError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import sdcore, sdcore.outbox\n"
        "assert 'redis' not in sys.modules, 'sdcore imported redis'\n"
        "try:\n"
        "    import sdcore.queues\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "pip install 'sdcore[bullmq]'" in out.stdout, out.stdout + out.stderr


async def test_unreachable_redis_is_unavailable(prefix: str) -> None:
    """OB-02: a dead port raises PublisherUnavailableError quickly, for the relay to back off."""
    publisher = BullMQPublisher.from_url(
        f"redis://127.0.0.1:{free_port()}", prefix=prefix, connect_timeout_s=1.0
    )
    async with publisher:  # start() logs, does not raise
        started = time.monotonic()
        with pytest.raises(PublisherUnavailableError):
            await publisher.publish([_message("k")])
        assert time.monotonic() - started < 5


async def test_oom_is_unavailable_then_recovers(private_redis: str) -> None:
    """OB-05: ``-OOM`` is transient: unavailable (nothing counted), then published."""
    admin = aioredis.Redis.from_url(private_redis, decode_responses=True)
    try:
        async with BullMQPublisher.from_url(private_redis, prefix="p") as publisher:
            await admin.config_set("maxmemory", "1")
            with pytest.raises(PublisherUnavailableError, match="memory"):
                await publisher.publish([_message("a"), _message("b", queue="q2")])
            assert await admin.exists(f"p:q:{bullmq_job_id('a')}") == 0
            await admin.config_set("maxmemory", "0")
            assert await publisher.publish([_message("a"), _message("b", queue="q2")]) == [
                None,
                None,
            ]
        assert await admin.exists(f"p:q:{bullmq_job_id('a')}") == 1
    finally:
        await admin.aclose()


async def test_too_large_job_fails_alone(redis: aioredis.Redis, prefix: str) -> None:
    """OB-13: the message over ``max_job_bytes`` gets its own error; the batch goes on."""
    small, big = _message("small"), _message("big", payload={"blob": "x" * 5000})
    async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix, max_job_bytes=1000) as pub:
        results = await pub.publish([big, small])
    assert isinstance(results[0], JobTooLargeError)
    assert results[0].size > 5000
    assert results[1] is None
    assert await _job_keys(redis, prefix, "q") == [f"{prefix}:q:{small.job_id}"]


class _Proxy:
    """A TCP proxy to Redis that can drop every reply (the command still runs): OB-06."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.drop_replies = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> _Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers += [writer, up_writer]
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer, droppable=False)),
            asyncio.create_task(self._pipe(up_reader, writer, droppable=True)),
        ):
            self._tasks.add(task)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, droppable: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                if droppable and self.drop_replies:
                    continue
                dst.write(data)
                await dst.drain()
        dst.close()


async def test_ambiguous_publish_is_deduplicated(redis: aioredis.Redis, prefix: str) -> None:
    """OB-06: the add runs but its reply is lost → unavailable → re-publish → one job."""
    host, port = REDIS_URL.split("//")[1].split("/")[0].split(":")
    async with _Proxy((host, int(port))) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}"
        async with BullMQPublisher.from_url(url, prefix=prefix, socket_timeout_s=0.3) as pub:
            assert await pub.publish([_message("warm-up")]) == [None]  # scripts loaded
            proxy.drop_replies = True
            with pytest.raises(PublisherUnavailableError):
                await pub.publish([_message("lost-reply")])
            proxy.drop_replies = False
            assert await pub.publish([_message("lost-reply")]) == [None]
    keys = await _job_keys(redis, prefix, "q")
    assert sorted(keys) == sorted(
        f"{prefix}:q:{bullmq_job_id(k)}" for k in ("warm-up", "lost-reply")
    )
    assert await redis.llen(f"{prefix}:q:wait") == 2


async def test_start_warns_about_eviction_and_persistence(
    private_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    """OB-03/OB-04: warnings at start, with stable actions; none on a production setup."""
    caplog.set_level(logging.WARNING, logger="sdcore.queues")
    admin = aioredis.Redis.from_url(private_redis, decode_responses=True)
    try:
        await admin.config_set("maxmemory-policy", "allkeys-lru")
        async with BullMQPublisher.from_url(private_redis) as publisher:
            assert publisher.server is not None
            assert publisher.server.maxmemory_policy == "allkeys-lru"
            assert publisher.server.aof_enabled is False
        actions = {getattr(r, "action", None) for r in caplog.records}
        assert {"redis_eviction_policy", "redis_persistence"} <= actions
        eviction = next(
            r for r in caplog.records if getattr(r, "action", "") == "redis_eviction_policy"
        )
        assert "allkeys-lru" in eviction.getMessage()

        caplog.clear()
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("appendonly", "yes")
        async with BullMQPublisher.from_url(private_redis) as publisher:
            assert publisher.server is not None
            assert publisher.server.eviction_safe
            assert publisher.server.aof_enabled is True
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        await admin.aclose()


@pytest.mark.filterwarnings("ignore:IMPORTANT! Eviction policy:UserWarning")
async def test_workers_warn_about_eviction(
    private_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sdcore.queues")
    admin = aioredis.Redis.from_url(private_redis, decode_responses=True)
    try:
        await admin.config_set("maxmemory-policy", "volatile-lru")
        async with Workers([Recorder("q")], redis_url=private_redis) as workers:
            await asyncio.wait_for(workers.wait_ready(), 10)
            assert workers.server is not None
            assert workers.server.maxmemory_policy == "volatile-lru"
        assert "redis_eviction_policy" in {getattr(r, "action", None) for r in caplog.records}
    finally:
        await admin.aclose()


async def test_info_denied_by_acl_does_not_block(
    private_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Managed Redis often denies INFO/CONFIG: warn "unknown", then publish and process anyway."""
    caplog.set_level(logging.WARNING, logger="sdcore.queues")
    admin = aioredis.Redis.from_url(private_redis, decode_responses=True)
    try:
        await admin.acl_setuser(
            "app",
            enabled=True,
            passwords=["+secret"],
            keys=["*"],
            channels=["*"],
            commands=["+@all", "-info", "-config"],
        )
        url = private_redis.replace("redis://", "redis://app:secret@")
        recorder = Recorder("q")
        async with (
            BullMQPublisher.from_url(url, prefix="p") as publisher,
            Workers([recorder], redis_url=url, prefix="p") as workers,
        ):
            assert await publisher.publish([_message("acl")]) == [None]
            await asyncio.wait_for(workers.wait_ready(), 10)
            await _until(lambda: _true(len(recorder.done) == 1), what="the job")
        assert publisher.server is not None
        assert publisher.server.maxmemory_policy is None
        actions = [getattr(r, "action", None) for r in caplog.records]
        assert "redis_eviction_policy" in actions
        assert "worker_version_unknown" in actions
        assert not [r for r in caplog.records if "secret" in r.getMessage()]
    finally:
        await admin.aclose()


# --------------------------------------------------------------------------- outbox end to end


async def test_outbox_commit_reaches_processor_and_rollback_does_not(
    pool: AsyncConnectionPool[Any], redis: aioredis.Redis, prefix: str
) -> None:
    """Outbox → relay → BullMQ → Processor; a rolled-back transaction publishes nothing (OB-12)."""
    outbox = Outbox()
    async with pool.connection() as conn:
        async with conn.transaction():
            assert await outbox.enqueue_once(
                conn,
                idempotency_key="task:1:done",
                queue="notifications",
                name="task-status-changed",
                payload={"taskId": 1, "to": "DONE"},
                options={"attempts": 5, "backoff": {"type": "exponential", "delay": 1000}},
            )
        with contextlib.suppress(RuntimeError):
            async with conn.transaction():
                await outbox.enqueue_once(
                    conn,
                    idempotency_key="task:2:done",
                    queue="notifications",
                    name="task-status-changed",
                    payload={"taskId": 2},
                )
                raise RuntimeError("the business change failed")
    recorder = Recorder("notifications")
    publisher = BullMQPublisher.from_url(REDIS_URL, prefix=prefix)
    async with (
        publisher,
        OutboxRelay(PostgresOutboxStore(pool), publisher, poll_interval_ms=100) as relay,
        Workers([recorder], redis_url=REDIS_URL, prefix=prefix),
    ):
        await _until(lambda: _true(len(recorder.completed) == 1), what="the job")
        await asyncio.sleep(0.3)
        assert relay.state.published == 1
    assert recorder.done == [(await _job_ids(pool))["task:1:done"]]
    assert recorder.completed[0][1] == {"ok": None}
    assert [r[:2] for r in await _rows(pool)] == [("task:1:done", "PUBLISHED")]
    assert len(await _job_keys(redis, prefix, "notifications")) == 1


async def test_late_commit_is_published(
    pool: AsyncConnectionPool[Any], pg_dsn: str, redis: aioredis.Redis, prefix: str
) -> None:
    """OB-11: T1 inserts first and commits last; the relay ran in between; nothing is lost."""
    outbox = Outbox()
    async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
        relay = OutboxRelay(PostgresOutboxStore(pool), publisher)
        async with await psycopg.AsyncConnection.connect(pg_dsn) as t1:
            await outbox.enqueue_once(
                t1, idempotency_key="early", queue="q", name="n", payload={"k": 1}
            )
            async with await psycopg.AsyncConnection.connect(pg_dsn) as t2:
                await outbox.enqueue_once(
                    t2, idempotency_key="late", queue="q", name="n", payload={"k": 2}
                )
                await t2.commit()
            assert await relay.run_once() == 1
            await t1.commit()
        assert await relay.run_once() == 1
    rows = await _rows(pool)
    assert sorted((r[0], r[1]) for r in rows) == [("early", "PUBLISHED"), ("late", "PUBLISHED")]
    assert len(await _job_keys(redis, prefix, "q")) == 2


_CRASHING_RELAY = """
import asyncio, os, signal, sys
from psycopg_pool import AsyncConnectionPool
from sdcore.outbox import OutboxRelay, PostgresOutboxStore
from sdcore.queues import BullMQPublisher

class KilledAfterPublish:
    def __init__(self, inner):
        self.inner = inner

    async def publish(self, messages):
        results = await self.inner.publish(messages)
        print(" ".join(m.idempotency_key for m in messages), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # after add(), before the rows are marked
        return results

async def main(dsn, url, prefix, claim_ms, batch):
    async with AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as pool:
        publisher = BullMQPublisher.from_url(url, prefix=prefix)
        relay = OutboxRelay(
            PostgresOutboxStore(pool), KilledAfterPublish(publisher), claim_ms=int(claim_ms),
            batch_size=int(batch),
        )
        print("claimed", await relay.run_once(), flush=True)

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.slow
async def test_relay_killed_between_publish_and_mark(
    pool: AsyncConnectionPool[Any], pg_dsn: str, redis: aioredis.Redis, prefix: str, tmp_path: Path
) -> None:
    """OB-01: SIGKILL after add() and before mark, three times; one job per key, one delivery."""
    keys = [f"order:{i}" for i in range(10)]
    await _enqueue(pool, keys, "q")
    script = tmp_path / "crashing_relay.py"
    script.write_text(_CRASHING_RELAY)
    # Rounds 0 and 1 must both claim before round 0's claims expire (a process start under load
    # can take a second or more); round 2 waits them out.
    claim_ms = 4000
    crashes = 0
    published_before_mark: Counter[str] = Counter()
    for round_ in range(3):
        if round_ == 2:
            await asyncio.sleep(claim_ms / 1000 + 0.2)  # the first claim expires: re-published
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            pg_dsn,
            REDIS_URL,
            prefix,
            str(claim_ms),
            "5",
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == -signal.SIGKILL, out
        crashes += 1
        published_before_mark.update(out.decode().split())
    # 5 + 5 + the first row again: a row whose claim was lost is claimed alone.
    assert sum(published_before_mark.values()) == 11
    assert published_before_mark["order:0"] == 2
    rows = await _rows(pool)
    assert {r[1] for r in rows} == {"PENDING"}
    await asyncio.sleep(claim_ms / 1000 + 0.2)
    recorder = Recorder("q")
    async with (
        BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher,
        Workers([recorder], redis_url=REDIS_URL, prefix=prefix),
    ):
        relay = OutboxRelay(PostgresOutboxStore(pool), publisher, claim_ms=claim_ms)
        while await relay.run_once():
            pass
        await _until(lambda: _true(len(recorder.done) == 10), what="10 deliveries")
        await asyncio.sleep(0.3)
    rows = await _rows(pool)
    assert {r[1] for r in rows} == {"PUBLISHED"}
    redis_jobs = len(await _job_keys(redis, prefix, "q"))
    deliveries = Counter(recorder.done)
    assert redis_jobs == 10
    job_ids = await _job_ids(pool)
    assert set(deliveries) == {job_ids[k] for k in keys}
    assert max(deliveries.values()) == 1
    _report(
        f"OB-01 crashes={crashes} publishes={sum(published_before_mark.values()) + 10}"
        f" redis_jobs={redis_jobs} lost=0 consumer_duplicates={sum(deliveries.values()) - 10}"
    )


class _Switch:
    """A publisher that goes to a dead Redis until ``up`` is set; counts its calls."""

    def __init__(self, down: BullMQPublisher, up: BullMQPublisher) -> None:
        self.down, self.up, self.use_up = down, up, False
        self.calls = 0

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        self.calls += 1
        return await (self.up if self.use_up else self.down).publish(messages)


@pytest.mark.slow
async def test_redis_down_then_back(
    pool: AsyncConnectionPool[Any], redis: aioredis.Redis, prefix: str
) -> None:
    """OB-02: nothing marked, attempts not counted, no busy loop; the backlog drains after."""
    keys = [f"k{i}" for i in range(30)]
    await _enqueue(pool, keys, "q")
    down = BullMQPublisher.from_url(f"redis://127.0.0.1:{free_port()}", prefix=prefix)
    up = BullMQPublisher.from_url(REDIS_URL, prefix=prefix)
    switch = _Switch(down, up)
    async with down, up:
        relay = OutboxRelay(
            PostgresOutboxStore(pool), switch, poll_interval_ms=100, unavailable_max_ms=1000
        )
        async with relay:
            await asyncio.sleep(3.0)
            calls_while_down = switch.calls
            assert not relay.state.broker_available
            rows = await _rows(pool)
            assert {(r[1], r[2]) for r in rows} == {("PENDING", 0)}
            assert all("unavailable" in (r[3] or "") for r in rows)
            switch.use_up = True
            started = time.monotonic()

            async def drained() -> bool:
                return {r[1] for r in await _rows(pool)} == {"PUBLISHED"}

            await _until(drained, timeout=10, what="the backlog to drain")
            drain_s = time.monotonic() - started
    assert 2 <= calls_while_down <= 8  # 0.5 s, then 1 s back-offs: no busy loop
    assert len(await _job_keys(redis, prefix, "q")) == 30
    _report(
        f"OB-02 claims_in_3s_down={calls_while_down} backlog_peak=30 drain_s={drain_s:.2f} lost=0"
    )


async def test_poison_message_dead_letters(
    pool: AsyncConnectionPool[Any], redis: aioredis.Redis, prefix: str
) -> None:
    """OB-13: a job over max_job_bytes is retried, then DEAD; the rows behind it publish at once."""
    outbox = Outbox(max_attempts=3)
    async with pool.connection() as conn, conn.transaction():
        await outbox.enqueue_once(
            conn, idempotency_key="poison", queue="q", name="n", payload={"blob": "x" * 4000}
        )
        for i in range(5):
            await outbox.enqueue_once(
                conn, idempotency_key=f"ok{i}", queue="q", name="n", payload={"i": i}
            )
    async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix, max_job_bytes=1024) as pub:
        relay = OutboxRelay(
            PostgresOutboxStore(pool, outbox=outbox), pub, batch_size=2, retry_base_ms=50
        )
        started = time.monotonic()
        good_at = None
        while time.monotonic() - started < 10:
            await relay.run_once()
            rows = {r[0]: r for r in await _rows(pool)}
            if good_at is None and all(rows[f"ok{i}"][1] == "PUBLISHED" for i in range(5)):
                good_at = time.monotonic() - started
            if rows["poison"][1] == "DEAD" and good_at is not None:
                break
            await asyncio.sleep(0.05)
    poison = rows["poison"]
    assert poison[1:3] == ("DEAD", 3)
    assert "JobTooLargeError" in poison[3]
    assert good_at is not None
    assert good_at < 1.0
    assert len(await _job_keys(redis, prefix, "q")) == 5
    _report(f"OB-13 head_of_line_block_s={good_at:.3f} dlq=1")


class _Recording:
    def __init__(self, inner: BullMQPublisher, sink: Counter[str]) -> None:
        self.inner, self.sink = inner, sink

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        self.sink.update(m.idempotency_key for m in messages)
        return await self.inner.publish(messages)


@pytest.mark.slow
async def test_four_relays_publish_each_row_once(
    pg_dsn: str, pool: AsyncConnectionPool[Any], redis: aioredis.Redis, prefix: str
) -> None:
    """OB-09: four relays (own pools and publishers) on 200 rows: each row published once."""
    keys = [f"row-{i}" for i in range(200)]
    await _enqueue(pool, keys, "q")
    published: Counter[str] = Counter()
    async with contextlib.AsyncExitStack() as stack:
        relays = []
        for _ in range(4):
            p = await stack.enter_async_context(
                AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False)
            )
            pub = await stack.enter_async_context(
                BullMQPublisher.from_url(REDIS_URL, prefix=prefix)
            )
            relays.append(
                OutboxRelay(PostgresOutboxStore(p), _Recording(pub, published), batch_size=10)
            )
        started = time.monotonic()
        for relay in relays:
            await stack.enter_async_context(relay)

        async def all_published() -> bool:
            return (await relays[0].stats()).published == 200

        await _until(all_published, timeout=30, what="200 rows published")
        elapsed = time.monotonic() - started
    assert set(published) == set(keys)
    assert max(published.values()) == 1
    assert len(await _job_keys(redis, prefix, "q")) == 200
    assert sum(r.state.published for r in relays) == 200
    _report(f"OB-09 relays=4 rows=200 dup_publishes=0 msgs_per_s={200 / elapsed:.0f}")


# --------------------------------------------------------------------------- workers


async def _add(redis: aioredis.Redis, prefix: str, queue: str, name: str, **opts: Any) -> str:
    job = await Queue(queue, {"connection": redis, "prefix": prefix}).add(
        name, {"key": name}, {"jobId": f"job-{name}", **opts}
    )
    return str(job.id)


async def _state(redis: aioredis.Redis, prefix: str, queue: str, job_id: str) -> str:
    return str(await Queue(queue, {"connection": redis, "prefix": prefix}).getJobState(job_id))


@pytest.mark.slow
async def test_retries_follow_the_backoff(redis: aioredis.Redis, prefix: str) -> None:
    """Fails twice, succeeds on attempt 3; gaps ≈ 200 ms and 400 ms (not rounded up to 1 s)."""
    recorder = Recorder("retry", fail_times=2)
    async with Workers([recorder], redis_url=REDIS_URL, prefix=prefix) as workers:
        await workers.wait_ready()
        job_id = await _add(
            redis, prefix, "retry", "r", attempts=3, backoff={"type": "exponential", "delay": 200}
        )
        await _until(lambda: _true(len(recorder.completed) == 1), what="the third attempt")
    assert [a[1] for a in recorder.attempts] == [0, 1, 2]
    assert recorder.failures == [(job_id, False, 1), (job_id, False, 2)]
    times = [a[2] for a in recorder.attempts]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    _report(f"retry gaps (delay 200 ms, exponential): {[round(g * 1000) for g in gaps]} ms")
    assert 0.9 * 0.2 <= gaps[0] <= 0.9, gaps  # the rounding trap gives ≥ 1.0 s here
    assert 0.9 * 0.4 <= gaps[1] <= 0.4 + 1.0, gaps
    assert await _state(redis, prefix, "retry", job_id) == "completed"


@pytest.mark.slow
async def test_unpatched_bullmq_worker_rounds_waits_up(redis: aioredis.Redis, prefix: str) -> None:
    """The trap Workers works around (RESEARCH.md): a bare Worker retries after ≥ 1 s.

    If this fails, bullmq now reads the Redis version itself and the workaround can go.
    """
    seen: list[float] = []

    async def handler(job: Any, token: str) -> None:
        seen.append(time.monotonic())
        if len(seen) == 1:
            raise RuntimeError("first attempt fails")

    worker = Worker("bare", handler, {"connection": REDIS_URL, "prefix": prefix, "autorun": False})
    run = asyncio.create_task(worker.run())
    try:
        await _add(redis, prefix, "bare", "b", attempts=2, backoff={"type": "fixed", "delay": 200})
        await _until(lambda: _true(len(seen) == 2), what="the retry")
    finally:
        # As Workers closes: a bounded wait, then the processing (a blocked fetch) cancelled.
        # A bare close() can wait on its fetch for good, and once the test's loop is torn down
        # it spins (bullmq re-awaits its cancelled teardown).
        closing = asyncio.ensure_future(worker.close())
        done, _ = await asyncio.wait({closing}, timeout=10)
        if not done:
            worker.cancelProcessing()
            await asyncio.wait({closing}, timeout=10)
        await asyncio.wait({run}, timeout=10)
        for task in (closing, run):
            if not task.done():
                pytest.fail(f"the bare bullmq Worker did not close: {task!r}")
    assert seen[1] - seen[0] >= 0.95


async def test_final_failure_calls_hook_and_logs(
    redis: aioredis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sdcore.queues")
    recorder = Recorder("fail", fail_times=99)
    async with Workers([recorder], redis_url=REDIS_URL, prefix=prefix):
        job_id = await _add(redis, prefix, "fail", "f", attempts=2, backoff=50)
        await _until(lambda: _true(len(recorder.failures) == 2), what="two failures")
    assert recorder.failures == [(job_id, False, 1), (job_id, True, 2)]
    assert await _state(redis, prefix, "fail", job_id) == "failed"
    final = [r for r in caplog.records if getattr(r, "action", "") == "job_failed_final"]
    assert len(final) == 1
    record: Any = final[0]
    assert record.levelno == logging.ERROR
    assert (record.queue, record.job_id, record.job_name, record.attempts) == (
        "fail",
        job_id,
        "f",
        2,
    )
    assert "planned failure 2" in record.getMessage()
    assert [getattr(r, "action", "") for r in caplog.records].count("job_retry") == 1


class _RaisingHooks(Recorder):
    async def on_completed(self, job: Job, result: Any) -> None:
        await super().on_completed(job, result)
        raise RuntimeError("hook bug")

    async def on_failed(self, job: Job, error: BaseException, final: bool) -> None:
        await super().on_failed(job, error, final)
        raise RuntimeError("hook bug")


async def test_raising_hooks_change_nothing(
    redis: aioredis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A raising ``completed`` hook must not turn into BullMQ's "Missing lock" failure."""
    caplog.set_level(logging.INFO, logger="sdcore.queues")
    recorder = _RaisingHooks("hooks", fail_times=1)
    async with Workers([recorder], redis_url=REDIS_URL, prefix=prefix):
        job_id = await _add(redis, prefix, "hooks", "h", attempts=2, backoff=10)
        await _until(lambda: _true(len(recorder.completed) == 1), what="completion")
    assert await _state(redis, prefix, "hooks", job_id) == "completed"
    actions = [getattr(r, "action", "") for r in caplog.records]
    assert actions.count("hook_failed") == 2
    assert "worker_error" not in actions
    assert not [r for r in caplog.records if "Missing lock" in r.getMessage()]


async def test_close_resends_a_lost_cancellation_of_the_idle_wait(
    redis: aioredis.Redis, prefix: str
) -> None:
    """bullmq's close cancels its idle wait for the next job once; a cancellation lost inside
    redis-py (the close then hangs) must not hang Workers.close. Injected here: the
    worker's next wait swallows the first cancellation, as the lost one did."""
    recorder = Recorder("idle")
    workers = Workers([recorder], redis_url=REDIS_URL, prefix=prefix)
    await workers.start()
    await workers.wait_ready()
    backend = workers._entries[0].worker.backend
    swallowed: list[float] = []

    async def stubborn(block_timeout: float) -> Any:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.append(time.monotonic())  # lost: the wait goes on
        await asyncio.sleep(3600)

    backend.waitForJob = stubborn
    job_id = await _add(redis, prefix, "idle", "i")  # wakes the real wait; the next is stubborn
    await _until(lambda: _true(recorder.done == [job_id]), what="the job")
    await asyncio.sleep(0.3)  # the worker is back in its (stubborn) wait for the next job
    started = time.monotonic()
    async with asyncio.timeout(10):
        await workers.close()
    assert len(swallowed) == 1, "the injected wait never saw bullmq's cancellation"
    assert time.monotonic() - started < 3


async def test_close_waits_for_the_running_job(redis: aioredis.Redis, prefix: str) -> None:
    recorder = Recorder("slow", sleep_s=1.0)
    workers = Workers([recorder], redis_url=REDIS_URL, prefix=prefix)
    await workers.start()
    job_id = await _add(redis, prefix, "slow", "s")
    await _until(lambda: _true(len(recorder.attempts) == 1), what="the job to start")
    started = time.monotonic()
    await workers.close()
    assert time.monotonic() - started >= 0.5
    assert recorder.done == [job_id]
    assert recorder.completed == [(job_id, {"ok": "s"})]  # hooks awaited too
    assert await _state(redis, prefix, "slow", job_id) == "completed"


async def test_close_after_grace_cancels_the_job(redis: aioredis.Redis, prefix: str) -> None:
    recorder = Recorder("stuck", sleep_s=30.0)
    workers = Workers([recorder], redis_url=REDIS_URL, prefix=prefix)
    await workers.start()
    job_id = await _add(redis, prefix, "stuck", "s")
    await _until(lambda: _true(len(recorder.attempts) == 1), what="the job to start")
    started = time.monotonic()
    await workers.close(grace_s=0.3)
    assert time.monotonic() - started < 3
    assert recorder.done == []
    # Left active; once its lock expires BullMQ hands it to another worker.
    assert await _state(redis, prefix, "stuck", job_id) == "active"


async def test_workers_start_while_redis_is_down(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sdcore.queues")
    workers = Workers([Recorder("q")], redis_url=f"redis://127.0.0.1:{free_port()}")
    await workers.start()  # returns at once: the application starts without Redis
    await asyncio.sleep(0.5)
    assert not workers.ready
    started = time.monotonic()
    await workers.close()
    assert time.monotonic() - started < 3


class _SyncProcess(Processor):
    queue = "q"

    def process(self, job: Job) -> Any:
        return None


class _NoProcess(Processor):
    queue = "q"


class _BadQueue(Recorder):
    pass


def test_invalid_processors_are_refused() -> None:
    with pytest.raises(InvalidProcessorError, match="async def"):
        Workers([_SyncProcess()], redis_url=REDIS_URL)
    with pytest.raises(InvalidProcessorError, match="not implemented"):
        Workers([_NoProcess()], redis_url=REDIS_URL)
    with pytest.raises(InvalidProcessorError, match="queue"):
        Workers([_BadQueue("a:b")], redis_url=REDIS_URL)
    bad = Recorder("q")
    bad.concurrency = 0
    with pytest.raises(InvalidProcessorError, match="concurrency"):
        Workers([bad], redis_url=REDIS_URL)
    with pytest.raises(ValueError, match="one processor per queue"):
        Workers([Recorder("q"), Recorder("q")], redis_url=REDIS_URL)
    with pytest.raises(ValueError, match="redis_url"):
        Workers([Recorder("q")], redis_url="")


async def test_the_server_check_wraps_redis_errors() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}", decode_responses=True)
    try:
        with pytest.raises(RedisUnavailableError, match="Redis unavailable") as caught:
            await check_redis_server(client)
        assert isinstance(caught.value.__cause__, aioredis.ConnectionError)
        publisher = BullMQPublisher(client)
        message = OutboxMessage(
            id=1, idempotency_key="k", queue="q", name="n", job_id="sd2-" + "0" * 64,
            payload={}, options={}, attempts=1, max_attempts=3, created_at=datetime.now(UTC),
        )  # fmt: skip
        with pytest.raises(PublisherUnavailableError):
            await publisher.publish([message])
    finally:
        await client.aclose()
