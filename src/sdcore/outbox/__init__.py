"""The transactional outbox: write messages with your data, relay them to a queue afterwards.

``Outbox.enqueue_once`` writes in the caller's transaction (a rollback publishes nothing; a
duplicate idempotency key is a no-op); ``OutboxRelay`` publishes committed rows at least once,
with the same BullMQ job id every time, so re-publishes are deduplicated.
"""

from sdcore.outbox._model import (
    DEFAULT_KEEP,
    InvalidOutboxMessageError,
    OutboxError,
    OutboxMessage,
    OutboxStatus,
    Publisher,
    PublisherUnavailableError,
    check_options,
)
from sdcore.outbox._outbox import DEFAULT_CHANNEL, Outbox, OutboxEntry
from sdcore.outbox._relay import OutboxRelay, OutboxStats, RelayState

__all__ = [
    "DEFAULT_CHANNEL",
    "DEFAULT_KEEP",
    "InvalidOutboxMessageError",
    "Outbox",
    "OutboxEntry",
    "OutboxError",
    "OutboxMessage",
    "OutboxRelay",
    "OutboxStats",
    "OutboxStatus",
    "Publisher",
    "PublisherUnavailableError",
    "RelayState",
    "check_options",
]
