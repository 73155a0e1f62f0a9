"""Redis URLs, checked (the clients are built by :mod:`sdcore._internal.redis_client`).

A URL is a plain Redis URL (``redis://``, ``rediss://``, ``unix://``, as redis-py's ``from_url``
reads it), a Sentinel URL, in the form of the ``Redis-Sentinel-Url`` package::

    redis+sentinel://[[username]:password@]host:port[,host:port…]/service_name[/db]
        [?sentinel_password=…]

The hosts are the sentinels (the port is required: sentinels listen on 26379, not 6379); the
password is the data nodes' (master and replicas); ``sentinel_password`` is for sentinels that
require one (``requirepass`` in sentinel.conf).

or a Redis Cluster URL, in the same shape (the hosts are startup nodes: any of the cluster's
nodes, the client discovers the rest and follows slot moves and failovers)::

    redis+cluster://[[username]:password@]host:port[,host:port…][/]

A cluster has database 0 only, so the path is empty (``/0`` is accepted).

Parsing never imports redis: the runtime validates the URL at construction, before the queues
(and redis, an extra) are imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

PLAIN_SCHEMES = frozenset({"redis", "rediss", "unix"})
SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
_SENTINEL_OPTIONS = frozenset({"sentinel_password"})
# The largest index redis.conf's "databases" accepts.
MAX_DB = 2**31 - 1


class RedisUrlError(ValueError):
    """A Redis URL that cannot be used; the message names the problem, never the password."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisHost:
    """One server's address (a sentinel, or a cluster's startup node)."""

    host: str
    port: int


SentinelHost = RedisHost


