"""Values, errors and the publisher seam of the outbox; validation of what is enqueued."""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, NoReturn, Protocol

from sdcore._internal.errors import FieldError
from sdcore._internal.validation import boolean, field_error, int_between
from sdcore.exceptions import SdcoreError

MAX_KEY_LENGTH = 1024
MAX_NAME_LENGTH = 200
MAX_NAMESPACE_LENGTH = 200
# Node's Number.MAX_SAFE_INTEGER: a larger int reaches a Node worker rounded.
MAX_SAFE_INTEGER = 2**53 - 1
_QUEUE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")
# Completed jobs are kept a week: BullMQ deduplicates a job id only while the job exists, and the
# relay may re-publish a row (after a crash between publish and mark) long after the first publish.
DEFAULT_KEEP = {"age": 7 * 24 * 3600}


class OutboxStatus(enum.StrEnum):
    """State of an outbox row."""

    PENDING = "PENDING"
    PUBLISHED = "PUBLISHED"
    DEAD = "DEAD"


class OutboxError(SdcoreError):
    """Base class of the outbox's errors."""


class InvalidOutboxMessageError(FieldError, OutboxError, ValueError):
    """A message that cannot be enqueued (raised before any SQL).

    Attributes:
        field: The offending argument.
        problem: What is wrong with it.
    """


class InvalidOutboxRequestError(FieldError, OutboxError, ValueError):
    """An operator request (:class:`~sdcore.outbox.OutboxAdmin`) that failed validation, raised
    before any SQL.

    Attributes:
        field: The offending argument.
        problem: What is wrong with it.
    """


class OutboxKeyConflictError(OutboxError, ValueError):
    """The idempotency key is already taken by a different message (raised before any write).

    Reusing a key for another queue, name, payload or options would otherwise drop the new
    message silently. The same message again is not an error (``enqueue_once`` returns
    ``False``).

    Attributes:
        idempotency_key: The key.
        existing_queue: Queue of the message that holds the key.
        existing_name: Job name of the message that holds the key.
        existing_status: ``PENDING``, ``PUBLISHED`` or ``DEAD``.
        pruned: The holder is a tombstone (published, payload pruned, key kept for the
            deduplication window).
    """

    def __init__(
        self,
        idempotency_key: str,
        *,
        existing_queue: str,
        existing_name: str,
        existing_status: str,
        pruned: bool,
    ) -> None:
        self.idempotency_key = idempotency_key
        self.existing_queue = existing_queue
        self.existing_name = existing_name
        self.existing_status = existing_status
        self.pruned = pruned
        shown = idempotency_key if len(idempotency_key) <= 80 else idempotency_key[:79] + "…"
        holder = "a pruned message" if pruned else f"a {existing_status} message"
        super().__init__(
            f"idempotency key {shown!r} is taken by {holder} ({existing_name!r} on queue"
            f" {existing_queue!r}) with a different queue, name, payload or options; use a new"
            " key for a new message"
        )


class DuplicateOutboxKeyError(OutboxError, ValueError):
    """Two entries of one ``complete_and_enqueue`` call share an idempotency key.

    Attributes:
        idempotency_key: The repeated key.
        indexes: Positions of the entries that carry it.
    """

    def __init__(self, idempotency_key: str, indexes: tuple[int, ...]) -> None:
        self.idempotency_key = idempotency_key
        self.indexes = indexes
        shown = idempotency_key if len(idempotency_key) <= 80 else idempotency_key[:79] + "…"
        super().__init__(
            f"entries {', '.join(map(str, indexes))} share the idempotency key {shown!r}:"
            " only one of them could be written; give each message its own key"
        )


class OutboxTransactionRequiredError(OutboxError, RuntimeError):
    """``enqueue_once`` was given a connection that is not inside a transaction.

    On an autocommit connection the message would commit at once, before the business write it
    belongs to, and be published even if that write then fails.

    Attributes:
        connection_type: The type of the connection or session given.
    """

    def __init__(self, connection_type: str) -> None:
        self.connection_type = connection_type
        super().__init__(
            f"enqueue_once needs a transaction: the {connection_type} is in autocommit mode with"
            " no transaction open, so the message would commit before (and without) the change it"
            " belongs to. Open one (`async with conn.transaction():`, `session.begin()`), or pass"
            " allow_autocommit=True if committing the message alone is what you want"
        )


class PublisherUnavailableError(OutboxError, ConnectionError):
    """The broker (Redis) cannot be reached: not the message's fault; retried without counting.

    Args:
        timeout_s: Set by a publisher when a write got no answer within its socket timeout
            (this many seconds), rather than being refused outright; see :class:`Publisher`.
    """

    def __init__(self, *args: object, timeout_s: float | None = None) -> None:
        super().__init__(*args)
        self.timeout_s = timeout_s


