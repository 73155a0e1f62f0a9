"""``BullMQPublisher``: the outbox relay's way into BullMQ queues."""

from __future__ import annotations

import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sdcore._internal.errors import error_text
from sdcore._internal.lifecycle import AsyncStartStop
from sdcore._internal.redact import redact_text
from sdcore._internal.redis_client import AnyRedis
from sdcore._internal.redis_url import (
    ClusterTarget,
    SentinelTarget,
    check_cluster_prefix,
    check_redis_url,
)
from sdcore._internal.telemetry import trace_option
from sdcore._internal.validation import int_between, non_empty_str, shown
from sdcore._json import MAX_JSON_BYTES
from sdcore.outbox import OutboxMessage, PublisherUnavailableError
from sdcore.queues._bullmq import Queue, sibling_queue
from sdcore.queues._errors import JobRejectedError, JobTooLargeError
from sdcore.queues._redis import (
    RedisServerInfo,
    check_client,
    check_redis_server,
    client_option,
    connect,
    is_cluster,
    is_unavailable,
    timed_out,
)

# BullMQ's own encoding of a job's data (compact, ASCII-only: its length in characters is its
# length in bytes), made once rather than per job as json.dumps would.
_COMPACT = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
DEFAULT_PREFIX = "bull"
# Outbox.enqueue_once refuses payloads over this many bytes in the same unit (sdcore._json.
# published_json_size): with the default, every message it accepted fits.
DEFAULT_MAX_JOB_BYTES = MAX_JSON_BYTES
# Queues kept between publishes (each a few KB once the scripts are shared); a batch touches at
# most batch_size of them, and one not kept is rebuilt from the shared connection in microseconds.
MAX_CACHED_QUEUES = 1024
# The key written (with a one-minute expiry) right before WAIT, under the prefix: one segment,
# so it is never taken for a queue's key.
REPLICATION_MARKER = "sdcore-replicated"


def check_prefix(prefix: object) -> str:
    """Validate a BullMQ key prefix (``bull`` by default; keys are ``{prefix}:{queue}:…``)."""
    text = non_empty_str("prefix", prefix, max_length=200)
    if "\x00" in text:
        raise ValueError(f"prefix must be a str without NUL, got {shown(text)}")
    return text


