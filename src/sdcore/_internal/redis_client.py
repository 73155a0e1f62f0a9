"""The one place where ``redis.asyncio`` clients are built from a Redis URL.

A plain URL gives ``Redis.from_url``; a ``redis+sentinel://`` URL gives redis-py's
``Sentinel(…).master_for(service_name)`` client, whose pool asks the sentinels for the master's
address before each new connection, drops every pooled connection when that address changes,
and turns a demoted master's ``READONLY`` reply into a connection error (the connection is
closed, the next one goes to the new master): it follows a failover without a restart. A
``redis+cluster://`` URL gives redis-py's ``RedisCluster``, which learns the slot map from the
startup nodes, routes each command to the master of its keys' slot and re-reads the map on
``MOVED`` or a connection error (a failover, a resharding).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection

from sdcore._internal.redis_url import ClusterTarget, check_redis_url

# What open_redis builds: one server (plain or Sentinel-managed) or a cluster.
AnyRedis = Redis | RedisCluster


class MasterConnection(SentinelManagedConnection):
    """A Sentinel-managed connection that asks for the master on *every* (re)connect.

    redis-py reconnects a connection dropped inside a command's retry (``send_packed_command``)
    through ``connect_check_health`` with the address it had, not through the sentinel lookup:
    after a failover such a retry kept dialling the dead master until its retries ran out (a
    bullmq worker then waited forever on it). Here every connect asks the sentinels first.
    """

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        """Point the connection at the current master, then connect as redis-py does."""
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(
            check_health=check_health, retry_socket_connect=retry_socket_connect
        )

    async def connect_to(self, address: tuple[str, int]) -> None:
        """Connect to ``address``, which the pool's own lookup has just given (asked once)."""
        self.host, self.port = address
        await super().connect_check_health(
            check_health=self.connection_pool.check_connection, retry_socket_connect=False
        )


class SentinelRedis(Redis):
    """A ``master_for`` client that also closes its connections to the sentinels."""

    owner: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        """Close the master's connections, then the sentinels' (again: a no-op)."""
        await super().aclose(close_connection_pool)
        if self.owner is not None:
            for node in self.owner.sentinels:
                await node.aclose()


def open_redis(
    url: str,
    *,
    decode_responses: bool,
    socket_timeout_s: float | None,
    connect_timeout_s: float,
    retry: Retry | None = None,
    retry_on_error: list[type[Exception]] | None = None,
    health_check_interval: int = 0,
) -> AnyRedis:
    """Build a ``redis.asyncio`` client for a plain, Sentinel or Cluster URL (not connected yet).

    A Sentinel URL gives redis-py's ``Sentinel(…).master_for(service_name)`` client: the
    sentinels are asked for the master's address before each new connection, and closing the
    client closes its connections to the sentinels too. A Cluster URL gives a ``RedisCluster``
    started from the URL's nodes (commands go to masters only; ``retry`` also covers the
    cluster's own retries after a ``MOVED``, a dead node or ``CLUSTERDOWN``).

    Args:
        url: A URL :func:`check_redis_url` accepts.
        decode_responses: Return ``str`` replies.
        socket_timeout_s: Per-command timeout on the data node (``None``: wait; blocking
            commands need it).
        connect_timeout_s: Connection timeout, to data nodes and to sentinels; also the
            per-command timeout on sentinels, so a dead sentinel is skipped quickly.
        retry: redis-py's retry policy for commands on the data node.
        retry_on_error: Errors the retry policy retries besides its own.
        health_check_interval: Seconds of idleness after which a pooled connection is pinged.

    Raises:
        RedisUrlError: See :func:`check_redis_url`.
    """
    target = check_redis_url(url)
    options: dict[str, Any] = {
        "decode_responses": decode_responses,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "health_check_interval": health_check_interval,
    }
    if retry is not None:
        options["retry"] = retry
    if retry_on_error is not None:
        options["retry_on_error"] = retry_on_error
    if target is None:
        client: Redis = Redis.from_url(url.strip(), **options)
        return client
    if isinstance(target, ClusterTarget):
        return RedisCluster(
            startup_nodes=[ClusterNode(node.host, node.port) for node in target.nodes],
            username=target.username,
            password=target.password,
            **options,
        )
    sentinel = Sentinel(
        [(node.host, node.port) for node in target.sentinels],
        sentinel_kwargs={
            "socket_timeout": connect_timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "password": target.sentinel_password,
            "decode_responses": True,
        },
    )
    master: SentinelRedis = sentinel.master_for(
        target.service_name,
        redis_class=SentinelRedis,
        connection_class=MasterConnection,
        db=target.db,
        username=target.username,
        password=target.password,
        **options,
    )
    master.owner = sentinel
    return master