@dataclass(frozen=True, slots=True, kw_only=True)
class SentinelTarget:
    """What a ``redis+sentinel://`` URL names.

    Attributes:
        sentinels: The sentinels to ask, in the URL's order (at least one).
        service_name: The monitored master's name (``mymaster`` in sentinel.conf).
        db: The database index on the master.
        username: ACL user of the data nodes, if any.
        password: Password of the data nodes, if any.
        sentinel_password: Password of the sentinels, if any.
    """

    sentinels: tuple[SentinelHost, ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterTarget:
    """What a ``redis+cluster://`` URL names.

    Attributes:
        nodes: Startup nodes, in the URL's order (at least one); the client learns the others.
        username: ACL user of the nodes, if any.
        password: Password of the nodes, if any.
    """

    nodes: tuple[RedisHost, ...]
    username: str | None = None
    password: str | None = None


def scheme_of(url: str) -> str:
    """Return a URL's scheme, lower-cased (``""`` for none)."""
    return urlsplit(url.strip()).scheme.lower()


def check_redis_url(url: str) -> SentinelTarget | ClusterTarget | None:
    """Check a Redis URL; return what a Sentinel or Cluster URL names, ``None`` for a plain one.

    Raises:
        RedisUrlError: An unknown scheme; a Sentinel URL without hosts, ports or service name,
            with a bad port or database, or with an unknown option; a Cluster URL without
            hosts or ports, with a bad port, a database other than 0, or any option.
    """
    scheme = scheme_of(url)
    if scheme in PLAIN_SCHEMES:
        return None
    if scheme == SENTINEL_SCHEME:
        return _parse_sentinel(url.strip())
    if scheme == CLUSTER_SCHEME:
        return _parse_cluster(url.strip())
    raise RedisUrlError(
        "the Redis URL must start with redis://, rediss://, unix://, redis+sentinel:// or "
        f"redis+cluster:// (got scheme {scheme or 'none'!r})"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _MultiHostUrl:
    """A ``scheme://[userinfo@]host:port[,host:port…][/path][?query]`` URL, cut in parts."""

    hosts: tuple[RedisHost, ...]
    username: str | None
    password: str | None
    path: str
    query: str


def _split_multi_host(url: str, scheme: str, role: str) -> _MultiHostUrl:
    # urlsplit cannot read "host:port,host:port" as a netloc (it would take one port), so the
    # parts are cut by hand: userinfo@hosts/path?query.
    rest = url[len(scheme) + 3 :] if url[len(scheme) :].lower().startswith("://") else ""
    if not rest:
        raise RedisUrlError(f"a {scheme} URL must start with {scheme}:// and name a {role}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        hosts, userinfo = netloc, ""
    username: str | None = None
    password: str | None = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if not colon:  # "scheme://secret@…": a lone word is the password, as in redis://
            username, password = None, unquote(user)
    try:
        parsed = tuple(_host(part, scheme, role) for part in hosts.split(","))
    except RedisUrlError:
        if not at and "@" in url[len(scheme) + 3 + len(netloc) :]:
            # The "host" is the start of a password cut at an unencoded "/" or "?": never shown.
            raise RedisUrlError(
                f"the {scheme} URL's user name or password holds a '/' or '?': percent-encode"
                " it (%2F, %3F)"
            ) from None
        raise
    return _MultiHostUrl(
        hosts=parsed,
        username=username,
        password=password,
        path=path,
        query=query,
    )


def _parse_cluster(url: str) -> ClusterTarget:
    parts = _split_multi_host(url, CLUSTER_SCHEME, "cluster node")
    if parts.path.strip("/") not in ("", "0"):
        raise RedisUrlError(
            f"a redis+cluster URL takes no path: a cluster has database 0 only (got "
            f"{'/' + parts.path!r})"
        )
    if parts.query:
        options = sorted(parse_qs(parts.query, keep_blank_values=True))
        raise RedisUrlError(f"a redis+cluster URL takes no options (got {options})")
    return ClusterTarget(nodes=parts.hosts, username=parts.username, password=parts.password)


def _parse_sentinel(url: str) -> SentinelTarget:
    parts = _split_multi_host(url, SENTINEL_SCHEME, "sentinel")
    query = parts.query
    service, _, db_text = parts.path.partition("/")
    service_name = unquote(service)
    if not service_name:
        raise RedisUrlError(
            "a redis+sentinel URL needs the master's service name as its path "
            "(redis+sentinel://host:26379/mymaster)"
        )
    db = _db(db_text.rstrip("/"))
    options = parse_qs(query, keep_blank_values=True, strict_parsing=False) if query else {}
    unknown = sorted(set(options) - _SENTINEL_OPTIONS)
    if unknown:
        raise RedisUrlError(
            f"unknown redis+sentinel URL option(s) {unknown}; known: {sorted(_SENTINEL_OPTIONS)}"
        )
    sentinel_password = options.get("sentinel_password", [None])[-1] or None
    return SentinelTarget(
        sentinels=parts.hosts,
        service_name=service_name,
        db=db,
        username=parts.username,
        password=parts.password,
        sentinel_password=sentinel_password,
    )


def _host(part: str, scheme: str, role: str) -> RedisHost:
    text = part.strip()
    if not text:
        raise RedisUrlError(f"a {scheme} URL needs at least one {role} host:port")
    if text.startswith("["):  # [::1]:26379
        host, bracket, port_text = text[1:].partition("]")
        port_text = port_text[1:] if bracket and port_text.startswith(":") else ""
    else:
        host, _, port_text = text.rpartition(":")
    if not host or not port_text:
        usual = "sentinels usually listen on 26379" if role == "sentinel" else "e.g. 6379"
        raise RedisUrlError(f"{role} {text!r} needs host:port ({usual})")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RedisUrlError(f"{role} {text!r} has a bad port (1-65535)")
    return RedisHost(host=host, port=int(port_text))


def _db(text: str) -> int:
    if not text:
        return 0
    if not text.isdigit() or int(text) > MAX_DB:
        raise RedisUrlError(f"the database after the service name must be a number, got {text!r}")
    return int(text)


def hash_tag(key: str) -> str | None:
    """Return the hash tag Redis Cluster hashes ``key`` by, ``None`` if it hashes the whole key.

    As Redis reads it: the text between the first ``{`` and the first ``}`` after it, when
    that text is not empty.
    """
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


class UntaggedPrefixError(ValueError):
    """A BullMQ prefix without a hash tag, given with a Redis Cluster URL."""


def check_queue_target(url: str, prefix: str) -> None:
    """Check a Redis URL and, when it is a Cluster URL, that ``prefix`` holds a hash tag.

    Raises:
        RedisUrlError: The URL (see :func:`check_redis_url`).
        UntaggedPrefixError: A Cluster URL and a prefix without a hash tag.
    """
    if isinstance(check_redis_url(url), ClusterTarget):
        try:
            check_cluster_prefix(prefix)
        except ValueError as exc:
            raise UntaggedPrefixError(str(exc)) from None


def check_cluster_prefix(prefix: str) -> None:
    """Check that a BullMQ prefix keeps each queue's keys on one Redis Cluster slot.

    BullMQ's keys are ``{prefix}:{queue}:{suffix}``; its scripts touch several of them at once
    (and build some inside Lua), which Redis Cluster allows only within one slot. Queue names
    are ``[A-Za-z0-9_.-]`` here, so the hash tag must be the prefix's: ``{bull}``, or
    ``app:{bull}``. All the queues of one prefix then share that slot, on one master.

    Raises:
        ValueError: The prefix has no hash tag (the message names it and the fix).
    """
    if hash_tag(prefix) is None:
        raise ValueError(
            f"on Redis Cluster the BullMQ key prefix must hold a hash tag, e.g."
            f" '{{{prefix}}}', so each queue's keys share one slot (BullMQ's scripts touch"
            f" several keys at once and fail with CROSSSLOT otherwise); got {prefix!r}"
        )
