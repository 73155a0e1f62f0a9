"""Redis clients, the server checks run at start, and which errors mean "Redis is unavailable"."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from sdcore._internal.errors import error_text
from sdcore._internal.redact import redact_text
from sdcore._internal.redis_client import AnyRedis, open_redis
from sdcore._internal.redis_url import ClusterTarget, check_redis_url
from sdcore._internal.validation import positive_number
from sdcore.queues._errors import RedisClientError, RedisUnavailableError

# Replies that say "Redis cannot take writes right now", not "this message is bad": out of
# memory, loading, a failing RDB save, a read-only replica, a busy script, cluster trouble, ACL
# or auth problems. redis-py maps some codes to classes; the others are recognised by the reply's
# error code alone (its first word), never by words elsewhere in the text: redis-py puts the
# failing command, with its keys (prefix and queue name) and arguments, in front of an error
# inside a pipeline, and a queue named "TRUCK_LOADING" must not turn a poison into an outage.
_UNAVAILABLE_CLASSES: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError,  # includes AuthenticationError, BusyLoadingError
    redis_errors.TimeoutError,
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    redis_errors.TryAgainError,
    redis_errors.ClusterDownError,  # includes MasterDownError
    redis_errors.NoPermissionError,
    OSError,  # includes ConnectionRefusedError, socket errors
    TimeoutError,  # asyncio.TimeoutError in 3.11
)
_UNAVAILABLE_CODES = frozenset(
    {
        "OOM",
        "MISCONF",
        "LOADING",
        "READONLY",
        "MASTERDOWN",
        "NOREPLICAS",
        "BUSY",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "NOPERM",
        "NOAUTH",
    }
)
_ERROR_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
# What redis-py puts in front of the server's message for an error inside a pipeline. The
# server's message comes last and never holds this text, so the last occurrence is the real one.
_PIPELINE_ANNOTATION = " of pipeline caused error: "
_PIPELINE_HEAD = re.compile(r"Command # \d+ \(")
# Redis 6 and older wrap an error raised by redis.call inside a script (Redis 7 passes its code
# through): "ERR Error running script (call to f_<sha>): @user_script:41: @user_script: 41:
# -OOM command not allowed …". Only the code right after that fixed frame counts.
_SCRIPT_ERROR = re.compile(
    r"(?:ERR )?Error running script \(call to f_[0-9a-f]+\):(?: @user_script: ?\d+:)+"
    r" -([A-Z][A-Z0-9_]{0,63})(?: |$)"
)


def queues_enabled(redis_url: str | None) -> bool:
    """Tell whether queue features are configured (the seed's ``registerWhen(REDIS_URL)``).

    The library never reads environment variables: pass ``os.environ.get("REDIS_URL")``.
    ``None`` or a blank string means "no queues"; anything else must be a Redis URL, so a typo
    (``localhost:6379``) fails at start instead of silently turning the queues off. A Sentinel
    URL (``redis+sentinel://host:26379,host:26379/mymaster[/db]``) and a Cluster URL
    (``redis+cluster://host:6379,host:6379``) are checked in full here.

    Args:
        redis_url: The configured Redis URL, or ``None``.

    Returns:
        ``True`` when a Redis URL is set.

    Raises:
        ValueError: A non-blank value that is not a ``redis://``, ``rediss://``, ``unix://``, or
            valid ``redis+sentinel://`` or ``redis+cluster://`` URL (the message names the
            problem).
    """
    if redis_url is None or not redis_url.strip():
        return False
    check_redis_url(redis_url)
    return True


def is_cluster_url(url: str) -> bool:
    """Tell whether ``url`` is a ``redis+cluster://`` URL (checked in full)."""
    return isinstance(check_redis_url(url), ClusterTarget)


def is_cluster(client: object) -> bool:
    """Tell whether ``client`` is a ``redis.asyncio.cluster.RedisCluster``."""
    return isinstance(client, RedisCluster)


def client_option(client: AnyRedis, name: str) -> Any:
    """A connection setting of a client (``socket_timeout``, ``decode_responses``…)."""
    if isinstance(client, RedisCluster):
        return client.nodes_manager.connection_kwargs.get(name)
    return client.connection_pool.connection_kwargs.get(name)


def connect(url: str, *, socket_timeout_s: float, connect_timeout_s: float) -> AnyRedis:
    """Create a ``redis.asyncio`` client for BullMQ that fails fast when Redis is down.

    ``decode_responses=True`` (BullMQ needs it), two quick retries of a connection error (a stale
    pooled socket), then the error surfaces so the outbox relay can back off. On a cluster the
    retries also re-read the slot map, and a timeout is retried too (redis-py's cluster client
    retries both; the job id deduplicates a write sent twice).

    Raises:
        TypeError: A timeout that is not a number.
        ValueError: Not a Redis URL, or a timeout out of range.
    """
    if not queues_enabled(url):
        raise ValueError("a Redis URL is required")
    positive_number("socket_timeout_s", socket_timeout_s, maximum=3600)
    positive_number("connect_timeout_s", connect_timeout_s, maximum=3600)
    return open_redis(
        url,
        decode_responses=True,
        socket_timeout_s=socket_timeout_s,
        connect_timeout_s=connect_timeout_s,
        # Only connection errors are retried here; a timeout surfaces at once (an ambiguous
        # publish: the relay retries it later and the job id deduplicates it).
        retry=Retry(
            ExponentialBackoff(cap=0.5, base=0.05),
            2,
            supported_errors=(redis_errors.ConnectionError,),
        ),
        health_check_interval=30,
    )


def worker_connection(url: str) -> str | AnyRedis:
    """Return what a bullmq ``Worker`` gets as its ``connection`` option for ``url``.

    A plain URL is passed through: bullmq builds its two clients (commands, blocking wait) with
    its own long retry. bullmq cannot read a Sentinel URL, so for one a ``master_for`` client is
    built here, with no command timeout (the blocking wait lasts seconds) and a short retry of
    connection errors, which reconnects to whichever master the sentinels name; bullmq uses it
    for both roles (a pool: the blocking wait holds a connection of its own) and closes it.
    A Cluster URL gives a ``RedisCluster`` built the same way (bullmq runs its commands,
    scripts and blocking wait on it; each goes to the master of the queue's slot).

    Raises:
        ValueError: Not a Redis URL.
    """
    if check_redis_url(url) is None:
        return url.strip()
    return open_redis(
        url,
        decode_responses=True,
        socket_timeout_s=None,
        connect_timeout_s=5.0,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 20),
        retry_on_error=[redis_errors.BusyLoadingError, redis_errors.TimeoutError],
    )


def check_client(client: object) -> AnyRedis:
    """Check that ``client`` is a ``redis.asyncio`` ``Redis`` or ``RedisCluster`` with
    ``decode_responses=True``.

    Without it BullMQ's Python client silently misreads replies (``Queue.getJob`` returns
    ``None`` for a job that exists).

    Raises:
        RedisClientError: Another type, or ``decode_responses`` off.
    """
    if not isinstance(client, Redis | RedisCluster):
        raise RedisClientError(
            f"expected a redis.asyncio.Redis or RedisCluster, got {type(client).__module__}."
            f"{type(client).__qualname__}"
        )
    if not client_option(client, "decode_responses"):
        raise RedisClientError(
            "create it with decode_responses=True (BullMQ reads str replies; with bytes,"
            " Queue.getJob() returns None for jobs that exist)"
        )
    return client


def server_message(exc: BaseException) -> str:
    """Return a Redis reply error's message without redis-py's pipeline annotation.

    redis-py reports an error of a pipeline's n-th command as ``Command # n (<command and
    arguments>) of pipeline caused error: <server message>``; the server's message is returned.
    """
    text = str(exc.args[0]) if exc.args else ""
    head, found, tail = text.rpartition(_PIPELINE_ANNOTATION)
    if found and _PIPELINE_HEAD.match(head):
        return tail
    return text


def error_code(exc: BaseException) -> str | None:
    """Return the error code of a Redis reply error (``WRONGTYPE``, ``BUSY``, …), if any.

    The code is the first word of the server's reply (redis-py ≥ 8 keeps it as
    ``status_code``). An error that Redis 6 wrapped inside a script (``ERR Error running
    script … -OOM …``) gives the wrapped error's code. Words anywhere else in the text (the keys
    of the failing command, the queue name, the key prefix) are never read as a code.
    """
    if not isinstance(exc, redis_errors.ResponseError):
        return None
    message = server_message(exc)
    code = getattr(exc, "status_code", None)
    if not isinstance(code, str) or not code:
        first = message.split(" ", 1)[0]
        code = first if _ERROR_CODE.fullmatch(first) else None
    if code in (None, "ERR"):
        wrapped = _SCRIPT_ERROR.match(message)
        if wrapped is not None:
            return wrapped.group(1)
    return code


def timed_out(exc: BaseException) -> bool:
    """Tell whether a command failed by getting no answer within the socket timeout.

    By the exception's class (redis-py's or asyncio's timeout), or its direct cause's.
    """
    timeouts = (redis_errors.TimeoutError, TimeoutError)
    return isinstance(exc, timeouts) or isinstance(exc.__cause__, timeouts)


def is_unavailable(exc: BaseException) -> bool:
    """Tell whether an error means Redis cannot take writes now (retry later, not the message).

    Decided by the exception's class (connection errors, timeouts, and the reply codes redis-py
    maps to classes) and by the reply's error code (:func:`error_code`), never by words
    elsewhere in the message.
    """
    if isinstance(exc, _UNAVAILABLE_CLASSES):
        return True
    return error_code(exc) in _UNAVAILABLE_CODES


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisServerInfo:
    """What the start-up check read from Redis.

    Attributes:
        version: ``redis_version``.
        maxmemory_policy: The eviction policy (``None`` if the server hides it).
        aof_enabled: Whether the append-only file is on (``None`` if hidden).
        rdb_snapshots: Whether RDB save points are configured (``None`` if ``CONFIG`` is
            not allowed).
    """

    version: str | None
    maxmemory_policy: str | None
    aof_enabled: bool | None
    rdb_snapshots: bool | None

    @property
    def eviction_safe(self) -> bool:
        """``maxmemory-policy noeviction``: Redis never drops a job's keys to make room."""
        return self.maxmemory_policy == "noeviction"


async def _read_server(client: AnyRedis) -> tuple[dict[str, Any], bool | None]:
    if isinstance(client, RedisCluster):
        return await _read_cluster(client)
    try:
        info: dict[str, Any] = await client.info()
    except redis_errors.ResponseError as exc:  # INFO denied by an ACL: report "unknown"
        if is_unavailable(exc) and not isinstance(exc, redis_errors.NoPermissionError):
            raise
        info = {}
    rdb: bool | None
    try:
        saved = await client.config_get("save")
        rdb = bool(str(saved.get("save", "")).strip())
    except redis_errors.ResponseError:  # CONFIG is often renamed or denied on managed Redis
        rdb = None
    return info, rdb


async def _read_cluster(client: RedisCluster) -> tuple[dict[str, Any], bool | None]:
    """Every master's INFO and save points, folded into one: the weakest setting wins."""
    try:
        per_node: dict[str, dict[str, Any]] = await client.info(target_nodes=RedisCluster.PRIMARIES)
    except redis_errors.ResponseError as exc:
        if is_unavailable(exc) and not isinstance(exc, redis_errors.NoPermissionError):
            raise
        per_node = {}
    infos = list(per_node.values())
    info: dict[str, Any] = dict(infos[0]) if infos else {}
    unsafe = [i.get("maxmemory_policy") for i in infos if i.get("maxmemory_policy") != "noeviction"]
    if unsafe:
        info["maxmemory_policy"] = unsafe[0]
    if any(_flag(i.get("aof_enabled")) is False for i in infos):
        info["aof_enabled"] = 0
    rdb: bool | None
    try:
        # One {"save": …} per master (redis-py types the reply as one node's).
        saved: dict[Any, Any] = await client.config_get("save", target_nodes=RedisCluster.PRIMARIES)
        rdb = all(bool(str(node.get("save", "")).strip()) for node in saved.values())
    except redis_errors.ResponseError:
        rdb = None
    return info, rdb


def _flag(value: Any) -> bool | None:
    if value is None:
        return None
    try:
        return int(value) == 1
    except (TypeError, ValueError):
        return None


async def check_redis_server(
    client: AnyRedis, *, logger_name: str = "sdcore.queues"
) -> RedisServerInfo:
    """Read ``INFO`` (and ``CONFIG GET save``) and warn about settings that lose jobs.

    On a cluster every master is read, and the weakest setting among them is reported.

    Warns (``extra={"action": "redis_eviction_policy"}``) unless ``maxmemory-policy`` is
    ``noeviction``: any other policy lets Redis delete job hashes, locks and queue lists under
    memory pressure. Warns (``action="redis_persistence"``) when the append-only file is off: a
    Redis restart then loses the jobs added since the last RDB snapshot (or all of them without
    snapshots), although the outbox already marked them published.

    Args:
        client: A ``redis.asyncio`` ``Redis`` or ``RedisCluster`` (``decode_responses=True``).
        logger_name: Where the warnings go.

    Returns:
        What was read.

    Raises:
        RedisUnavailableError: Redis cannot be reached (the redis-py error is ``__cause__``).
    """
    log = logging.getLogger(logger_name)
    try:
        info, rdb = await _read_server(client)
    except (redis_errors.RedisError, OSError) as exc:
        detail = redact_text(error_text(exc)[:300])
        raise RedisUnavailableError(f"Redis unavailable: {detail}") from exc
    policy = info.get("maxmemory_policy")
    result = RedisServerInfo(
        version=None if info.get("redis_version") is None else str(info["redis_version"]),
        maxmemory_policy=None if policy is None else str(policy),
        aof_enabled=_flag(info.get("aof_enabled")),
        rdb_snapshots=rdb,
    )
    if not result.eviction_safe:
        log.warning(
            "Redis maxmemory-policy is %s, not noeviction: under memory pressure Redis may evict"
            " BullMQ keys (jobs, locks, queue lists) and lose or corrupt jobs; set"
            " maxmemory-policy noeviction",
            result.maxmemory_policy or "unknown",
            extra={"action": "redis_eviction_policy", "maxmemory_policy": result.maxmemory_policy},
        )
    if result.aof_enabled is False:
        if result.rdb_snapshots:
            risk = "a crash loses the jobs added since the last RDB snapshot"
        else:
            risk = "a restart loses every job (no AOF, no RDB snapshots)"
        log.warning(
            "Redis persistence is weak: appendonly is off, %s, although the outbox has marked"
            " them published; set appendonly yes, appendfsync everysec",
            risk,
            extra={
                "action": "redis_persistence",
                "aof_enabled": result.aof_enabled,
                "rdb_snapshots": result.rdb_snapshots,
            },
        )
    return result
