"""What the relay checks on a claimed row before publishing it, and how it logs failed attempts."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence

from sdcore._internal.errors import error_text
from sdcore.job_scheduler import bullmq_job_id
from sdcore.outbox._model import (
    InvalidOutboxMessageError,
    OutboxMessage,
    OutboxStatus,
    UndecodedPayload,
    check_identity,
    check_options,
    job_id_v2,
)

_JOB_ID = re.compile(r"sd2?-[0-9a-f]{64}")


def invalid_message(message: OutboxMessage) -> InvalidOutboxMessageError | None:
    """Why a claimed row must not be published, or ``None`` when it may.

    A row written straight into the table (not through ``enqueue_once``) is checked again: a
    bad queue name, a job id that is not its key's, options ``enqueue_once`` would refuse, or
    JSON that Python cannot decode, fails like a poison message and ends ``DEAD``.
    """
    if isinstance(message.payload, UndecodedPayload):
        return InvalidOutboxMessageError(
            message.payload.field, f"cannot be decoded in Python: {message.payload.problem}"
        )
    try:
        check_identity(message.idempotency_key, message.queue, message.name)
    except InvalidOutboxMessageError as exc:
        return exc
    if not isinstance(message.job_id, str) or _JOB_ID.fullmatch(message.job_id) is None:
        return InvalidOutboxMessageError(
            "job_id", "not an id sdcore writes (sd- or sd2- and 64 hex digits); row edited by hand?"
        )
    # Another key's job id would make BullMQ keep one of the two messages and drop the other as
    # its duplicate. A 0.1.0 id derives from the key alone; a v2 id from the stored namespace and
    # the key (rows older than migration outbox/0005 have no stored namespace: not checked).
    namespace = message.job_namespace
    if message.job_id.startswith("sd-"):
        expected: str | None = bullmq_job_id(message.idempotency_key)
    elif isinstance(namespace, str):
        expected = job_id_v2(namespace, message.idempotency_key)
    else:
        expected = None
    if expected is not None and message.job_id != expected:
        return InvalidOutboxMessageError(
            "job_id",
            "is not the id of this row's idempotency key (another message's id?); row edited by"
            " hand?",
        )
    # The options enqueue_once writes pass check_options; BullMQ options it never writes
    # (repeat, a priority out of range, a lifo that is not a bool, …) are refused, not published.
    try:
        check_options(message.options)
    except InvalidOutboxMessageError as exc:
        return exc
    return None


def log_failures(
    log: logging.Logger,
    failed: Sequence[tuple[OutboxMessage, BaseException]],
    landed: Mapping[int, OutboxStatus],
) -> None:
    """Log each failed attempt: ``DEAD`` at ERROR, a retry at WARNING, a lost claim at INFO."""
    for message, error in failed:
        if message.id not in landed:
            # Our claim was taken over: the other relay's outcome stands.
            log.info(
                "outbox message %d: publish failed (%s) after this relay's claim was"
                " taken over; the other relay's outcome stands",
                message.id,
                error_text(error)[:300],
                extra={
                    "action": "outbox_claim_lost",
                    "outbox_id": message.id,
                    "idempotency_key": message.idempotency_key,
                    "queue": message.queue,
                },
            )
            continue
        dead = landed[message.id] is OutboxStatus.DEAD
        log.log(
            logging.ERROR if dead else logging.WARNING,
            "outbox message %d (%r on queue %r) %s: %s",
            message.id,
            message.name,
            message.queue,
            "is DEAD" if dead else f"failed (attempt {message.attempts})",
            error_text(error)[:300],
            extra={
                "action": "outbox_dead" if dead else "outbox_publish_failed",
                "outbox_id": message.id,
                "idempotency_key": message.idempotency_key,
                "queue": message.queue,
            },
        )
