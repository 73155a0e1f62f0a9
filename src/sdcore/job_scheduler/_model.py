"""Values, enums and errors of the job scheduler lease."""

from __future__ import annotations

import enum
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, Generic, Literal, TypeVar

from sdcore._internal.errors import FieldError
from sdcore.exceptions import SdcoreError

T = TypeVar("T")

DEFAULT_LEASE_MS: int = 900_000
"""Default lease length: 15 minutes."""

DEFAULT_HEARTBEAT_MS: int = 60_000
"""Largest default heartbeat interval: 60 seconds (the default is ``min(60 s, lease / 3)``)."""

MAX_SAFE_INTEGER: int = 2**53 - 1

LEASE_CLOCK_MARGIN: float = 0.02
"""Share of ``lease_ms`` the client gives up for clock-rate drift: its lease ends at 98 %.

A lease is valid on the client until the moment the statement that last confirmed it (the
acquire or a heartbeat) was *sent*, plus ``lease_ms * (1 - LEASE_CLOCK_MARGIN)``. The database
measures the same lease from a later instant (when it ran the statement) with its own clock; the
margin covers a database clock that runs up to 2 % faster than the client's (NTP keeps real
clocks within 0.05 %).
"""

LEASE_SLACK_MS: int = 500
"""How long past its client deadline ``run_exclusive`` may still spend recording the outcome.

``run_exclusive`` returns or raises at most this long after the lease ran out on the client
(plus the time an async callable takes to unwind from its cancellation). A finalize or heartbeat
statement that does not answer in time is abandoned: its connection is shut down, not cancelled
and awaited.
"""


class JobSchedulerStatus(enum.StrEnum):
    """State of one logical run."""

    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAIL = "FAIL"


class JobSchedulerType(enum.StrEnum):
    """Kind of logical run: once per tick (``SCHEDULE``) or once per code, ever (``INITIAL``)."""

    INITIAL = "INITIAL"
    SCHEDULE = "SCHEDULE"


class JobSchedulerError(SdcoreError):
    """Base class of every error raised by :mod:`sdcore.job_scheduler`."""


class LostJobLeaseError(JobSchedulerError):
    """The winner lost ownership of its run before it finished.

    Another replica may own the run now (its lease expired by the database clock, or an operator
    released it). Anything the old owner still writes must be fenced out by the resource.

    Attributes:
        job_id: The id of the lease row.
        reason: Why the loss was detected.
    """

    def __init__(self, job_id: str, reason: str = "ownership was lost") -> None:
        self.job_id = job_id
        self.reason = reason
        super().__init__(f"lost the lease of job {job_id}: {reason}")


class _InvalidOptionError(FieldError, JobSchedulerError, ValueError):
    """An option that failed validation (raised before any SQL).

    Attributes:
        field: The offending option.
        problem: What is wrong with it.
    """


class InvalidJobLeaseOptionsError(_InvalidOptionError):
    """Unsafe or malformed ``lease_ms`` / ``heartbeat_ms`` (``.field``, ``.problem``)."""


class InvalidJobIdentityOptionsError(_InvalidOptionError):
    """Ambiguous or malformed ``code``, ``type``, ``run_key`` or ``name``."""


