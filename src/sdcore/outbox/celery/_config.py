"""What ``CeleryPublisher`` accepts (checked before any I/O); a message the broker refused."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from sdcore._internal.redact import redact_text
from sdcore._internal.validation import non_empty_str, shown
from sdcore.outbox import OutboxError
from sdcore.outbox.celery._kombu import Queue

AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})
REDIS_SCHEMES = frozenset({"redis", "rediss"})


class BrokerRefusedError(OutboxError, RuntimeError):
    """The broker refused one message: returned unroutable, nacked, or its queue undeclarable.

    The message's own failure (counted as an attempt, ``DEAD`` after ``max_attempts``); the
    other messages of the batch go on.

    Attributes:
        job_id: The message's job id.
        reason: What the broker said.
    """

    def __init__(self, job_id: str, reason: str) -> None:
        self.job_id = job_id
        self.reason = reason
        super().__init__(f"the broker refused task {job_id}: {reason}")


def check_broker_url(url: object) -> str:
    """Validate a broker URL: ``amqp://``/``amqps://`` (RabbitMQ) or ``redis://``/``rediss://``.

    Raises:
        TypeError: Not a ``str``.
        ValueError: Another scheme, or no host.
    """
    text = non_empty_str("broker_url", url, max_length=4096)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in AMQP_SCHEMES | REDIS_SCHEMES:
        raise ValueError(
            "broker_url must be a RabbitMQ (amqp://, amqps://) or Redis (redis://, rediss://)"
            f" URL, got {shown(redact_text(text))}"
        )
    if not parts.hostname:
        raise ValueError(f"broker_url has no host: {shown(redact_text(text))}")
    return text


def check_queues(queues: object) -> dict[str, Queue]:
    if isinstance(queues, str | bytes) or not isinstance(queues, Iterable):
        raise TypeError(f"queues must be a sequence of kombu.Queue, got {shown(queues)}")
    found: dict[str, Queue] = {}
    for queue in queues:
        if not isinstance(queue, Queue):
            raise TypeError(f"queues must hold kombu.Queue objects, got {shown(queue)}")
        name = queue.name
        if not isinstance(name, str) or not name:
            raise ValueError(f"every queue needs a name, got {shown(queue)}")
        if name in found:
            raise ValueError(f"queues names {name!r} twice")
        exchange = queue.exchange
        if exchange is not None and exchange.name and exchange.type not in {"direct", "topic"}:
            raise ValueError(
                f"queue {name!r}: exchange {exchange.name!r} is of type {exchange.type!r};"
                " messages are routed by routing key: use a direct or topic exchange"
            )
        found[name] = queue
    return found


def check_task_names(task_names: object) -> dict[str, str]:
    if not isinstance(task_names, Mapping):
        raise TypeError(f"task_names must be a mapping of str to str, got {shown(task_names)}")
    for key, value in task_names.items():
        non_empty_str("task_names key", key, max_length=1000)
        non_empty_str(f"task_names[{key!r}]", value, max_length=1000)
    return dict(task_names)