class OutboxDatabaseError(OutboxError, ConnectionError):
    """A relay or store statement failed in the database (the driver's error is ``__cause__``).

    The relay backs off and retries; rows it had claimed stay claimed until their claim expires,
    then are published again under the same job id (deduplicated by BullMQ).

    Attributes:
        sqlstate: The SQLSTATE, or ``None`` when the connection failed before the server answered.
    """

    def __init__(self, action: str, sqlstate: str | None, detail: str) -> None:
        self.action = action
        self.sqlstate = sqlstate
        code = f" [{sqlstate}]" if sqlstate else ""
        super().__init__(f"outbox {action} failed in the database{code}: {detail}")


_READ_ONLY = (
    "a claimed message's options are read-only (messages with the same options share one"
    " object); change a copy: copy.deepcopy(message.options)"
)


class ReadOnlyDict(dict[str, Any]):
    """A ``dict`` that refuses every change: the ``options`` of a claimed :class:`OutboxMessage`.

    The relay's claim decodes each distinct ``options`` value once and hands the same object to
    every message that has it, so a change would reach other messages; it raises
    :class:`TypeError` instead. ``dict(value)`` and ``value.copy()`` give a plain shallow copy,
    ``copy.deepcopy(value)`` a plain deep one (nested dicts and lists included), and a pickled
    one comes back as a plain ``dict``.
    """

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(_READ_ONLY)

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple[type[dict[str, Any]], tuple[dict[str, Any]]]:
        return dict, (dict(self),)


class ReadOnlyList(list[Any]):
    """A ``list`` that refuses every change, for the arrays inside a :class:`ReadOnlyDict`."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(_READ_ONLY)

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = reverse = sort = clear = _refuse

    def __reduce__(self) -> tuple[type[list[Any]], tuple[list[Any]]]:
        return list, (list(self),)


class UndecodedPayload(dict[str, Any]):
    """The empty stand-in for a claimed row's JSON that Python cannot decode.

    jsonb holds values that Python's ``json`` refuses: an int of more than 4,300 digits, arrays
    or objects nested deeper than the interpreter's recursion limit. A store puts this in the
    row's ``payload`` (whichever column failed) so that the relay fails that row alone, as a
    poison message, instead of the whole claim raising for every batch that includes it.

    Attributes:
        field: The column that could not be decoded.
        problem: Why, as the decoder said it.
    """

    __slots__ = ("field", "problem")

    def __init__(self, field: str, problem: str) -> None:
        super().__init__()
        self.field = field
        self.problem = problem


def read_only_json(value: Any) -> Any:
    """Return decoded JSON with every dict and list replaced by a read-only copy.

    Iterative (no recursion, whatever the nesting); scalars are returned as they are.
    """
    root = _read_only(value)
    if root is value:
        return value
    stack: list[ReadOnlyDict | ReadOnlyList] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, item in list(node.items()):
                frozen = _read_only(item)
                if frozen is not item:
                    dict.__setitem__(node, key, frozen)
                    stack.append(frozen)
        else:
            for index, item in enumerate(node):
                frozen = _read_only(item)
                if frozen is not item:
                    list.__setitem__(node, index, frozen)
                    stack.append(frozen)
    return root


def _read_only(value: Any) -> Any:
    if type(value) is dict:
        return ReadOnlyDict(value)
    if type(value) is list:
        return ReadOnlyList(value)
    return value


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
    """BullMQ job options; read-only (a :class:`ReadOnlyDict`) in a claimed message."""
    attempts: int
    max_attempts: int
    created_at: datetime
    trace_context: dict[str, str] | None = None
    """The enqueuing span's W3C trace context (``traceparent``…), with ``sdcore.tracing``."""
    job_namespace: str | None = None
    """The namespace ``job_id`` was derived from (``None`` on rows before ``outbox/0005``)."""


