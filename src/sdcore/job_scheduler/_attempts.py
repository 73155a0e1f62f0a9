"""Scheduler tick operations on the lease table: an attempt budget, skipped ticks, tick records.

The plain lease (``acquire`` / ``run_exclusive``) takes a ``FAIL`` row at once, as the seed does.
A scheduled tick must not: its retry policy allows ``max_attempts`` runs across the cluster, each
after a backoff. The statements (``sdcore/postgres/sql/lease_ticks.sql``, rendered by
:class:`~sdcore.job_scheduler._sql.TickStatements`) keep that budget on the row (column
``attempts``, migration ``lease/0003``) and are used by :mod:`sdcore.scheduling` only.

Rules of ``acquire_attempt`` (everything else is the plain ``acquire``: a new row is
``RUNNING``; a takeover rotates the owner token, draws a higher fencing token from the table's
sequence, records the new owner's ``lease_ms``, clears ``data``):

- no row: insert it, ``attempts = 1``;
- ``RUNNING`` silent for longer than *its owner's* lease (its owner died): take it,
  ``attempts + 1`` (an abandoned attempt is re-run whatever the budget);
- ``FAIL`` released (column ``released``: by its owner's ``release()``, an operator, a backfill,
  or a new process start for a failed initial job): take it and start a new budget,
  ``attempts = 1``;
- ``FAIL`` given back by the acquire that won it (column ``given_back``, written by
  ``give_back()``: its answer came too late to keep the lease, or its caller was cancelled, so
  the handler never ran): take it at once, whatever the budget, with the same attempt number
  (``attempts`` unchanged: that attempt never ran). Catch-up treats such a tick as not settled;
- ``FAIL`` otherwise: take it only while ``attempts < max_attempts`` and once
  ``backoff_ms * 2 ** (attempts - 1)`` (at most 2**31 - 1 ms; 0 for a skipped tick, whose
  ``attempts`` is 0) has passed since the failure by the database clock;
- ``SUCCESS``: never.

The marks are columns of their own (migration ``lease/0007``), written only by the lease's own
statements: the ``data`` a caller passes to ``fail``/``complete`` is never read as lease state,
so no payload can start a new budget or have its tick retaken. A skip record (``FAIL``,
``attempts = 0``) that a busy replica commits while a free replica's insert of the tick is in
flight is taken over by that insert: a skip never costs a run another replica would have made.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, overload

from sdcore._internal.validation import int_between
from sdcore.job_scheduler._model import JobAcquireResult, JobSchedulerStatus

MAX_BACKOFF_MS = 2**31 - 1  # also written out in lease_ticks.sql
GIVEN_BACK = "given_back"  # the data key of a run given back unstarted (see the rules above)


def given_back(reason: str) -> dict[str, str]:
    """The ``data`` that ``give_back(lease, reason)`` stores for operators to read.

    Passing it to ``fail`` records an ordinary failure: the mark is ``give_back``'s column.
    """
    return {GIVEN_BACK: reason}


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptBudget:
    """How often a tick may run across the cluster.

    Attributes:
        max_attempts: Runs allowed (``retries + 1``), at least 1.
        backoff_ms: Wait after the first failure, doubled after each further one (at most
            2**31 - 1 ms), by the database clock.
    """

    max_attempts: int
    backoff_ms: int

    def __post_init__(self) -> None:
        int_between("max_attempts", self.max_attempts, 1, MAX_BACKOFF_MS)
        int_between("backoff_ms", self.backoff_ms, 0, MAX_BACKOFF_MS)


@dataclass(frozen=True, slots=True, kw_only=True)
class TickRecord:
    """What the lease table says about one tick.

    Attributes:
        status: The row's status.
        attempts: Runs started for the tick (0: recorded as skipped, never run).
        skipped: Why the tick was skipped (``"overlap"``), if it was recorded as skipped.
        released: An operator (or ``release()``) reopened the tick.
        age_ms: Milliseconds since the row last changed, by the database clock (how much of a
            retry backoff has passed).
        given_back: The acquire that won the tick gave it back without running it (it answered
            too late to keep the lease, or its caller was cancelled): any replica may take it
            at once, with the same attempt number.
        given_back_reason: Why it was given back (``"acquire answered too late"``,
            ``"cancelled"``), when ``given_back``.
    """

    status: JobSchedulerStatus
    attempts: int
    skipped: str | None
    released: bool
    age_ms: float = 0.0
    given_back: bool = False
    given_back_reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptAcquireResult:
    """What ``acquire_attempt`` (and each item of ``acquire_attempts``) answers.

    Attributes:
        result: The acquire's outcome, as ``acquire`` returns it.
        attempt: The row's attempt number once acquired (1 for a first run); 0 when not
            acquired.

    Unpacking it as the former ``(result, attempt)`` pair, or indexing it with 0 or 1, still
    works for one release more (without a warning); read the attributes.
    """

    result: JobAcquireResult
    attempt: int

    def __iter__(self) -> Iterator[Any]:
        yield self.result
        yield self.attempt

    @overload
    def __getitem__(self, index: Literal[0]) -> JobAcquireResult: ...

    @overload
    def __getitem__(self, index: Literal[1]) -> int: ...

    def __getitem__(self, index: int) -> JobAcquireResult | int:
        if index == 0:
            return self.result
        if index == 1:
            return self.attempt
        raise IndexError(f"AttemptAcquireResult index must be 0 or 1, got {index!r}")
