"""``WebhookPublisher``: the alerts relay's :class:`~sdcore.outbox.Publisher` (HTTP, not BullMQ).

The relay claims alert rows and hands them here; each row's ``queue`` names its webhook sink.
A row's outcome is ``None`` once its sink answered 2xx, else the error, which the relay counts
as a failed attempt and retries with exponential backoff (``DEAD`` after ``max_attempts``): an
endpoint that answers with an error is misconfigured or refusing, and says so. A batch none of
whose endpoints could be reached at all (connection refused, DNS, timeout) raises
:class:`~sdcore.outbox.PublisherUnavailableError`, as a broker that is down does: the relay backs
off without counting attempts, so an alert waits out a receiver's outage of any length and is
delivered when it is back (its timestamp header is fresh at each attempt).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from sdcore._internal.lifecycle import AsyncStartStop
from sdcore._internal.validation import at_least
from sdcore.alerting._sinks import HttpRequest, WebhookSink
from sdcore.outbox import OutboxMessage, PublisherUnavailableError

if TYPE_CHECKING:
    import httpx

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "WebhookBodyTooLargeError",
    "WebhookDeliveryError",
    "WebhookPublisher",
    "WebhookUnreachableError",
    "send",
]

DEFAULT_MAX_BODY_BYTES = 1_000_000


class WebhookDeliveryError(Exception):
    """A sink did not take a request (not 2xx, or no answer); the relay retries the row."""


class WebhookUnreachableError(WebhookDeliveryError):
    """No answer at all: the endpoint could not be reached."""


class WebhookBodyTooLargeError(ValueError):
    """A row's body is over ``max_body_bytes``: the row's fault, never sent (ends ``DEAD``)."""


async def send(client: httpx.AsyncClient, request: HttpRequest, timeout_s: float) -> None:
    """Send ``request``; return once it was answered 2xx.

    Raises:
        WebhookDeliveryError: Another status, or a transport error (``from`` it).
    """
    import httpx

    try:
        response = await client.request(
            request.method,
            request.url,
            headers=request.headers,
            content=request.body,
            timeout=timeout_s,
        )
    except httpx.TransportError as exc:
        raise WebhookUnreachableError(f"{type(exc).__name__}: {exc}"[:500]) from exc
    except httpx.HTTPError as exc:
        raise WebhookDeliveryError(f"{type(exc).__name__}: {exc}"[:500]) from exc
    if not 200 <= response.status_code < 300:
        raise WebhookDeliveryError(f"answered {response.status_code}: {response.text[:200]!r}")


class WebhookPublisher(AsyncStartStop):
    """Delivers alert rows to their webhook sinks.

    It passes the outbox's publisher contract (``tests/integration/test_publisher_contract.py``)
    like the BullMQ and Celery publishers. Each POST carries the row's job id in
    ``X-Sdcore-Delivery`` (the same on every retry and relay) and its name in
    ``X-Sdcore-Event``.

    Args:
        sinks: The webhook sinks by name (a row's ``queue``).
        client: The HTTP client (``None``: one of its own, opened by :meth:`start` or
            ``async with`` and closed on exit).
        max_body_bytes: A row whose body is larger fails alone, without a request.
    """

    def __init__(
        self,
        sinks: Mapping[str, WebhookSink],
        *,
        client: httpx.AsyncClient | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self._client = client
        self._own = client is None
        self._sinks = dict(sinks)
        self._max = at_least("max_body_bytes", max_body_bytes, 1)

    async def start(self) -> None:
        """Open a client of its own (when none was given)."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False)

    async def stop(self) -> None:
        """Close the client it opened."""
        if self._own and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        """POST each message to its sink, concurrently; one outcome per message.

        Raises:
            PublisherUnavailableError: No endpoint of the batch could be reached.
        """
        results = await asyncio.gather(*(self._one(m) for m in messages), return_exceptions=True)
        if results and all(isinstance(r, WebhookUnreachableError) for r in results):
            raise PublisherUnavailableError(f"no webhook could be reached: {results[0]}")
        return results

    async def _one(self, message: OutboxMessage) -> None:
        sink = self._sinks.get(message.queue)
        if sink is None:
            raise WebhookDeliveryError(
                f"no webhook sink named {message.queue!r} on this replica (its relay cannot "
                "deliver the row; it is retried, and delivered by a replica that has the sink)"
            )
        request = sink.request(message.payload, delivery=message.job_id, event=message.name)
        if len(request.body) > self._max:
            raise WebhookBodyTooLargeError(
                f"the alert's body is {len(request.body)} bytes, over max_body_bytes "
                f"({self._max}): not sent"
            )
        if self._client is None:
            raise RuntimeError("WebhookPublisher without a client: use `async with` first")
        await send(self._client, request, sink.timeout_s)
