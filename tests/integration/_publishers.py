"""The publisher contract's implementations: BullMQ on Redis, Celery on RabbitMQ and on Redis,
the alerts' webhook publisher on a real HTTP server.

Each :class:`Broker` makes publishers of its kind (directly, or through a port of the test's
choosing: a proxy, or a closed port) and reads back what a consumer would receive, by job id.
Writing another publisher: add a ``Broker`` here and its name to :data:`BROKERS`, and the suite
in ``test_publisher_contract.py`` runs against it.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from kombu.connection import Connection

from sdcore.outbox import Publisher
from sdcore.outbox.celery import DEFAULT_MAX_MESSAGE_BYTES, CeleryPublisher
from sdcore.queues import DEFAULT_MAX_JOB_BYTES, BullMQPublisher

BROKERS = ["bullmq", "celery-rabbitmq", "celery-redis", "webhook"]
REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
AMQP_URL = os.environ.get("SDCORE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    """One message as a consumer gets it."""

    job_id: str
    name: str
    payload: dict[str, Any]


class ContractPublisher(Publisher, Protocol):
    """A publisher the suite can open and close (``async with``)."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@dataclass
class Broker:
    """One publisher implementation on its real broker."""

    name: str
    queue: str
    """The queue name the suite's messages use (unique per test)."""
    target: tuple[str, int]
    """The broker's address, for a proxy in front of it."""
    make: Callable[..., ContractPublisher]
    """``make(port=None, max_bytes=None)``: a publisher, through ``port`` on 127.0.0.1 if given."""
    received: Callable[[], Awaitable[list[Received]]]
    """Everything delivered so far (each delivery once; a re-delivery of a job id again)."""


def _address(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


def _via(url: str, port: int | None) -> str:
    if port is None:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    return parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host).geturl()


async def bullmq_broker() -> AsyncIterator[Broker]:
    prefix = f"contract-{uuid.uuid4().hex[:10]}"
    queue = "contract"
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)

    def make(port: int | None = None, max_bytes: int | None = None) -> ContractPublisher:
        return BullMQPublisher.from_url(
            _via(REDIS_URL, port), prefix=prefix, socket_timeout_s=2.0, connect_timeout_s=2.0,
            check_server=False, max_job_bytes=max_bytes or DEFAULT_MAX_JOB_BYTES,
        )  # fmt: skip

    async def received() -> list[Received]:
        head = f"{prefix}:{queue}:"
        found: list[Received] = []
        async for key in client.scan_iter(match=f"{head}sd*", count=1000):
            if ":" in key[len(head) :]:
                continue
            job = await client.hgetall(key)
            if "data" in job:
                found.append(
                    Received(
                        job_id=key[len(head) :],
                        name=str(job["name"]),
                        payload=json.loads(job["data"]),
                    )
                )
        return found  # fmt: skip

    try:
        yield Broker(
            name="bullmq", queue=queue, target=_address(REDIS_URL, 6379), make=make,
            received=received,
        )  # fmt: skip
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def celery_broker(url: str, name: str, default_port: int) -> AsyncIterator[Broker]:
    queue = f"contract-{uuid.uuid4().hex[:10]}"
    connection: Any = Connection(url)  # type: ignore[no-untyped-call]
    simple: Any = None  # kombu.simple.SimpleQueue

    def make(port: int | None = None, max_bytes: int | None = None) -> ContractPublisher:
        return CeleryPublisher(
            _via(url, port), confirm_timeout_s=3.0, connect_timeout_s=2.0,
            max_message_bytes=max_bytes or DEFAULT_MAX_MESSAGE_BYTES,
        )  # fmt: skip

    def drain() -> list[Received]:
        nonlocal simple
        if simple is None:
            simple = connection.SimpleQueue(queue)
        found: list[Received] = []
        while True:
            try:
                message = simple.get(block=True, timeout=0.3)
            except simple.Empty:
                return found
            _args, kwargs, _embed = message.decode()
            found.append(
                Received(job_id=message.headers["id"], name=message.headers["task"], payload=kwargs)
            )
            message.ack()

    async def received() -> list[Received]:
        return await asyncio.to_thread(drain)

    try:
        yield Broker(
            name=name, queue=queue, target=_address(url, default_port), make=make,
            received=received,
        )  # fmt: skip
    finally:

        def clean() -> None:
            if simple is not None:
                simple.close()
            channel = connection.default_channel
            channel.queue_delete(queue)
            channel.exchange_delete(queue)  # Celery's exchange of the queue's name
            if name == "celery-redis":  # kombu's binding of the queue to its exchange
                channel.client.delete(f"_kombu.binding.{queue}")
            connection.release()

        await asyncio.to_thread(clean)


async def webhook_broker() -> AsyncIterator[Broker]:
    """The alerts' webhook publisher: a row's queue names its sink, the receiver is
    :mod:`tests._http_sink` (the job id and name arrive as headers, the payload as the body)."""
    from sdcore.alerting import DELIVERY_HEADER, EVENT_HEADER, WebhookSink
    from sdcore.alerting._publisher import DEFAULT_MAX_BODY_BYTES, WebhookPublisher
    from tests._http_sink import http_recorder

    queue = f"contract-{uuid.uuid4().hex[:10]}"
    with http_recorder() as recorder:
        server_port = int(recorder.url.rsplit(":", 1)[1])

        def make(port: int | None = None, max_bytes: int | None = None) -> ContractPublisher:
            sink = WebhookSink(
                f"http://127.0.0.1:{port or server_port}/hook",
                secret="contract-secret-0123",
                name=queue,
                timeout_s=3.0,
            )
            return WebhookPublisher(
                {queue: sink}, max_body_bytes=max_bytes or DEFAULT_MAX_BODY_BYTES
            )  # fmt: skip

        async def received() -> list[Received]:
            return [
                Received(
                    job_id=r.headers[DELIVERY_HEADER], name=r.headers[EVENT_HEADER],
                    payload=r.json(),
                )
                for r in recorder.ok("/hook")
            ]  # fmt: skip

        yield Broker(
            name="webhook", queue=queue, target=("127.0.0.1", server_port),
            make=make, received=received,
        )  # fmt: skip


async def broker(name: str) -> AsyncIterator[Broker]:
    """The :class:`Broker` named ``name`` (one of :data:`BROKERS`)."""
    if name == "webhook":
        async for value in webhook_broker():
            yield value
    elif name == "bullmq":
        async for value in bullmq_broker():
            yield value
    elif name == "celery-rabbitmq":
        async for value in celery_broker(AMQP_URL, name, 5672):
            yield value
    else:
        async for value in celery_broker(REDIS_URL.rstrip("/") + "/0", name, 6379):
            yield value
