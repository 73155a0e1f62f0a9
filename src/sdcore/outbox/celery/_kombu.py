"""The one place that calls kombu's untyped functions, with the types the publisher relies on."""

from __future__ import annotations

from typing import Any

from kombu.connection import Connection as _Connection
from kombu.entity import Exchange as _Exchange
from kombu.entity import Queue
from kombu.exceptions import OperationalError
from kombu.messaging import Producer as _Producer

__all__ = [
    "OperationalError",
    "Queue",
    "celery_queue",
    "connect",
    "connection",
    "declare",
    "producer",
]


def connection(
    url: str,
    *,
    amqp: bool,
    connect_timeout_s: float,
    socket_timeout_s: float,
    transport_options: dict[str, Any],
) -> Any:
    """A ``kombu.Connection`` to ``url`` (not connected yet).

    Every socket operation is bounded: a broker that stops reading or answering (a stalled
    node, a full TCP window) fails the call after ``socket_timeout_s`` instead of blocking the
    publisher's thread for ever.
    """
    timeouts: dict[str, Any] = (
        {"read_timeout": socket_timeout_s, "write_timeout": socket_timeout_s}
        if amqp
        else {"socket_timeout": socket_timeout_s, "socket_connect_timeout": connect_timeout_s}
    )
    return _Connection(  # type: ignore[no-untyped-call]
        url, connect_timeout=connect_timeout_s, transport_options={**timeouts, **transport_options}
    )


def connect(connection: Any) -> None:
    """Connect ``connection`` now, once: a refusal raises at once (kombu's ``connect()`` retries
    after 2 s); the relay does the backing off."""
    connection.ensure_connection(max_retries=0, interval_start=0)


def close_within(connection: Any, timeout_s: float) -> None:
    """Close ``connection`` politely, waiting at most ``timeout_s`` for the broker's answer."""
    sock = getattr(getattr(connection, "_connection", None), "sock", None)
    if sock is not None:
        sock.settimeout(timeout_s)
    connection.release()


def celery_queue(name: str) -> Queue:
    """The queue a Celery worker declares for a name it was not configured with."""
    exchange = _Exchange(name, type="direct")  # type: ignore[no-untyped-call]
    return Queue(name, exchange, routing_key=name)  # type: ignore[no-untyped-call]


def declare(queue: Queue, channel: Any) -> None:
    """Declare ``queue``, its exchange and its binding on ``channel``."""
    queue(channel).declare()  # type: ignore[no-untyped-call]


def producer(channel: Any) -> Any:
    """A ``kombu.Producer`` on ``channel``."""
    return _Producer(channel)  # type: ignore[no-untyped-call]
