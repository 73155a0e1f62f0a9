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

from sdcore.alerting._sinks import HttpRequest, WebhookSink
from sdcore.outbox import OutboxMessage, PublisherUnavailableError

if TYPE_CHECKING:
    import httpx

__all__ = ["WebhookDeliveryError", "WebhookPublisher", "WebhookUnreachableError", "send"]


class WebhookDeliveryError(Exception):
    """A sink did not take a request (not 2xx, or no answer); the relay retries the row."""


class WebhookUnreachableError(WebhookDeliveryError):
    """No answer at all: the endpoint could not be reached."""


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


class WebhookPublisher:
    """Delivers alert rows to their webhook sinks.

    Args:
        client: The HTTP client (owned by the caller).
        sinks: The webhook sinks by name.
    """

    def __init__(self, client: httpx.AsyncClient, sinks: Mapping[str, WebhookSink]) -> None:
        self._client = client
        self._sinks = dict(sinks)

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
        await send(self._client, sink.request(message.payload), sink.timeout_s)
