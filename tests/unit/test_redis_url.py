"""Redis URLs: plain ones pass through, Sentinel ones are read in full, bad ones are named."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from sdcore._internal.redis_client import MasterConnection, SentinelRedis, open_redis
from sdcore._internal.redis_url import (
    ClusterTarget,
    RedisHost,
    RedisUrlError,
    SentinelHost,
    SentinelTarget,
    check_cluster_prefix,
    check_redis_url,
    hash_tag,
)
from sdcore.queues import BullMQPublisher, Processor, Workers, queues_enabled
from sdcore.queues._redis import client_option, connect, worker_connection


@pytest.mark.parametrize(
    "url", ["redis://h:6379/0", "rediss://u:p@h:6380", "unix:///run/redis.sock", " REDIS://h "]
)
def test_a_plain_url_is_left_to_redis_py(url: str) -> None:
    assert check_redis_url(url) is None


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+sentinel://a:26379,b:26380/mymaster",
            SentinelTarget(
                sentinels=(SentinelHost(host="a", port=26379), SentinelHost(host="b", port=26380)),
                service_name="mymaster",
            ),
        ),
        (
            "redis+sentinel://:s%40cret@a:26379/cache/3?sentinel_password=sp",
            SentinelTarget(
                sentinels=(SentinelHost(host="a", port=26379),),
                service_name="cache",
                db=3,
                password="s@cret",
                sentinel_password="sp",
            ),
        ),
        (
            "redis+sentinel://app:pw@[::1]:26379/m/",
            SentinelTarget(
                sentinels=(SentinelHost(host="::1", port=26379),),
                service_name="m",
                username="app",
                password="pw",
            ),
        ),
        (
            "redis+sentinel://pw@a:1/m",
            SentinelTarget(
                sentinels=(SentinelHost(host="a", port=1),), service_name="m", password="pw"
            ),
        ),
    ],
    ids=["two-sentinels", "password-db-sentinel-password", "ipv6-user", "lone-password"],
)
def test_a_sentinel_url_is_read_in_full(url: str, expected: SentinelTarget) -> None:
    assert check_redis_url(url) == expected


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("localhost:6379", "scheme 'localhost'"),
        ("rediss+sentinel://a:1/m", "scheme 'rediss\\+sentinel'"),
        ("redis+sentinel:/a:1/m", "must start with redis\\+sentinel://"),
        ("redis+sentinel://a:26379", "service name"),
        ("redis+sentinel://a/m", "needs host:port"),
        ("redis+sentinel://a:1,,b:2/m", "at least one sentinel"),
        ("redis+sentinel://a:0/m", "bad port"),
        ("redis+sentinel://a:x/m", "bad port"),
        ("redis+sentinel://a:1/m/one", "must be a number"),
        ("redis+sentinel://a:1/m?ssl=true", "unknown redis\\+sentinel URL option"),
        ("redis+cluster://a:1/3", "takes no path: a cluster has database 0 only"),
        ("redis+cluster://a:1?read_from_replicas=1", "takes no options"),
        ("redis+cluster://a", "cluster node 'a' needs host:port"),
        ("redis+cluster://", "must start with redis\\+cluster:// and name a cluster node"),
    ],
    ids=[
        "no-scheme",
        "tls",
        "one-slash",
        "no-service",
        "no-port",
        "empty-host",
        "port-0",
        "port-word",
        "db-word",
        "unknown-option",
        "cluster-db",
        "cluster-option",
        "cluster-no-port",
        "cluster-no-host",
    ],
)
def test_a_bad_url_names_the_problem(url: str, problem: str) -> None:
    with pytest.raises(RedisUrlError, match=problem):
        check_redis_url(url)
    with pytest.raises(ValueError, match=problem):
        queues_enabled(url)


def test_an_error_never_shows_the_password() -> None:
    with pytest.raises(RedisUrlError) as caught:
        check_redis_url("redis+sentinel://:hunter2@a:1/m/x")
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://:hun/ter2@h:7000",
        "redis+cluster://user:hun?ter2@h:7000",
        "redis+sentinel://:hun/ter2@h:26379/mymaster",
    ],
)
def test_an_unencoded_slash_in_a_password_is_named_and_the_password_never_shown(
    url: str,
) -> None:
    # The URL is cut at the first "/" or "?": the password's start would read as a host.
    problem = "password holds a '/' or '\\?': percent-encode"
    with pytest.raises(RedisUrlError, match=problem) as caught:
        check_redis_url(url)
    assert "hun" not in str(caught.value)


async def test_a_sentinel_url_builds_a_master_client_that_closes_its_sentinels() -> None:
    client = connect(
        "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/2",
        socket_timeout_s=2.0,
        connect_timeout_s=0.5,
    )
    assert isinstance(client, SentinelRedis)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "mymaster"
    assert pool.connection_class is MasterConnection
    assert pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["password"] == "pw"
    assert pool.connection_kwargs["decode_responses"] is True
    assert client.owner is not None
    assert [s.connection_pool.connection_kwargs["port"] for s in client.owner.sentinels] == [1, 2]
    assert client.owner.sentinels[0].connection_pool.connection_kwargs["socket_timeout"] == 0.5
    await client.aclose()
    await client.aclose()  # twice: bullmq closes the shared client once per role


async def test_a_plain_url_builds_a_plain_client() -> None:
    client = open_redis(
        "redis://127.0.0.1:1/4", decode_responses=False, socket_timeout_s=1, connect_timeout_s=1
    )
    assert type(client) is Redis
    assert client.connection_pool.connection_kwargs["db"] == 4
    await client.aclose()


async def test_workers_get_a_plain_url_as_is_and_a_client_for_sentinel() -> None:
    assert worker_connection(" redis://h:6379/1 ") == "redis://h:6379/1"
    client = worker_connection("redis+sentinel://127.0.0.1:1/mymaster")
    assert isinstance(client, SentinelRedis)
    # No command timeout: the worker's blocking wait lasts seconds.
    assert client.connection_pool.connection_kwargs["socket_timeout"] is None
    await client.aclose()


async def test_the_publisher_waits_for_a_replica_by_default_only_on_sentinel() -> None:
    plain = BullMQPublisher.from_url("redis://127.0.0.1:1", check_server=False)
    sentinel = BullMQPublisher.from_url("redis+sentinel://127.0.0.1:1/m", check_server=False)
    assert (plain._min_replicas, sentinel._min_replicas) == (0, 1)
    await plain.close()
    await sentinel.close()


async def test_a_replica_wait_not_shorter_than_the_socket_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="replica_timeout_ms \\(2000\\) must be shorter"):
        BullMQPublisher.from_url(
            "redis+sentinel://127.0.0.1:1/m", socket_timeout_s=2.0, replica_timeout_ms=2000
        )
    with pytest.raises(ValueError, match="min_replicas"):
        BullMQPublisher.from_url("redis://127.0.0.1:1", min_replicas=-1)


def test_the_runtime_refuses_a_bad_redis_url_at_construction() -> None:
    from sdcore.runtime import Runtime

    with pytest.raises(ValueError, match="service name"):
        Runtime("postgresql://db/app", redis_url="redis+sentinel://s1:26379")
    assert Runtime("postgresql://db/app", redis_url="redis+sentinel://s1:26379/m").queues_enabled


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+cluster://a:7000,b:7001",
            ClusterTarget(nodes=(RedisHost(host="a", port=7000), RedisHost(host="b", port=7001))),
        ),
        (
            "redis+cluster://app:p%40ss@[::1]:7000/",
            ClusterTarget(
                nodes=(RedisHost(host="::1", port=7000),), username="app", password="p@ss"
            ),
        ),
        ("REDIS+CLUSTER://a:1/0", ClusterTarget(nodes=(RedisHost(host="a", port=1),))),
    ],
    ids=["two-nodes", "ipv6-user-slash", "upper-case-db-0"],
)
def test_a_cluster_url_is_read_in_full(url: str, expected: ClusterTarget) -> None:
    assert check_redis_url(url) == expected
    assert queues_enabled(url)


@pytest.mark.parametrize(
    ("key", "tag"),
    [
        ("{bull}:q:wait", "bull"),
        ("app:{bull}:q:1", "bull"),
        ("{}{bull}:q", None),  # an empty first tag: the whole key is hashed
        ("bull:q:wait", None),
        ("{bull:q", None),
        ("a{b}{c}", "b"),
    ],
)
def test_the_hash_tag_is_read_as_redis_reads_it(key: str, tag: str | None) -> None:
    assert hash_tag(key) == tag


def test_a_cluster_prefix_without_a_hash_tag_is_refused_by_name() -> None:
    check_cluster_prefix("{bull}")
    with pytest.raises(ValueError, match=r"must hold a hash tag, e.g. '\{bull\}'.*got 'bull'"):
        check_cluster_prefix("bull")


async def test_a_cluster_url_builds_a_cluster_client_for_publisher_and_workers() -> None:
    url = "redis+cluster://:pw@127.0.0.1:1,127.0.0.1:2"
    client = connect(url, socket_timeout_s=2.0, connect_timeout_s=0.5)
    assert isinstance(client, RedisCluster)
    assert [(n.host, n.port) for n in client.nodes_manager.startup_nodes.values()] == [
        ("127.0.0.1", 1),
        ("127.0.0.1", 2),
    ]
    assert client_option(client, "password") == "pw"
    assert client_option(client, "decode_responses") is True
    assert client_option(client, "socket_timeout") == 2.0
    await client.aclose()
    worker = worker_connection(url)
    assert isinstance(worker, RedisCluster)
    assert client_option(worker, "socket_timeout") is None  # the blocking wait lasts seconds
    await worker.aclose()


class _Mails(Processor):
    queue = "mails"

    async def process(self, job: object) -> None:
        return None


async def test_the_queues_refuse_an_untagged_prefix_on_a_cluster() -> None:
    url = "redis+cluster://127.0.0.1:1"
    with pytest.raises(ValueError, match="must hold a hash tag"):
        BullMQPublisher.from_url(url)
    with pytest.raises(ValueError, match="must hold a hash tag"):
        Workers([_Mails()], redis_url=url)
    publisher = BullMQPublisher.from_url(url, prefix="{bull}", check_server=False)
    assert publisher._min_replicas == 0
    await publisher.close()
    Workers([_Mails()], redis_url=url, prefix="{bull}")


def test_the_runtime_refuses_an_untagged_prefix_on_a_cluster_at_construction() -> None:
    from sdcore.runtime import Runtime

    with pytest.raises(ValueError, match="must hold a hash tag"):
        Runtime("postgresql://db/app", redis_url="redis+cluster://n1:6379")
    runtime = Runtime(
        "postgresql://db/app", redis_url="redis+cluster://n1:6379", queue_prefix="{bull}"
    )
    assert runtime.queues_enabled
