"""The transactional outbox: write messages with your data, relay them to a queue afterwards.

``Outbox.enqueue_once`` writes in the caller's transaction (a rollback publishes nothing; the
same message under the same idempotency key is a no-op, another message under it an error);
``OutboxRelay`` publishes committed rows at least once, with the same BullMQ job id every time
(derived from the outbox's namespace and the key), so re-publishes are deduplicated. Publishers:
``sdcore.queues.BullMQPublisher`` (BullMQ on Redis) and ``sdcore.outbox.celery.CeleryPublisher``
(Celery over RabbitMQ or Redis, extra ``sdcore[celery]``).
"""

from sdcore.outbox._admin import OutboxAdmin, OutboxRow
from sdcore.outbox._model import (
    DEFAULT_KEEP,
    DuplicateOutboxKeyError,
    InvalidOutboxMessageError,
    InvalidOutboxRequestError,
    OutboxDatabaseError,
    OutboxError,
    OutboxKeyConflictError,
    OutboxMessage,
    OutboxStatus,
    OutboxTransactionRequiredError,
    Publisher,
    PublisherUnavailableError,
    ReadOnlyDict,
    ReadOnlyList,
    check_options,
)
from sdcore.outbox._outbox import (
    DEFAULT_CHANNEL,
    DEFAULT_DEDUP_WINDOW_MS,
    Outbox,
    OutboxDriver,
    OutboxEntry,
)
from sdcore.outbox._relay import (
    DEFAULT_RELAY_BATCH_BYTES,
    DEFAULT_RELAY_BATCH_SIZE,
    OutboxRelay,
    RelayState,
)
from sdcore.outbox._settings import RelaySettings
from sdcore.outbox._store import OutboxFailure, OutboxStats, OutboxStore, PostgresOutboxStore

__all__ = [
    "DEFAULT_CHANNEL",
    "DEFAULT_DEDUP_WINDOW_MS",
    "DEFAULT_KEEP",
    "DEFAULT_RELAY_BATCH_BYTES",
    "DEFAULT_RELAY_BATCH_SIZE",
    "DuplicateOutboxKeyError",
    "InvalidOutboxMessageError",
    "InvalidOutboxRequestError",
    "Outbox",
    "OutboxAdmin",
    "OutboxDatabaseError",
    "OutboxDriver",
    "OutboxEntry",
    "OutboxError",
    "OutboxFailure",
    "OutboxKeyConflictError",
    "OutboxMessage",
    "OutboxRelay",
    "OutboxRow",
    "OutboxStats",
    "OutboxStatus",
    "OutboxStore",
    "OutboxTransactionRequiredError",
    "PostgresOutboxStore",
    "Publisher",
    "PublisherUnavailableError",
    "ReadOnlyDict",
    "ReadOnlyList",
    "RelaySettings",
    "RelayState",
    "check_options",
]
