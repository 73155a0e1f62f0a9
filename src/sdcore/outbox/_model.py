"""Values, errors and the publisher seam of the outbox; validation of what is enqueued."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

MAX_KEY_LENGTH = 1024
MAX_NAME_LENGTH = 200
_QUEUE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")
# Completed jobs are kept a week: BullMQ deduplicates a job id only while the job exists, and the
# relay may re-publish a row (after a crash between publish and mark) long after the first publish.
DEFAULT_KEEP = {"age": 7 * 24 * 3600}


class OutboxStatus(enum.StrEnum):
    """State of an outbox row."""

    PENDING = "PENDING"
    PUBLISHED = "PUBLISHED"
    DEAD = "DEAD"


class OutboxError(Exception):
    """Base class of the outbox's errors."""


class InvalidOutboxMessageError(OutboxError, ValueError):
    """A message that cannot be enqueued (raised before any SQL).

    Attributes:
        field: The offending argument.
        problem: What is wrong with it.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"invalid {field}: {problem}")


class PublisherUnavailableError(OutboxError, ConnectionError):
    """The broker (Redis) cannot be reached: not the message's fault; retried without counting."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxMessage:
    """One claimed outbox row, as a publisher receives it."""

    id: int
    idempotency_key: str
    queue: str
    name: str
    job_id: str
    payload: dict[str, Any]
    options: dict[str, Any]
    attempts: int
    max_attempts: int
    created_at: datetime


class Publisher(Protocol):
    """Where the relay sends messages (BullMQ in production, a recorder in tests)."""

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        """Publish a batch; return ``None`` per published message, or the error that stopped it.

        Raise :class:`PublisherUnavailableError` when nothing could be published because the
        broker is unreachable (the relay backs off and does not count an attempt).
        """
        ...


def _check_text(field: str, value: object, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidOutboxMessageError(field, f"must be a str, got {type(value).__name__}")
    if not value:
        raise InvalidOutboxMessageError(field, "must not be empty")
    if len(value) > limit:
        raise InvalidOutboxMessageError(field, f"must hold at most {limit} characters")
    if "\x00" in value:
        raise InvalidOutboxMessageError(field, "must not contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidOutboxMessageError(field, "must be valid Unicode") from None
    return value


def check_identity(idempotency_key: object, queue: object, name: object) -> tuple[str, str, str]:
    """Validate the key, the queue name and the job name.

    Raises:
        InvalidOutboxMessageError: Naming the argument.
    """
    key = _check_text("idempotency_key", idempotency_key, MAX_KEY_LENGTH)
    queue_name = _check_text("queue", queue, 100)
    if not _QUEUE_NAME.fullmatch(queue_name):
        raise InvalidOutboxMessageError(
            "queue", "use 1-100 characters from [A-Za-z0-9_.-] (':' is BullMQ's key separator)"
        )
    return key, queue_name, _check_text("name", name, MAX_NAME_LENGTH)


def _non_negative_int(field: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise InvalidOutboxMessageError(field, f"must be an int from 0 to {limit}")
    return value


def _keep(field: str, value: object) -> object:
    if value is True:
        raise InvalidOutboxMessageError(
            field,
            "True removes jobs at once, which ends BullMQ's deduplication of a re-published job;"
            " keep them by age and/or count, e.g. {'age': 604800}",
        )
    if value is False:
        return False
    if isinstance(value, int) and not isinstance(value, bool):
        if value == 0:
            raise InvalidOutboxMessageError(
                field, "0 keeps no job (like True): a re-published job would run again"
            )
        return _non_negative_int(field, value, 10**9)
    if isinstance(value, Mapping) and value and set(value) <= {"age", "count"}:
        kept = {k: _non_negative_int(f"{field}.{k}", v, 10**9) for k, v in value.items()}
        if 0 in kept.values():
            raise InvalidOutboxMessageError(
                field, "an age or count of 0 removes jobs at once, ending deduplication"
            )
        return kept
    raise InvalidOutboxMessageError(field, "must be False, a count, or {'age': s, 'count': n}")


def check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate BullMQ job options (the subset the relay supports) and fill in defaults.

    Supported: ``attempts``, ``backoff`` (ms, or ``{"type": "exponential"|"fixed", "delay": ms}``),
    ``delay``, ``priority``, ``lifo``, ``removeOnComplete``, ``removeOnFail``. ``jobId`` is set by
    the outbox from the idempotency key.

    Raises:
        InvalidOutboxMessageError: An unknown key or a bad value.
    """
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise InvalidOutboxMessageError("options", "must be a mapping of BullMQ job options")
    result: dict[str, Any] = {}
    for key, value in options.items():
        if key == "attempts":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
                raise InvalidOutboxMessageError("options.attempts", "must be an int from 1 to 1000")
            result[key] = value
        elif key == "backoff":
            if isinstance(value, int) and not isinstance(value, bool):
                result[key] = {
                    "type": "fixed",
                    "delay": _non_negative_int("options.backoff", value, 2**31),
                }
            elif (
                isinstance(value, Mapping)
                and value.get("type") in ("exponential", "fixed")
                and set(value) <= {"type", "delay"}
            ):
                delay = _non_negative_int("options.backoff.delay", value.get("delay", 0), 2**31)
                result[key] = {"type": value["type"], "delay": delay}
            else:
                raise InvalidOutboxMessageError(
                    "options.backoff", "must be ms or {'type': 'exponential'|'fixed', 'delay': ms}"
                )
        elif key in ("delay", "priority"):
            result[key] = _non_negative_int(
                f"options.{key}", value, 2**21 if key == "priority" else 2**31
            )
        elif key == "lifo":
            if not isinstance(value, bool):
                raise InvalidOutboxMessageError("options.lifo", "must be a bool")
            result[key] = value
        elif key in ("removeOnComplete", "removeOnFail"):
            result[key] = _keep(f"options.{key}", value)
        elif key == "jobId":
            raise InvalidOutboxMessageError(
                "options.jobId",
                "is derived from the idempotency key (bullmq_job_id); do not set it",
            )
        else:
            shown = key if isinstance(key, str) else type(key).__name__
            raise InvalidOutboxMessageError("options", f"unsupported job option {shown!r:.60}")
    result.setdefault("removeOnComplete", dict(DEFAULT_KEEP))
    result.setdefault("removeOnFail", dict(DEFAULT_KEEP))
    return result