class Publisher(Protocol):
    """Where the relay sends messages (BullMQ in production, a recorder in tests)."""

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        """Publish a batch; return ``None`` per published message, or the error that stopped it.

        Raise :class:`PublisherUnavailableError` when nothing could be published because the
        broker is unreachable (the relay backs off and does not count an attempt).

        A publisher may also define ``async def ping(self) -> bool`` (``True``: the broker
        answers now, within the socket timeout). When a one-message batch's write timed out
        (the error's ``timeout_s`` is set) and ``ping()`` then returns ``True``, the broker is up
        and the message cannot be written in time: the relay counts a failed attempt instead of
        backing off (``sdcore.queues.BullMQPublisher`` does both).
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


def check_key(idempotency_key: object) -> str:
    """Validate an idempotency key.

    Raises:
        InvalidOutboxMessageError: Naming ``idempotency_key``.
    """
    return _check_text("idempotency_key", idempotency_key, MAX_KEY_LENGTH)


def check_identity(idempotency_key: object, queue: object, name: object) -> tuple[str, str, str]:
    """Validate the key, the queue name and the job name.

    Raises:
        InvalidOutboxMessageError: Naming the argument.
    """
    key = check_key(idempotency_key)
    queue_name = _check_text("queue", queue, 100)
    if not _QUEUE_NAME.fullmatch(queue_name):
        raise InvalidOutboxMessageError(
            "queue", "use 1-100 characters from [A-Za-z0-9_.-] (':' is BullMQ's key separator)"
        )
    return key, queue_name, _check_text("name", name, MAX_NAME_LENGTH)


def check_namespace(namespace: object) -> str | None:
    """Validate an outbox namespace (part of every job id; ``None``: the outbox's identity).

    Raises:
        InvalidOutboxMessageError: Not a str, empty, too long, with NUL or invalid Unicode.
    """
    if namespace is None:
        return None
    return _check_text("namespace", namespace, MAX_NAMESPACE_LENGTH)


def job_id_v2(namespace: str, idempotency_key: str) -> str:
    """Return the BullMQ job id of ``idempotency_key`` in an outbox with ``namespace``.

    ``"sd2-"`` + the SHA-256 hex of ``f"{len(namespace_utf8)}:{namespace}{key}"`` (UTF-8): 68
    characters from ``[a-z0-9-]``, accepted by Node's BullMQ. The length prefix keeps distinct
    ``(namespace, key)`` pairs apart. The database computes the same id for rows it writes.
    """
    ns = namespace.encode("utf-8")
    text = str(len(ns)).encode() + b":" + ns + idempotency_key.encode("utf-8")
    return "sd2-" + hashlib.sha256(text).hexdigest()


def _canonical_float(literal: str) -> int | float:
    # jsonb keeps a number as the decimal its text spells: 10.0 and 1e+16 are the integers 10
    # and 10000000000000000 to jsonb's "=", so an integral float is written as that int.
    value = Decimal(literal)
    if value == value.to_integral_value():
        return int(value)
    return float(literal)


def message_digest(queue: str, name: str, payload: str, options: str) -> bytes:
    """Return the SHA-256 identity of a message, equal for messages that jsonb's ``=`` equates.

    The canonical form is the compact JSON of ``[queue, name, payload, options]`` with object
    keys sorted and every number written by its value (``10``, ``10.0`` and ``1e1`` alike; a
    non-integral float as its shortest ``repr``). Strings are compared exactly (no Unicode
    normalization), arrays in order, ``true`` is not ``1``.

    Args:
        queue: The queue name.
        name: The job name.
        payload: The payload's JSON text.
        options: The options' JSON text.
    """
    text = f"[{json.dumps(queue)},{json.dumps(name)},{payload},{options}]"
    value = json.loads(text, parse_float=_canonical_float)
    canonical = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).digest()


def check_exact_numbers(value: object, path: str = "$") -> None:
    """Refuse numbers that do not come back unchanged from jsonb and a Node worker.

    Refused: ``-0.0`` (jsonb has no negative zero), floats of magnitude 1e16 or more (jsonb
    returns them as ints, and 1e300 as a 301-digit int), and ints beyond ±(2^53 − 1) (a
    JavaScript number rounds them).

    Raises:
        InvalidOutboxMessageError: Naming the path of the first such number.
    """
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INTEGER:
            raise InvalidOutboxMessageError(
                "payload",
                f"{path}: int beyond ±(2^53 - 1) is rounded by a Node worker; send it as a string",
            )
        return
    if isinstance(value, float):
        if value == 0.0 and math.copysign(1.0, value) < 0:
            raise InvalidOutboxMessageError("payload", f"{path}: -0.0 comes back from jsonb as 0.0")
        if abs(value) >= 1e16:
            raise InvalidOutboxMessageError(
                "payload",
                f"{path}: float {value!r} comes back from jsonb as an int; send it as a string",
            )
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            check_exact_numbers(item, f"{path}.{str(key)[:40]}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_exact_numbers(item, f"{path}[{index}]")


_refused = field_error(InvalidOutboxMessageError)


def _non_negative_int(field: str, value: object, limit: int) -> int:
    return int_between(field, value, 0, limit, error=_refused)


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
            result[key] = int_between("options.attempts", value, 1, 1000, error=_refused)
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
            result[key] = boolean("options.lifo", value, error=_refused)
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
