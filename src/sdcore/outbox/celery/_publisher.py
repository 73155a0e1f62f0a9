"""``CeleryPublisher``: the outbox relay's way into Celery, over RabbitMQ or Redis (kombu)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit

from sdcore._internal.errors import error_text
from sdcore._internal.lifecycle import AsyncStartStop
from sdcore._internal.redact import redact_text
from sdcore._internal.validation import boolean, int_between, positive_number, shown
from sdcore._json import MAX_JSON_BYTES
from sdcore.outbox import OutboxMessage, PublisherUnavailableError
from sdcore.outbox.celery._config import (
    AMQP_SCHEMES,
    BrokerRefusedError,
    check_broker_url,
    check_queues,
    check_task_names,
)
from sdcore.outbox.celery._confirms import Confirms
from sdcore.outbox.celery._kombu import (
    OperationalError,
    Queue,
    celery_queue,
    close_within,
    connect,
    connection,
    declare,
    producer,
)
from sdcore.outbox.celery._message import TaskMessage, task_message

T = TypeVar("T")
# The body carries the payload once, as compact JSON with non-ASCII kept as UTF-8, plus a
# fixed envelope: with this default every payload enqueue_once accepted fits.
DEFAULT_MAX_MESSAGE_BYTES = MAX_JSON_BYTES + 4096


class CeleryPublisher(AsyncStartStop):
    """Publish outbox messages as Celery tasks; implements :class:`sdcore.outbox.Publisher`.

    Each message becomes the message ``app.send_task(name, kwargs=payload,
    task_id=message.job_id, queue=message.queue)`` sends (task protocol v2, JSON), so a stock
    Celery worker runs it; a row published again (its relay died before marking it) is sent
    again with the same task id, which :func:`exactly_once` deduplicates on the consumer side.
    The task name is the message's ``name``, or ``task_names[name]``. The message goes to the
    queue named like the outbox message's ``queue``: the ``kombu.Queue`` of that name in
    ``queues`` (its exchange and routing key), or else, as Celery does for a queue it was not
    configured with, a durable queue of that name reached through the default exchange.

    Over RabbitMQ the channel is in publisher-confirm mode and messages are published
    mandatory: a batch is sent whole, then the broker's confirms are awaited, so a message is
    reported published only once RabbitMQ has it (queued, and written to disk for a durable
    queue); a message the broker returns as unroutable or nacks fails alone
    (:class:`BrokerRefusedError`). Over Redis a message is published once its ``LPUSH`` is
    answered. The queue is declared (``declare=True``) before the first message to it on each
    connection.

    Errors: the broker unreachable, the connection cut, or confirms not in within
    ``confirm_timeout_s`` raise :class:`~sdcore.outbox.PublisherUnavailableError` (the relay
    backs off without counting an attempt, and publishes the batch again: messages the broker
    had already taken are then delivered twice, with the same task id). A message-specific
    problem is returned in its slot: :class:`MessageTooLargeError`, :class:`BrokerRefusedError`,
    or ``ValueError`` for a payload that cannot be encoded.

    The broker client is blocking: it runs on one thread of the publisher's, which owns the
    connection.

    Args:
        broker_url: ``amqp://user:password@host:5672/vhost`` (RabbitMQ) or
            ``redis://host:6379/0`` (Redis), as in Celery's ``broker_url``.
        queues: ``kombu.Queue`` declarations, the same as the workers' ``task_queues``, for
            queues that are not Celery's default (an exchange, a routing key, arguments).
        task_names: Message name → Celery task name, for names that differ.
        declare: Declare each queue (with its exchange and binding) before publishing to it.
        transport_options: kombu transport options, the same as the workers'
            ``broker_transport_options`` where they name keys or queues (on Redis:
            ``global_keyprefix``, ``sep``, priority ``steps``).
        max_message_bytes: Largest message body; larger messages fail (and end ``DEAD``)
            instead of blocking the messages behind them.
        confirm_timeout_s: Longest wait for a batch's confirms (RabbitMQ), and for any socket
            read or write: a broker that stops reading or answering fails the batch.
        connect_timeout_s: Connection timeout.
        logger_name: Logger for warnings.

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: A broker URL that is not RabbitMQ's or Redis', a queue without a name or
            with an exchange that is not direct or topic, a limit out of range.
    """

    def __init__(
        self,
        broker_url: str,
        *,
        queues: Sequence[Queue] = (),
        task_names: Mapping[str, str] | None = None,
        declare: bool = True,
        transport_options: Mapping[str, Any] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        confirm_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        logger_name: str = "sdcore.outbox",
    ) -> None:
        self._url = check_broker_url(broker_url)
        self._amqp = urlsplit(self._url).scheme.lower() in AMQP_SCHEMES
        self._queues = check_queues(queues)
        self._task_names = check_task_names({} if task_names is None else task_names)
        self._declare = boolean("declare", declare)
        if transport_options is not None and not isinstance(transport_options, Mapping):
            raise TypeError(f"transport_options must be a mapping, got {shown(transport_options)}")
        self._transport_options = dict(transport_options or {})
        self._max_bytes = int_between("max_message_bytes", max_message_bytes, 64, 512 * 2**20)
        self._confirm_timeout = positive_number("confirm_timeout_s", confirm_timeout_s)
        self._connect_timeout = positive_number("connect_timeout_s", connect_timeout_s)
        self._log = logging.getLogger(logger_name)
        self._origin = f"gen{os.getpid()}@{socket.gethostname()}"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdcore-celery")
        # Owned by the executor's thread: the connection, its channel and what it declared.
        self._connection: Any = None  # kombu.Connection
        self._channel: Any = None
        self._producer: Any = None  # kombu.Producer
        self._declared: set[str] = set()
        self._batch: Confirms | None = None
        self._next_tag = 1
        self._closed = False

    async def start(self) -> None:
        """Connect now; if the broker is down, connect again on the next publish.

        Never raises because the broker is unreachable: the application starts and the relay
        keeps its rows until the broker is back.
        """
        try:
            await self._run(self._ensure_channel)
        except PublisherUnavailableError as exc:
            self._log.warning(
                "the Celery broker is not reachable yet (%s); the publisher will retry",
                redact_text(error_text(exc)[:300]),
                extra={"action": "broker_unavailable"},
            )

    async def stop(self) -> None:
        """Same as :meth:`close` (what leaving ``async with`` calls)."""
        await self.close()

    async def close(self) -> None:
        """Close the broker connection and the publisher's thread."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: self._disconnect(graceful=True)
        )
        self._executor.shutdown(wait=True)

    async def publish(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        """Send each message as a Celery task.

        Args:
            messages: Claimed outbox rows.

        Returns:
            ``None`` per message the broker took, or the error that stopped that message.

        Raises:
            PublisherUnavailableError: The broker is unreachable, the connection was lost, or
                the confirms did not come within ``confirm_timeout_s``; some messages of the
                batch may have reached the broker (they will be sent again, same task id).
        """
        if self._closed:
            raise RuntimeError("the publisher is closed")
        if not messages:
            return []
        now = datetime.now(UTC)
        return await self._run(lambda: self._publish(messages, now))

    async def _run(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    # Everything below runs on the publisher's thread.

    def _unavailable(self, exc: BaseException) -> PublisherUnavailableError:
        self._disconnect()
        timeout = self._confirm_timeout if isinstance(exc, TimeoutError) else None
        return PublisherUnavailableError(
            f"Celery broker unavailable: {redact_text(error_text(exc))}", timeout_s=timeout
        )

    def _disconnect(self, *, graceful: bool = False) -> None:
        """Drop the connection: closed politely (within the connect timeout) on ``close()``,
        abruptly after a failure, when the broker may never answer a close."""
        connection, self._connection = self._connection, None
        self._channel = self._producer = None
        self._declared.clear()
        if connection is None:
            return
        try:
            if graceful:
                close_within(connection, self._connect_timeout)
            else:
                connection.collect(socket_timeout=0.1)
        except Exception:  # noqa: BLE001 - a dead connection's close may fail; it is gone
            self._log.debug("closing the broker connection failed", exc_info=True)
            with contextlib.suppress(Exception):
                connection.collect(socket_timeout=0.1)

    def _errors(self) -> tuple[type[BaseException], ...]:
        connection = self._connection
        known: tuple[type[BaseException], ...] = (OSError, TimeoutError, OperationalError)
        if connection is None:
            return known
        return (*known, *connection.connection_errors)

    def _ensure_channel(self) -> None:
        if self._channel is not None:
            return
        try:
            if self._connection is None:
                self._connection = connection(
                    self._url,
                    amqp=self._amqp,
                    connect_timeout_s=self._connect_timeout,
                    socket_timeout_s=self._confirm_timeout,
                    transport_options=self._transport_options,
                )
            connect(self._connection)
            channel = self._connection.channel()
            if self._amqp:
                channel.confirm_select()
                channel.events["basic_ack"].add(self._on_ack)
                channel.events["basic_nack"].add(self._on_nack)
                channel.events["basic_return"].add(self._on_return)
                self._next_tag = 1
        except self._errors() as exc:
            raise self._unavailable(exc) from exc
        self._channel = channel
        self._producer = producer(channel)

    def _route(self, queue_name: str) -> tuple[Queue, str, str]:
        """The queue to declare, the exchange and the routing key of messages to ``queue_name``."""
        queue = self._queues.get(queue_name)
        if queue is None:
            # Celery's queue for a name it was not configured with (task_create_missing_queues),
            # which it publishes to through the default exchange.
            return celery_queue(queue_name), "", queue_name
        exchange = queue.exchange.name if queue.exchange is not None else ""
        if not exchange:
            return queue, "", queue_name
        return queue, exchange, queue.routing_key or queue_name

    def _declare_queue(self, queue: Queue) -> str | None:
        """Declare ``queue`` once per connection; return why it cannot be, for its messages."""
        if not self._declare or queue.name in self._declared:
            return None
        try:
            declare(queue, self._channel)
        except self._errors():
            raise
        except Exception as exc:  # noqa: BLE001 - the broker refused this queue: its messages fail
            # A channel error (e.g. PRECONDITION_FAILED: declared elsewhere with other
            # arguments) closes the channel: the next queue gets a fresh one.
            self._reopen_channel()
            return (
                f"queue {queue.name!r} cannot be declared ({error_text(exc)}); pass the"
                " workers' kombu.Queue for it in queues=, or declare=False"
            )
        self._declared.add(queue.name)
        return None

    def _reopen_channel(self) -> None:
        channel, self._channel = self._channel, None
        self._producer = None
        if channel is not None:
            try:
                channel.close()
            except Exception:  # noqa: BLE001 - the broker closed it already
                self._log.debug("closing a refused channel failed", exc_info=True)
        self._ensure_channel()

    def _publish(
        self, messages: Sequence[OutboxMessage], now: datetime
    ) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(messages)
        encoded: list[tuple[int, OutboxMessage, TaskMessage]] = []
        for index, message in enumerate(messages):
            try:
                encoded.append((index, message, self._encode(message, now)))
            except ValueError as exc:
                results[index] = exc
        if not encoded:
            return results
        reused = self._channel is not None
        try:
            self._send(encoded, results)
        except PublisherUnavailableError:
            raise  # connecting failed: already the relay's error
        except self._errors() as exc:
            # A connection idle since the last batch may have been closed by the broker or a
            # proxy: one attempt on a fresh connection before reporting an outage. Not after
            # a timeout: a broker that does not answer would be waited for twice.
            if not reused or isinstance(exc, TimeoutError):
                raise self._unavailable(exc) from exc
            self._disconnect()
            results[:] = [r if isinstance(r, ValueError) else None for r in results]
            try:
                self._send(encoded, results)
            except PublisherUnavailableError:
                raise
            except self._errors() as again:
                raise self._unavailable(again) from again
        return results

    def _encode(self, message: OutboxMessage, now: datetime) -> TaskMessage:
        return task_message(
            message,
            task=self._task_names.get(message.name, message.name),
            origin=self._origin,
            now=now,
            max_bytes=self._max_bytes,
        )

    def _send(
        self,
        encoded: list[tuple[int, OutboxMessage, TaskMessage]],
        results: list[BaseException | None],
    ) -> None:
        self._ensure_channel()
        routes: dict[str, tuple[str, str] | str] = {}
        for _, message, _ in encoded:
            if message.queue in routes:
                continue
            queue, exchange, routing_key = self._route(message.queue)
            refused = self._declare_queue(queue)
            routes[message.queue] = refused if refused is not None else (exchange, routing_key)
        batch = Confirms(results=results)
        self._batch = batch
        try:
            self._publish_all(encoded, routes, batch)
        except self._channel_errors() as exc:
            # The broker closed the channel (e.g. an exchange that does not exist, with
            # declare=False): the messages it did not confirm fail; the next batch gets a new
            # channel.
            self._channel = self._producer = None
            for index, _, task in encoded:
                if results[index] is None and index not in batch.acked:
                    results[index] = BrokerRefusedError(
                        task.task_id, f"the broker closed the channel: {error_text(exc)}"
                    )
        finally:
            self._batch = None

    def _channel_errors(self) -> tuple[type[BaseException], ...]:
        connection = self._connection
        return () if connection is None else tuple(connection.channel_errors)

    def _publish_all(
        self,
        encoded: list[tuple[int, OutboxMessage, TaskMessage]],
        routes: dict[str, tuple[str, str] | str],
        batch: Confirms,
    ) -> None:
        for index, message, task in encoded:
            route = routes[message.queue]
            if isinstance(route, str):
                batch.results[index] = BrokerRefusedError(task.task_id, route)
                continue
            exchange, routing_key = route
            self._producer.publish(
                task.body,
                exchange=exchange,
                routing_key=routing_key,
                headers=task.headers,
                content_type="application/json",
                content_encoding="utf-8",
                delivery_mode=2,
                mandatory=self._amqp,
                retry=False,
                **task.properties,
            )
            if self._amqp:
                batch.sent(self._next_tag, index, task.task_id, message.queue)
                self._next_tag += 1
        if self._amqp:
            self._await_confirms(batch)

    def _await_confirms(self, batch: Confirms) -> None:
        assert self._connection is not None  # noqa: S101 - connected by _ensure_channel
        deadline = time.monotonic() + self._confirm_timeout
        while batch.by_tag:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{len(batch.by_tag)} publisher confirm(s) not received within"
                    f" {self._confirm_timeout:g} s"
                )
            try:
                self._connection.drain_events(timeout=left)
            except TimeoutError:  # socket.timeout: the loop ends at the deadline
                continue

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        if self._batch is not None:
            self._batch.settle(delivery_tag, multiple, None)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        if self._batch is not None:
            reason = "nacked (the broker could not store it)"
            self._batch.settle(delivery_tag, multiple, reason)

    def _on_return(self, exc: BaseException, exchange: str, routing_key: str, message: Any) -> None:
        if self._batch is None:
            return
        properties = getattr(message, "properties", {}) or {}
        queue = self._batch.returned(
            properties.get("correlation_id"),
            f"unroutable: exchange {exchange!r} with routing key {routing_key!r} reaches no"
            f" queue ({error_text(exc)})",
        )
        # A returned message was routed to no queue (its queue was deleted, or declare=False
        # and nobody declared it): the next attempt declares the queue again.
        if queue is not None:
            self._declared.discard(queue)
