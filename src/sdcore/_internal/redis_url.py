"""Redis URLs, checked (the clients are built by :mod:`sdcore._internal.redis_client`).

A URL is either a plain Redis URL (``redis://``, ``rediss://``, ``unix://``, as redis-py's
``from_url`` reads it) or a Sentinel URL, in the form of the ``Redis-Sentinel-Url`` package::

    redis+sentinel://[[username]:password@]host:port[,host:port…]/service_name[/db]
        [?sentinel_password=…]

The hosts are the sentinels (the port is required: sentinels listen on 26379, not 6379); the
password is the data nodes' (master and replicas); ``sentinel_password`` is for sentinels that
require one (``requirepass`` in sentinel.conf).

Parsing never imports redis: the runtime validates the URL at construction, before the queues
(and redis, an extra) are imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

PLAIN_SCHEMES = frozenset({"redis", "rediss", "unix"})
SENTINEL_SCHEME = "redis+sentinel"
_SENTINEL_OPTIONS = frozenset({"sentinel_password"})
# The largest index redis.conf's "databases" accepts.
MAX_DB = 2**31 - 1


class RedisUrlError(ValueError):
    """A Redis URL that cannot be used; the message names the problem, never the password."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SentinelHost:
    """One sentinel's address."""

    host: str
    port: int


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


def scheme_of(url: str) -> str:
    """Return a URL's scheme, lower-cased (``""`` for none)."""
    return urlsplit(url.strip()).scheme.lower()


def check_redis_url(url: str) -> SentinelTarget | None:
    """Check a Redis URL; return what a Sentinel URL names, ``None`` for a plain one.

    Raises:
        RedisUrlError: An unknown scheme, or a Sentinel URL without hosts, ports or service
            name, with a bad port or database, or with an unknown option.
    """
    scheme = scheme_of(url)
    if scheme in PLAIN_SCHEMES:
        return None
    if scheme != SENTINEL_SCHEME:
        raise RedisUrlError(
            "the Redis URL must start with redis://, rediss://, unix:// or redis+sentinel:// "
            f"(got scheme {scheme or 'none'!r})"
        )
    return _parse_sentinel(url.strip())


def _parse_sentinel(url: str) -> SentinelTarget:
    # urlsplit cannot read "host:port,host:port" as a netloc (it would take one port), so the
    # parts are cut by hand: userinfo@hosts/path?query.
    rest = url[len(SENTINEL_SCHEME) + 3 :] if url[len(SENTINEL_SCHEME) :].startswith("://") else ""
    if not rest:
        raise RedisUrlError("a redis+sentinel URL must start with redis+sentinel://")
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
        if not colon:  # "redis+sentinel://secret@…": a lone word is the password, as in redis://
            username, password = None, unquote(user)
    sentinels = tuple(_sentinel_host(part) for part in hosts.split(","))
    service, _, db_text = path.partition("/")
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
        sentinels=sentinels,
        service_name=service_name,
        db=db,
        username=username,
        password=password,
        sentinel_password=sentinel_password,
    )


def _sentinel_host(part: str) -> SentinelHost:
    text = part.strip()
    if not text:
        raise RedisUrlError("a redis+sentinel URL needs at least one sentinel host:port")
    if text.startswith("["):  # [::1]:26379
        host, bracket, port_text = text[1:].partition("]")
        port_text = port_text[1:] if bracket and port_text.startswith(":") else ""
    else:
        host, _, port_text = text.rpartition(":")
    if not host or not port_text:
        raise RedisUrlError(
            f"sentinel {text!r} needs host:port (sentinels usually listen on 26379)"
        )
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RedisUrlError(f"sentinel {text!r} has a bad port (1-65535)")
    return SentinelHost(host=host, port=int(port_text))


def _db(text: str) -> int:
    if not text:
        return 0
    if not text.isdigit() or int(text) > MAX_DB:
        raise RedisUrlError(f"the database after the service name must be a number, got {text!r}")
    return int(text)