class JobSchedulerUnavailableError(JobSchedulerError, ConnectionError):
    """The database could not be reached, or the outcome of a statement is unknown.

    Raised by ``acquire`` when no statement could be confirmed; the cause is the driver error.
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class JobScheduler:
    """One row of the lease table (the entity).

    ``owner_token`` is hidden from ``repr`` so that logging a row never leaks the capability.
    """

    TABLE_NAME: ClassVar[str] = "job_scheduler"

    id: str
    lock_key: str
    idempotency_key: str
    code: str
    name: str | None
    type: JobSchedulerType
    run_key: str | None
    status: JobSchedulerStatus
    owner_token: str = field(repr=False)
    fencing_token: int
    data: dict[str, Any] | None
    created_at: datetime
    modified_at: datetime
    lease_ms: int | None = None
    """The lease the current owner asked for; ``None`` on rows last written by sdcore 0.1.0."""

    @classmethod
    def ddl(cls, table: str = "job_scheduler", schema: str | None = None) -> str:
        """Return the DDL that creates the table, its constraints and indexes.

        Args:
            table: Table name (quoted safely).
            schema: Schema name, or ``None`` for the connection's default schema.

        Returns:
            The SQL script applied by ``ensure_schema()`` and ``sdcore db upgrade``.
        """
        from sdcore.postgres import schema_sql

        return schema_sql(table=table, schema=schema)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobLease:
    """The fencing capability of one run: only the holder of ``owner_token`` may write the row."""

    id: str
    owner_token: str = field(repr=False)


MAX_STATUS_KEYS: int = 10_000
"""Most lock keys one ``statuses()`` call accepts."""

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def _check_lease(lease: object) -> tuple[str, str]:
    """Validate a lease before any backend reads it; return ``(id, owner_token)`` lower-cased.

    Every backend calls this one function, so they refuse (and accept) exactly the same leases:
    both parts must be UUIDs in the canonical 8-4-4-4-12 hex form, in either case. The other
    spellings ``uuid.UUID()`` and PostgreSQL would take (hyphen-less, ``{…}``, ``urn:uuid:``,
    surrounding blanks) are refused.

    Raises:
        TypeError: ``lease`` is not a :class:`JobLease`.
        ValueError: ``lease.id`` or ``lease.owner_token`` is not a canonical UUID str.
    """
    if not isinstance(lease, JobLease):
        raise TypeError(f"lease must be a JobLease, got {type(lease).__name__}")
    job_id, token = lease.id, lease.owner_token
    if not isinstance(job_id, str) or _UUID.fullmatch(job_id) is None:
        raise ValueError("lease.id must be a UUID string")
    if not isinstance(token, str) or _UUID.fullmatch(token) is None:
        raise ValueError("lease.owner_token must be a UUID string")
    return job_id.lower(), token.lower()


def _check_lock_keys(lock_keys: Iterable[str], what: str = "lock keys") -> list[str]:
    """Validate the keys of a ``statuses()`` call (or the codes of a ``first_seen_many()``
    call: ``what``) before any backend reads them.

    Raises:
        ValueError: A single str instead of a sequence, more than :data:`MAX_STATUS_KEYS` keys,
            a key that is not a str, or a key PostgreSQL cannot store (NUL, invalid Unicode).
    """
    arg = what.replace(" ", "_")
    if isinstance(lock_keys, str | bytes):
        raise ValueError(f"{arg} must be a sequence of str, not a single str")
    keys = list(lock_keys)
    if len(keys) > MAX_STATUS_KEYS:
        raise ValueError(f"at most {MAX_STATUS_KEYS} {what} per call, got {len(keys)}")
    for key in keys:
        if type(key) is not str:
            raise ValueError(f"{what} must be str")
        if "\x00" in key:
            raise ValueError(f"{what} must not contain NUL")
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{what} must be valid Unicode (no lone surrogates)") from None
    return keys


class _LeaseState:
    """Mutable state shared between ``run_exclusive``, the backend and the callable.

    ``lost`` is a plain attribute: a bool store is atomic under the GIL, and a
    ``threading.Event`` per lease would cost microseconds on the lease hot path. ``deadline`` is a
    :func:`time.monotonic` instant (``inf`` when no client deadline is known, e.g. for a lease
    built by hand); ``valid`` is how long one confirmation holds the lease on the client.
    """

    __slots__ = ("deadline", "lost", "reason", "valid")

    def __init__(self, valid: float = math.inf, sent: float = 0.0) -> None:
        self.lost = False
        self.reason: str | None = None
        self.valid = valid
        self.deadline = sent + valid

    @classmethod
    def for_lease(cls, lease_ms: int, sent: float) -> _LeaseState:
        """The client lease of a statement sent at ``sent`` (monotonic) asking ``lease_ms``."""
        return cls(lease_ms * (1.0 - LEASE_CLOCK_MARGIN) / 1000.0, sent)

    def confirm(self, sent: float) -> None:
        """A statement sent at ``sent`` confirmed ownership: the lease holds from there."""
        deadline = sent + self.valid
        if deadline > self.deadline:
            self.deadline = deadline

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def mark_lost(self, reason: str) -> None:
        if not self.lost:
            self.reason = reason
            self.lost = True


@dataclass(frozen=True, slots=True, kw_only=True)
class JobExecutionLease(JobLease):
    """A :class:`JobLease` plus the stable ``idempotency_key`` and the ``fencing_token``.

    Inside ``run_exclusive`` the lease also reports whether it is still held: a plain function
    running in a worker thread should poll :attr:`is_held` (or call :meth:`raise_if_lost`) between
    steps, because a thread cannot be cancelled.

    A lease returned by ``acquire`` carries its *client deadline*: the instant (by this process's
    monotonic clock) until which ownership is guaranteed, i.e. when the confirming statement was
    sent plus ``lease_ms`` less :data:`LEASE_CLOCK_MARGIN`. Every successful ``heartbeat`` moves
    it. Check :attr:`time_left` before a side effect that must not happen after the lease ended.
    """

    idempotency_key: str
    fencing_token: int
    _state: _LeaseState = field(default_factory=_LeaseState, repr=False, compare=False)

    @property
    def is_held(self) -> bool:
        """``False`` once ownership is lost, cancelled, or the client deadline has passed."""
        state = self._state
        return not state.lost and time.monotonic() < state.deadline

    @property
    def deadline(self) -> float:
        """The client deadline as a :func:`time.monotonic` instant (``inf`` if unknown)."""
        return self._state.deadline

    @property
    def time_left(self) -> float:
        """Seconds until the client deadline (negative once passed; ``inf`` if unknown)."""
        return self._state.time_left()

    def raise_if_lost(self) -> None:
        """Raise :class:`LostJobLeaseError` if ownership is known to be lost.

        Raises:
            LostJobLeaseError: The heartbeat saw the loss, the run was cancelled, or the client
                deadline passed.
        """
        state = self._state
        if state.lost:
            raise LostJobLeaseError(self.id, state.reason or "ownership was lost")
        if time.monotonic() >= state.deadline:
            raise LostJobLeaseError(self.id, "the lease ran out on the client")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobAcquired:
    """``acquire`` won: this process owns the run until it finalizes or the lease expires."""

    acquired: Literal[True] = True
    row: JobScheduler
    id: str
    owner_token: str = field(repr=False)
    idempotency_key: str
    fencing_token: int
    _state: _LeaseState = field(default_factory=_LeaseState, repr=False, compare=False)

    @property
    def lease(self) -> JobExecutionLease:
        """The capability to heartbeat and finalize this run (every call shares one deadline)."""
        return JobExecutionLease(
            id=self.id,
            owner_token=self.owner_token,
            idempotency_key=self.idempotency_key,
            fencing_token=self.fencing_token,
            _state=self._state,
        )

    @property
    def deadline(self) -> float:
        """The lease's client deadline (see :attr:`JobExecutionLease.deadline`)."""
        return self._state.deadline

    @property
    def time_left(self) -> float:
        """Seconds until the client deadline (see :attr:`JobExecutionLease.time_left`)."""
        return self._state.time_left()


@dataclass(frozen=True, slots=True, kw_only=True)
class JobNotAcquired:
    """``acquire`` lost: another replica owns or already completed the run."""

    acquired: Literal[False] = False


JobAcquireResult = JobAcquired | JobNotAcquired


def _acquired(row: JobScheduler, state: _LeaseState) -> JobAcquired:
    """The result of a won acquire of ``row`` (every backend builds it here)."""
    return JobAcquired(
        row=row,
        id=row.id,
        owner_token=row.owner_token,
        idempotency_key=row.idempotency_key,
        fencing_token=row.fencing_token,
        _state=state,
    )


"""Discriminated union: test ``result.acquired`` (mypy narrows on it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunExclusiveResult(Generic[T]):
    """Outcome of ``run_exclusive``: ``acquired=False`` means the callable was not called."""

    acquired: bool
    result: T | None = None
