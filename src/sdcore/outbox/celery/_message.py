"""An outbox message as a Celery task message (protocol v2), the one encoding of the publisher."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sdcore.outbox import OutboxError, OutboxMessage

# Celery's own limit for the argsrepr/kwargsrepr headers (app.amqp.argsrepr_maxsize): a
# display of the arguments for monitoring tools, never read back as the arguments.
REPR_MAX_CHARS = 1024
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
# Trace context travels in the task's headers (opentelemetry-instrumentation-celery reads them
# there); a carrier key may not replace a protocol header.
PROTOCOL_HEADERS = frozenset(
    {
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin",
        "ignore_result", "replaced_task_nesting", "stamped_headers", "stamps",
    }
)  # fmt: skip


class MessageTooLargeError(OutboxError, ValueError):
    """A task message whose body is larger than the publisher's ``max_message_bytes``.

    A poison message: it fails (and ends ``DEAD`` after the outbox's ``max_attempts``) while the
    messages behind it are published.

    Attributes:
        job_id: The message's job id (the Celery task id).
        size: Bytes of the encoded body.
        limit: The publisher's limit.
    """

    def __init__(self, job_id: str, size: int, limit: int) -> None:
        self.job_id = job_id
        self.size = size
        self.limit = limit
        super().__init__(
            f"task {job_id}: the message body is {size} bytes, more than the {limit} allowed"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskMessage:
    """What is published for one outbox message: ``app.send_task``'s message, field for field."""

    task_id: str
    task: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    """AMQP properties besides the headers: ``correlation_id`` and ``reply_to``."""
    body: bytes
    """JSON ``[args, kwargs, embed]``, UTF-8 (content type ``application/json``)."""


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= REPR_MAX_CHARS else text[: REPR_MAX_CHARS - 3] + "..."


def task_message(
    message: OutboxMessage,
    *,
    task: str,
    origin: str,
    now: datetime,
    max_bytes: int,
) -> TaskMessage:
    """Encode ``message`` as the Celery task ``task`` called with the payload as its keywords.

    The task id is the message's job id, so every re-publish of the row carries the same id
    (what ``sdcore.outbox.celery.exactly_once`` deduplicates by). BullMQ's ``delay`` option
    (milliseconds) becomes the ``eta`` ``now + delay``; the other BullMQ options (``attempts``,
    ``backoff``, ``priority``, ``lifo``, ``removeOn…``) have no Celery equivalent and are not
    sent: retries are the task's own (``autoretry_for``, ``self.retry``).

    Args:
        message: The claimed row.
        task: The Celery task name.
        origin: The ``origin`` header (Celery's ``gen<pid>@<host>`` of the sender).
        now: The publish time (aware), for ``eta``.
        max_bytes: Largest body accepted.

    Raises:
        MessageTooLargeError: The body is larger than ``max_bytes``.
        ValueError: The payload or ``delay`` cannot be encoded (a poison message).
    """
    kwargs: Mapping[str, Any] = message.payload
    delay = message.options.get("delay")
    eta: str | None = None
    if delay:
        if isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0:
            raise ValueError(f"task {message.job_id}: the delay option must be ms >= 0")
        eta = (now + timedelta(milliseconds=delay)).isoformat()
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    try:
        body = _JSON.encode([[], kwargs, embed]).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"task {message.job_id}: the payload cannot be encoded: {exc}") from exc
    if len(body) > max_bytes:
        raise MessageTooLargeError(message.job_id, len(body), max_bytes)
    headers: dict[str, Any] = {
        "lang": "py",
        "task": task,
        "id": message.job_id,
        "shadow": None,
        "eta": eta,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": message.job_id,
        "parent_id": None,
        "argsrepr": "()",
        "kwargsrepr": _short_repr(dict(kwargs)),
        "origin": origin,
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    for key, value in (message.trace_context or {}).items():
        if key not in PROTOCOL_HEADERS:
            headers[key] = value
    return TaskMessage(
        task_id=message.job_id,
        task=task,
        headers=headers,
        properties={"correlation_id": message.job_id, "reply_to": ""},
        body=body,
    )
