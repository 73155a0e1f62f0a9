"""The error tree of :mod:`sdcore.queues`."""

from __future__ import annotations

from sdcore.exceptions import SdcoreError


class QueuesError(SdcoreError):
    """Base class of the queues' errors."""


class RedisClientError(QueuesError, ValueError):
    """A Redis client BullMQ cannot use (wrong type, or ``decode_responses`` off).

    Attributes:
        problem: What is wrong with the client.
    """

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(f"unusable Redis client: {problem}")


class RedisUnavailableError(QueuesError, ConnectionError):
    """Redis could not be reached or refused the command (the redis-py error is ``__cause__``)."""


class JobTooLargeError(QueuesError, ValueError):
    """A job whose JSON data exceeds the publisher's ``max_job_bytes`` (a poison message).

    Attributes:
        job_id: The BullMQ job id.
        size: Bytes of the compact JSON data.
        limit: The publisher's limit.
    """

    def __init__(self, job_id: str, size: int, limit: int) -> None:
        self.job_id = job_id
        self.size = size
        self.limit = limit
        super().__init__(
            f"job {job_id}: data is {size} bytes of JSON, more than the {limit} allowed"
        )


class JobRejectedError(QueuesError, RuntimeError):
    """BullMQ's add script refused one job (a negative code from the Lua script).

    Attributes:
        job_id: The BullMQ job id.
        code: BullMQ's error code.
    """

    def __init__(self, job_id: str, code: int) -> None:
        self.job_id = job_id
        self.code = code
        super().__init__(f"BullMQ refused job {job_id} (code {code})")


class InvalidProcessorError(QueuesError, ValueError):
    """A processor that cannot be run (bad queue name, concurrency, or a sync ``process``).

    Attributes:
        processor: The processor's class name.
        problem: What is wrong.
    """

    def __init__(self, processor: str, problem: str) -> None:
        self.processor = processor
        self.problem = problem
        super().__init__(f"invalid processor {processor}: {problem}")
