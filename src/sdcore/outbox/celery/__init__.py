"""The outbox relayed to Celery (extra ``sdcore[celery]``): publisher and consumer side.

``CeleryPublisher`` is an outbox relay's publisher that sends each message as a Celery task
(protocol v2, task id = the message's job id) over RabbitMQ, with publisher confirms, or Redis.
Brokers redeliver, and a relay that dies before marking a row publishes it again: on the
consumer side, ``exactly_once`` runs a task's database transaction once per task id, recorded
in a ``TaskLedger`` table in that same transaction. Importing this package without kombu and
celery raises ``ImportError`` naming the extra to install.
"""

try:
    import celery as _celery  # type: ignore[import-untyped]  # noqa: F401
    import kombu as _kombu  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "sdcore.outbox.celery needs the optional kombu and celery packages:"
        " pip install 'sdcore[celery]'"
    ) from _exc

from sdcore.outbox.celery._config import BrokerRefusedError
from sdcore.outbox.celery._message import MessageTooLargeError
from sdcore.outbox.celery._once import (
    DEFAULT_LEDGER_TABLE,
    LedgerTransactionRequiredError,
    TaskLedger,
    exactly_once,
)
from sdcore.outbox.celery._publisher import DEFAULT_MAX_MESSAGE_BYTES, CeleryPublisher

__all__ = [
    "DEFAULT_LEDGER_TABLE",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "BrokerRefusedError",
    "CeleryPublisher",
    "LedgerTransactionRequiredError",
    "MessageTooLargeError",
    "TaskLedger",
    "exactly_once",
]