class BullMQPublisher(AsyncStartStop):
    """Publish outbox messages as BullMQ jobs; implements :class:`sdcore.outbox.Publisher`.

    Each message becomes ``queue.add(message.name, message.payload, {**message.options,
    "jobId": message.job_id})``: the job id comes from the idempotency key (``sd-`` + SHA-256
    hex, accepted by Node's BullMQ), so re-publishing a message after a relay crash is a no-op
    while the job is kept (``removeOnComplete``/``removeOnFail`` by age, a week by default).
    Messages of one queue go in one ``addBulk`` (a MULTI/EXEC pipeline); if that fails for a
    reason other than Redis being unavailable, they are re-sent one by one so the failure is
    attributed to the message that caused it.

    Errors: Redis unreachable, timing out, out of memory (``-OOM``), loading, read-only or
    refusing writes raise :class:`~sdcore.outbox.PublisherUnavailableError` (the relay backs off
    without counting an attempt). A message-specific problem is returned in that message's slot:
    :class:`JobTooLargeError` (data over ``max_job_bytes``), :class:`JobRejectedError`, or the
    error BullMQ raised.

    Use :meth:`from_url`, or pass a ``redis.asyncio.Redis`` or ``RedisCluster`` created with
    ``decode_responses=True`` (the publisher does not close a client it was given).

    On Redis Cluster each queue's keys must share a slot, so the prefix must hold a hash tag
    (``{bull}``): every queue of the prefix then lives on the master of that slot, and
    ``min_replicas`` waits for that master's replicas.

    Args:
        redis: The client.
        prefix: BullMQ key prefix (must match the workers').
        max_job_bytes: Largest compact JSON of a job's data, in bytes with non-ASCII escaped
            (``\\uXXXX``, as BullMQ stores it); bigger messages fail (and become dead in the
            outbox) instead of blocking the queue behind them. The default, 1 MiB, is the
            outbox's own limit in the same unit, so it refuses nothing ``enqueue_once``
            accepted.
        check_server: Check the eviction policy and persistence once, on first use.
        logger_name: Logger for warnings.
        min_replicas: Replicas that must hold a batch before it counts as published (Redis
            ``WAIT``, after every batch); ``0`` trusts the master's reply. Replication is
            asynchronous: when a Sentinel failover promotes a replica, the jobs the old master
            acknowledged but had not replicated are gone, yet their rows would be marked
            published. With ``min_replicas`` they stay pending (the publish raises
            :class:`~sdcore.outbox.PublisherUnavailableError`, the pooled connections are
            dropped so the next ones go to the master the sentinels name) and are published
            again there (the job ids dedup). While fewer replicas are up, nothing is published.
        replica_timeout_ms: How long ``WAIT`` waits for the replicas (must be shorter than
            the client's socket timeout).

    Raises:
        RedisClientError: ``redis`` is not a ``redis.asyncio`` ``Redis`` or ``RedisCluster``
            with ``decode_responses``.
        TypeError: A prefix or limit of the wrong type.
        ValueError: A prefix or limit out of range, a ``replica_timeout_ms`` not shorter than
            the socket timeout; on a cluster, a prefix without a hash tag.
    """

    def __init__(
        self,
        redis: AnyRedis,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
        check_server: bool = True,
        logger_name: str = "sdcore.queues",
        min_replicas: int = 0,
        replica_timeout_ms: int = 1_000,
    ) -> None:
        # 512 MiB: Redis' proto-max-bulk-len.
        int_between("max_job_bytes", max_job_bytes, 2, 512 * 1024 * 1024)
        self._redis = check_client(redis)
        self._min_replicas = int_between("min_replicas", min_replicas, 0, 100)
        self._replica_timeout_ms = int_between("replica_timeout_ms", replica_timeout_ms, 1, 60_000)
        self._cluster = is_cluster(self._redis)
        socket_timeout = client_option(self._redis, "socket_timeout")
        if min_replicas and socket_timeout and replica_timeout_ms >= socket_timeout * 1000:
            raise ValueError(
                f"replica_timeout_ms ({replica_timeout_ms}) must be shorter than the client's"
                f" socket timeout ({socket_timeout} s): WAIT would time out as a lost connection"
            )
        self._prefix = check_prefix(prefix)
        if self._cluster:
            check_cluster_prefix(self._prefix)
        self._max_job_bytes = max_job_bytes
        self._check = check_server
        self._logger_name = logger_name
        self._log = logging.getLogger(logger_name)
        self._owns_client = False
        self._queues: OrderedDict[str, Any] = OrderedDict()
        self._template: Any = None
        self._server: RedisServerInfo | None = None
        self._closed = False
        # On a cluster, whether bullmq's scripts were loaded on the masters (a cluster pipeline
        # sends EVALSHA without loading a missing script first).
        self._scripts_loaded = False

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        check_server: bool = True,
        logger_name: str = "sdcore.queues",
        min_replicas: int | None = None,
        replica_timeout_ms: int = 1_000,
    ) -> BullMQPublisher:
        """Create a publisher with its own client (closed by :meth:`close`).

        The client fails fast: a command that gets no answer within ``socket_timeout_s`` is an
        ambiguous publish, treated as unavailable (the relay re-publishes; the job id dedups).

        Args:
            url: ``redis://[user:password@]host:port/db``, ``rediss://…``, ``unix://…``,
                ``redis+sentinel://[[user]:password@]host:port[,host:port…]/service_name[/db]``
                (the client asks the sentinels for the master and follows a failover), or
                ``redis+cluster://[[user]:password@]host:port[,host:port…]`` (any of the
                cluster's nodes; the prefix must hold a hash tag, e.g. ``{bull}``).
            prefix: BullMQ key prefix.
            max_job_bytes: See the class.
            socket_timeout_s: Per-command timeout.
            connect_timeout_s: Connection timeout.
            check_server: See the class.
            logger_name: Logger for warnings.
            min_replicas: See the class; ``None`` (the default) means 1 for a Sentinel URL (a
                failover must not lose a published job) and 0 otherwise (on a cluster whose
                masters have replicas, pass 1).
            replica_timeout_ms: See the class.
        """
        target = check_redis_url(url)
        if min_replicas is None:
            min_replicas = 1 if isinstance(target, SentinelTarget) else 0
        if isinstance(target, ClusterTarget):
            check_cluster_prefix(prefix)  # before a client is built
        client = connect(
            url, socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s
        )
        publisher = cls(
            client,
            prefix=prefix,
            max_job_bytes=max_job_bytes,
            check_server=check_server,
            logger_name=logger_name,
            min_replicas=min_replicas,
            replica_timeout_ms=replica_timeout_ms,
        )
        publisher._owns_client = True
        return publisher

    @property
    def server(self) -> RedisServerInfo | None:
        """What the start-up check read (``None`` until it ran)."""
        return self._server

    async def stop(self) -> None:
        """Same as :meth:`close` (what leaving ``async with`` calls)."""
        await self.close()

    async def start(self) -> None:
        """Run the server check now; if Redis is down, retry it on the next publish.

        Never raises because Redis is unreachable: the application starts and the relay keeps
        its rows until Redis is back.
        """
        try:
            await self._ensure_checked()
        except PublisherUnavailableError as exc:
            self._log.warning(
                "Redis is not reachable yet (%s); the publisher will retry",
                redact_text(error_text(exc.__cause__ or exc)[:300]),
                extra={"action": "redis_unavailable"},
            )

    async def close(self) -> None:
        """Close the client if the publisher created it (queues hold no other resource)."""
        if self._closed:
            return
        self._closed = True
        self._queues.clear()
        self._template = None
        if self._owns_client:
            await self._redis.aclose()

    def _queue(self, name: str) -> Any:
        queue = self._queues.get(name)
        if queue is not None:
            self._queues.move_to_end(name)
            return queue
        # One bullmq Queue registers bullmq's Lua scripts once; every other queue shares its
        # connection and scripts, and only the most recently used are kept: the publisher's
        # memory does not grow with the number of queue names it has seen. Queue.close()
        # would close the shared client, so queues are never closed, only forgotten.
        if self._template is None:
            self._template = Queue(name, {"connection": self._redis, "prefix": self._prefix})
            queue = self._template
        else:
            queue = sibling_queue(self._template, name)
        self._queues[name] = queue
        if len(self._queues) > MAX_CACHED_QUEUES:
            self._queues.popitem(last=False)
        return queue

    async def _ensure_checked(self) -> None:
        if self._server is not None or not self._check:
            return
        try:
            self._server = await check_redis_server(self._redis, logger_name=self._logger_name)
        except Exception as exc:
            if is_unavailable(exc):
                raise PublisherUnavailableError(f"Redis unavailable: {error_text(exc)}") from exc
            raise

    def _job(self, message: OutboxMessage) -> dict[str, Any]:
        size = len(_COMPACT.encode(message.payload))
        if size > self._max_job_bytes:
            raise JobTooLargeError(message.job_id, size, self._max_job_bytes)
        return {
            "name": message.name,
            "data": message.payload,
            "opts": {**message.options, "jobId": message.job_id, **trace_option(message)},
        }

    async def publish(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        """Add each message as a BullMQ job; a job id that already exists is left as it is.

        Args:
            messages: Claimed outbox rows.

        Returns:
            ``None`` per message now in Redis (added or already there), or the error that
            stopped that message.

        Raises:
            PublisherUnavailableError: Redis is down, timing out or refusing writes; some
                messages of the batch may already be in Redis (publishing them again is a no-op).
                Its ``timeout_s`` is the socket timeout when a write got no answer within it.
        """
        if self._closed:
            raise RuntimeError("the publisher is closed")
        results: list[BaseException | None] = [None] * len(messages)
        if not messages:
            return results
        await self._ensure_checked()
        by_queue: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for index, message in enumerate(messages):
            try:
                job = self._job(message)
            except (ValueError, TypeError) as exc:
                results[index] = exc
                continue
            by_queue.setdefault(message.queue, []).append((index, job))
        for queue_name, jobs in by_queue.items():
            queue = self._queue(queue_name)
            try:
                added = await self._add_bulk(queue, [job for _, job in jobs])
            except Exception as exc:
                if is_unavailable(exc):
                    raise self._unavailable(exc) from exc
                await self._add_one_by_one(queue, jobs, results)
                continue
            for (index, job), result in zip(jobs, added, strict=True):
                if isinstance(result.id, int) and result.id < 0:
                    results[index] = JobRejectedError(job["opts"]["jobId"], result.id)
        if self._min_replicas and by_queue:
            await self._wait_replicated()
        return results

    async def _add_bulk(self, queue: Any, jobs: list[dict[str, Any]]) -> list[Any]:
        if not self._cluster:
            return list(await queue.addBulk(jobs))
        if not self._scripts_loaded:
            await self._load_scripts(queue)
        try:
            return list(await queue.addBulk(jobs))
        except redis_errors.NoScriptError:
            # A master that was a replica a moment ago (a failover) or was restarted has an
            # empty script cache: load the scripts on every master again, then retry once.
            await self._load_scripts(queue)
            return list(await queue.addBulk(jobs))

    async def _load_scripts(self, queue: Any) -> None:
        # SCRIPT LOAD on a cluster client goes to every master.
        for script in queue.redisConnection.commands.values():
            await self._redis.script_load(script.script)
        self._scripts_loaded = True

    async def _wait_replicated(self) -> None:
        # WAIT counts the replicas that acknowledged the last write of *its* connection, and the
        # batch's writes may have used other pooled connections: a marker write goes first on
        # WAIT's connection. It follows every write of the batch (all were answered), so a
        # replica that has it has the whole batch.
        marker = f"{self._prefix}:{REPLICATION_MARKER}"
        try:
            if isinstance(self._redis, RedisCluster):
                acked = await self._wait_on_slot_master(self._redis, marker)
            else:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.set(marker, "1", px=60_000)
                    pipe.execute_command("WAIT", self._min_replicas, self._replica_timeout_ms)
                    acked = int((await pipe.execute())[1])
        except Exception as exc:
            if isinstance(self._redis, RedisCluster):
                # The master may have changed (a failover): read the slot map again.
                with contextlib.suppress(Exception):
                    await self._redis.nodes_manager.initialize()
            raise self._unavailable(exc) from exc
        if acked >= self._min_replicas:
            return
        # A master whose replicas do not acknowledge may be a deposed one (its replica now
        # follows the master a Sentinel failover promoted): the next connections ask again.
        if isinstance(self._redis, Redis):
            await self._redis.connection_pool.disconnect()
        raise PublisherUnavailableError(
            f"Redis unavailable: {acked} of {self._min_replicas} replica(s) acknowledged the"
            f" batch within {self._replica_timeout_ms} ms"
        )

    async def _wait_on_slot_master(self, client: RedisCluster, marker: str) -> int:
        # The marker shares the prefix's hash tag, so its slot is every queue's slot: its
        # master took the batch. SET and WAIT go on one connection of that master (a cluster
        # pipeline would send the keyless WAIT to every master).
        node = client.get_node_from_key(marker)
        if node is None:
            raise redis_errors.ClusterDownError(f"no master serves the slot of {marker!r}")
        connection = node.acquire_connection()
        try:
            await connection.send_packed_command(
                connection.pack_commands(
                    [
                        ("SET", marker, "1", "PX", 60_000),
                        ("WAIT", self._min_replicas, self._replica_timeout_ms),
                    ]
                )
            )
            await connection.read_response()
            return int(await connection.read_response())
        except BaseException:
            await connection.disconnect()  # a reply may be left unread
            raise
        finally:
            node.release(connection)

    async def _add_one_by_one(
        self,
        queue: Any,
        jobs: list[tuple[int, dict[str, Any]]],
        results: list[BaseException | None],
    ) -> None:
        for index, job in jobs:
            try:
                await queue.add(job["name"], job["data"], job["opts"])
            except Exception as exc:
                if is_unavailable(exc):
                    raise self._unavailable(exc) from exc
                results[index] = exc

    def _unavailable(self, exc: BaseException) -> PublisherUnavailableError:
        # A write that got no answer within the socket timeout carries that timeout: the relay
        # then pings (ping()) to tell a broker that is down from a job too slow to write.
        timeout = client_option(self._redis, "socket_timeout")
        return PublisherUnavailableError(
            f"Redis unavailable: {redact_text(error_text(exc))}",
            timeout_s=float(timeout) if timed_out(exc) and timeout else None,
        )

    async def ping(self) -> bool:
        """Tell whether Redis answers a ``PING`` now (within the client's socket timeout).

        Any failure (refused, timed out, an error reply) is ``False``; only a reply is ``True``.
        """
        if self._closed:
            raise RuntimeError("the publisher is closed")
        try:
            await self._redis.ping()
        except Exception:  # noqa: BLE001 - any failure means "not answering"
            return False
        return True
