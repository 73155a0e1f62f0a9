"""The debounced ``NOTIFY`` of ``Outbox.enqueue_once`` (``notify_interval_ms``).

PostgreSQL serializes the commits of notifying transactions, so within one interval only the
enqueue that opens it notifies, and the others go quiet once a notifying transaction of the
interval has committed: the relay it woke looks again every interval for a second and finds
them. Which of them has committed only the database knows, so an enqueue inside the interval runs
the ``watch`` statement, which notifies unless one has (and, while none has, at most
``MAX_COVERS`` enqueues more per interval notify so that a long transaction does not hold back
the rows committed beside it). A slot is kept only by an enqueue that inserted a row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

# Per interval: the notifying enqueue that opened it, and at most this many more that notified
# because none of the earlier ones had committed yet.
MAX_COVERS = 1


@dataclass(slots=True, eq=False)
class Slot:
    """One notifying enqueue, once its statement inserted the row: ``"<transaction id>:<row id>"``.

    The row id goes with the transaction's: a savepoint rolled back discards the NOTIFY with the
    row, so the watch statement counts a NOTIFY as sent only while its row exists.
    """

    xid: str | None = None


@dataclass(slots=True)
class Interval:
    """The NOTIFYs sent in the current debounce interval (for one database, table, channel)."""

    at: float
    slots: list[Slot]


@dataclass(frozen=True, slots=True)
class Plan:
    """How one enqueue notifies: ``notify``, ``quiet`` or ``watch`` (the statement decides)."""

    kind: str
    key: Hashable = None
    slot: Slot | None = None  # the NOTIFY slot this enqueue took
    watched: str | None = None  # for ``watch``: the known notifiers' "<xid>:<row id>"s
    may_cover: bool = False


# The NOTIFYs of the current interval, per (database, table, channel), for this process: shared
# by every Outbox instance, so `Outbox().enqueue_once(...)` per call debounces too.
_intervals: dict[Hashable, Interval] = {}
# Held by each plan and settle: blocking enqueues (sdcore.sync) run them from many threads, beside
# the event loop's, and each reads an interval, then changes it (a slot given back by two threads
# at once would delete the interval twice).
_lock = threading.Lock()


def plan_notify(key: Hashable, interval_ms: int) -> Plan:
    """Decide how an enqueue under a debounced outbox notifies, and take a slot if it does."""
    with _lock:
        return _plan(key, interval_ms)


def _plan(key: Hashable, interval_ms: int) -> Plan:
    now = time.monotonic()
    current = _intervals.get(key)
    if current is None or now - current.at >= interval_ms / 1000:
        if len(_intervals) > 1000:  # many databases in one process: forget, notify again
            _intervals.clear()
        slot = Slot()
        _intervals[key] = Interval(now, [slot])
        return Plan("notify", key, slot)
    may_cover = len(current.slots) <= MAX_COVERS
    known = [s.xid for s in current.slots if s.xid is not None]
    if known:
        return Plan("watch", key, watched=",".join(known), may_cover=may_cover)
    if may_cover:
        # The notifiers' statements are still running: whether they insert, and when they
        # commit, is unknown, so this one announces its own row.
        slot = Slot()
        current.slots.append(slot)
        return Plan("notify", key, slot)
    return Plan("quiet")


def settle(plan: Plan, inserted: Sequence[Any] | None) -> None:
    """Keep or give back the slot an enqueue took, or record one it sent, once it ran.

    Args:
        plan: What :func:`plan_notify` decided.
        inserted: The enqueue statement's row (``id, job_id, xid`` and, for ``watch``,
            ``own, committed, open``), or ``None`` if it inserted nothing.
    """
    if plan.key is None:
        return  # "quiet" or "notify" without a debounce: nothing was taken
    with _lock:
        _settle(plan, inserted)


def _settle(plan: Plan, inserted: Sequence[Any] | None) -> None:
    current = _intervals.get(plan.key)
    if plan.slot is not None:
        if inserted is not None:
            plan.slot.xid = f"{inserted[2]}:{inserted[0]}"
        elif current is not None and plan.slot in current.slots:
            # Nothing inserted, so nothing was announced: the slot is free again.
            current.slots.remove(plan.slot)
            if not current.slots:
                del _intervals[plan.key]
    elif plan.kind == "watch" and inserted is not None:
        own, committed, still_open = inserted[3], inserted[4], inserted[5]
        if own or committed or (still_open and not plan.may_cover):
            return
        slot = Slot(f"{inserted[2]}:{inserted[0]}")
        if not still_open:
            # Every NOTIFY of the interval was rolled back (or is unknown): this one, sent now,
            # opens a new interval.
            _intervals[plan.key] = Interval(time.monotonic(), [slot])
        elif current is not None:
            current.slots.append(slot)
