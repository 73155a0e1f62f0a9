"""BullMQ queues on Redis (extra ``sdcore[bullmq]``): publish outbox messages, process jobs.

``BullMQPublisher`` is the outbox relay's publisher (deterministic, Node-safe job ids, so a
re-publish is deduplicated); ``Processor`` + ``Workers`` consume queues like NestJS
``@Processor`` + ``WorkerHost``, with the Python client's traps handled. Importing this package
without the ``bullmq`` package raises ``ImportError`` naming the extra to install.
"""

try:
    import bullmq as _bullmq  # type: ignore[import-untyped]  # noqa: F401
    import redis.asyncio as _redis  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "sdcore.queues needs the optional bullmq and redis packages: pip install 'sdcore[bullmq]'"
    ) from _exc

from sdcore.queues._bullmq import Job, UnrecoverableError
from sdcore.queues._errors import (
    InvalidProcessorError,
    JobRejectedError,
    JobTooLargeError,
    QueuesError,
    RedisClientError,
    RedisUnavailableError,
)
from sdcore.queues._processor import Processor, is_final_attempt
from sdcore.queues._publisher import DEFAULT_MAX_JOB_BYTES, DEFAULT_PREFIX, BullMQPublisher
from sdcore.queues._redis import RedisServerInfo, check_redis_server, queues_enabled
from sdcore.queues._workers import Workers

__all__ = [
    "DEFAULT_MAX_JOB_BYTES",
    "DEFAULT_PREFIX",
    "BullMQPublisher",
    "InvalidProcessorError",
    "Job",
    "JobRejectedError",
    "JobTooLargeError",
    "Processor",
    "QueuesError",
    "RedisClientError",
    "RedisServerInfo",
    "RedisUnavailableError",
    "UnrecoverableError",
    "Workers",
    "check_redis_server",
    "is_final_attempt",
    "queues_enabled",
]
