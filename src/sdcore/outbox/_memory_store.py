"""``MemoryOutboxStore``: the outbox table and the relay's store port in process memory, the twin
of ``PostgresOutboxStore`` (public as ``sdcore.testing.MemoryOutboxStore``)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sdcore.outbox import (
    Outbox,
    OutboxFailure,
    OutboxKeyConflictError,
    OutboxMessage,
    OutboxStats,
    OutboxStatus,
)
from sdcore.outbox._model import job_id_v2, read_only_json
from sdcore.outbox._store import check_age, check_claim, check_error, check_failures, check_ids
from sdcore.outbox._store import check_token as _check_token

__all__ = ["MemoryOutboxRow", "MemoryOutboxStore"]


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _jsonb_text_bytes(value: Any) -> int:
    # jsonb's text puts a space after ':' and ',' and keeps non-ASCII characters as they are.
    return len(json.dumps(value, separators=(", ", ": "), ensure_ascii=False).encode())


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryOutboxRow:
    """One row of a :class:`MemoryOutboxStore`: the columns of the outbox table."""

    id: int
    idempotency_key: str
    queue: str
    name: str
    job_id: str
    payload: dict[str, Any]
    options: dict[str, Any]
    status: OutboxStatus
    attempts: int
    max_attempts: int
    next_attempt_at: datetime
    created_at: datetime
    claimed_until: datetime | None = None
    claim_token: uuid.UUID | None = field(default=None, repr=False)
    last_error: str | None = None
    published_at: datetime | None = None
    pruned_at: datetime | None = None
    digest: str = field(default="", repr=False)
    lost_claims: int = 0
    """Claims of this row that expired with no outcome (``lost_claims`` in PostgreSQL)."""
    claimed_alone: bool = False
    """Its last claim was one of its own, after a lost one (``claimed_alone`` in PostgreSQL)."""

    @property
    def payload_bytes(self) -> int:
        """The payload's size as jsonb text (``payload_bytes`` in PostgreSQL, near enough)."""
        return _jsonb_text_bytes(self.payload)


class MemoryOutboxStore:
    """The outbox table and the relay's ``OutboxStore`` port, in process memory.

    :meth:`enqueue` writes rows; given to :class:`~sdcore.outbox.OutboxRelay` in place of a
    ``PostgresOutboxStore`` (``OutboxRelay(MemoryOutboxStore(), publisher)``), it lets a relay's
    retry, back-off, dead-letter and pruning behaviour be tested with no database.

    It answers as :class:`~sdcore.outbox.PostgresOutboxStore` does (one contract suite runs
    against both), with ``clock`` playing PostgreSQL's ``clock_timestamp()``: pass a
    :class:`~sdcore.testing.FakeClock` to move retry delays, claims and retention by hand.

    Args:
        outbox: The outbox's settings (``max_attempts``, ``namespace``, ``notify``,
            ``dedup_window_ms``). Job ids are v2 ids of its ``namespace``, or of
            ``"memory"."<schema>"."<table>"`` when it has none.
        clock: The store's clock (aware datetimes). Defaults to the system clock.
        listens: Whether relays may subscribe to :meth:`notifications` (``False``: they poll,
            as under transaction pooling).

    Attributes:
        unavailable: While ``True``, every store method raises ``ConnectionError`` (as a
            database that is down), which the relay backs off from.
    """

    def __init__(
        self,
        *,
        outbox: Outbox | None = None,
        clock: Callable[[], datetime] = _utcnow,
        listens: bool = True,
    ) -> None:
        self.outbox = outbox or Outbox()
        self._clock = clock
        self._listens = bool(listens)
        self._rows: dict[int, MemoryOutboxRow] = {}
        self._by_key: dict[str, int] = {}
        self._next_id = 0
        self._subscribers: set[asyncio.Event] = set()
        self.unavailable = False
        ns = self.outbox.namespace
        self._namespace = ns or f'"memory"."{self.outbox.schema or "public"}"."{self.outbox.table}"'

    # --- writing and inspecting (the test's side) ----------------------------------------------

    def enqueue(
        self,
        *,
        idempotency_key: str,
        queue: str,
        name: str,
        payload: Mapping[str, Any],
        options: Mapping[str, Any] | None = None,
    ) -> bool:
        """Write one message as a committed :meth:`Outbox.enqueue_once` would.

        Returns:
            ``True`` if inserted, ``False`` if the key already holds the same message.

        Raises:
            InvalidOutboxMessageError: A bad key, queue, name or option.
            JsonTypeError: ``payload`` is not JSON.
            JsonValueError: ``payload`` cannot be stored in jsonb.
            OutboxKeyConflictError: The key holds a different message.
        """
        prepared = self.outbox._prepare(idempotency_key, queue, name, payload, options)
        stored_payload = json.loads(prepared.payload)
        stored_options = json.loads(prepared.options)
        digest = prepared.digest.hex()
        existing = self._by_key.get(prepared.key)
        if existing is not None:
            row = self._rows[existing]
            if row.digest != digest:
                raise OutboxKeyConflictError(
                    prepared.key,
                    existing_queue=row.queue,
                    existing_name=row.name,
                    existing_status=row.status.value,
                    pruned=row.pruned_at is not None,
                )
            return False
        now = self._clock()
        self._next_id += 1
        self._rows[self._next_id] = MemoryOutboxRow(
            id=self._next_id,
            idempotency_key=prepared.key,
            queue=prepared.queue,
            name=prepared.name,
            job_id=job_id_v2(self._namespace, prepared.key),
            payload=stored_payload,
            options=stored_options,
            status=OutboxStatus.PENDING,
            attempts=0,
            max_attempts=self.outbox.max_attempts,
            next_attempt_at=now,
            created_at=now,
            digest=digest,
        )
        self._by_key[prepared.key] = self._next_id
        if self.outbox.notify:
            for event in self._subscribers:
                event.set()
        return True

    def rows(self) -> list[MemoryOutboxRow]:
        """Every row, by id."""
        return [self._rows[i] for i in sorted(self._rows)]

    def get(self, row_id: int) -> MemoryOutboxRow | None:
        """The row with this id, if any."""
        return self._rows.get(row_id)

    def by_key(self, idempotency_key: str) -> MemoryOutboxRow | None:
        """The row holding this idempotency key, if any."""
        row_id = self._by_key.get(idempotency_key)
        return None if row_id is None else self._rows[row_id]

    # --- the OutboxStore port (the relay's side) ----------------------------------------------

    def _check_up(self) -> None:
        if self.unavailable:
            raise ConnectionError("injected: outbox store unavailable")

    @property
    def listens(self) -> bool:
        """See :attr:`sdcore.outbox.OutboxStore.listens`."""
        return self._listens

    async def notifications(self) -> AsyncIterator[None]:
        """See :meth:`sdcore.outbox.OutboxStore.notifications` (woken by :meth:`enqueue`)."""
        self._check_up()
        event = asyncio.Event()
        self._subscribers.add(event)
        try:
            yield None
            while True:
                await event.wait()
                event.clear()
                self._check_up()
                yield None
        finally:
            self._subscribers.discard(event)

    async def claim(
        self, *, limit: int, claim_ms: int, token: uuid.UUID, max_bytes: int | None = None
    ) -> list[OutboxMessage]:
        """See :meth:`sdcore.outbox.OutboxStore.claim`."""
        limit, claim_ms, token, budget = check_claim(limit, claim_ms, token, max_bytes)
        self._check_up()
        now = self._clock()
        due = sorted(
            (
                row
                for row in self._rows.values()
                if row.status is OutboxStatus.PENDING
                and row.next_attempt_at <= now
                and (row.claimed_until is None or row.claimed_until < now)
            ),
            key=lambda row: (row.next_attempt_at, row.id),
        )[:limit]
        # As PostgreSQL's claim: a row whose last claim expired with no outcome is claimed
        # alone (a batch stops before it), or marked DEAD once a claim of its own was lost too
        # and its attempts are spent.
        chosen: list[MemoryOutboxRow] = []
        rank = total = 0
        lost_seen = False
        for row in due:
            lost = row.claimed_until is not None
            if lost and row.claimed_alone and row.attempts >= row.max_attempts:
                self._rows[row.id] = replace(
                    row,
                    status=OutboxStatus.DEAD,
                    claimed_until=None,
                    claim_token=None,
                    lost_claims=row.lost_claims + 1,
                    last_error=(
                        f"claimed {row.attempts} times, {row.lost_claims + 1} of them with no"
                        " outcome: the relay died (or lost its database) while publishing it;"
                        " its job may already be in the broker"
                    ),
                )
                continue
            rank += 1
            lost_seen = lost_seen or lost
            total += row.payload_bytes
            if rank == 1 or (not lost_seen and total <= budget):
                chosen.append(row)
        messages = []
        for row in chosen:
            lost = row.claimed_until is not None
            claimed = replace(
                row,
                claimed_until=now + timedelta(milliseconds=claim_ms),
                claim_token=token,
                attempts=row.attempts + 1,
                lost_claims=row.lost_claims + lost,
                claimed_alone=lost,
            )
            self._rows[row.id] = claimed
            messages.append(
                OutboxMessage(
                    id=claimed.id,
                    idempotency_key=claimed.idempotency_key,
                    queue=claimed.queue,
                    name=claimed.name,
                    job_id=claimed.job_id,
                    payload=json.loads(json.dumps(claimed.payload)),
                    options=read_only_json(json.loads(json.dumps(claimed.options))),
                    attempts=claimed.attempts,
                    max_attempts=claimed.max_attempts,
                    created_at=claimed.created_at,
                    job_namespace=self._namespace,
                )
            )
        return messages

    async def mark_published(self, ids: Sequence[int]) -> None:
        """See :meth:`sdcore.outbox.OutboxStore.mark_published`."""
        checked = check_ids(ids)
        self._check_up()
        now = self._clock()
        for row_id in checked:
            row = self._rows.get(row_id)
            if row is not None and row.status in (OutboxStatus.PENDING, OutboxStatus.DEAD):
                self._rows[row_id] = replace(
                    row,
                    status=OutboxStatus.PUBLISHED,
                    published_at=now,
                    claimed_until=None,
                    claim_token=None,
                    last_error=None,
                )

    async def mark_failed(
        self, failures: Sequence[OutboxFailure], *, token: uuid.UUID
    ) -> dict[int, OutboxStatus]:
        """See :meth:`sdcore.outbox.OutboxStore.mark_failed`."""
        checked, token = check_failures(failures), _check_token(token)
        self._check_up()
        now = self._clock()
        landed: dict[int, OutboxStatus] = {}
        for failure in checked:
            row = self._rows.get(failure.id)
            if row is None or row.status is not OutboxStatus.PENDING or row.claim_token != token:
                continue
            dead = row.attempts >= row.max_attempts
            status = OutboxStatus.DEAD if dead else OutboxStatus.PENDING
            self._rows[row.id] = replace(
                row,
                claimed_until=None,
                claim_token=None,
                last_error=failure.error,
                next_attempt_at=now + timedelta(milliseconds=failure.delay_ms),
                status=status,
            )
            landed[row.id] = status
        return landed

    async def unclaim(self, ids: Sequence[int], *, token: uuid.UUID, error: str) -> None:
        """See :meth:`sdcore.outbox.OutboxStore.unclaim`."""
        checked, token, text = check_ids(ids), _check_token(token), check_error(error)
        self._check_up()
        for row_id in checked:
            row = self._rows.get(row_id)
            if row is None or row.status is not OutboxStatus.PENDING or row.claim_token != token:
                continue
            self._rows[row_id] = replace(
                row,
                claimed_until=None,
                claim_token=None,
                attempts=max(row.attempts - 1, 0),
                last_error=text,
            )

    async def shared_job_ids(self, messages: Sequence[OutboxMessage]) -> set[int]:
        """See :meth:`sdcore.outbox.PostgresOutboxStore.shared_job_ids` (every ``sd2-`` row with
        no stored namespace is looked up: this store has no default namespace)."""
        self._check_up()
        unknown = {
            m.id: m.job_id
            for m in messages
            if m.job_namespace is None and m.job_id.startswith("sd2-")
        }
        return {
            row_id
            for row_id, job_id in unknown.items()
            if any(r.job_id == job_id and r.id != row_id for r in self._rows.values())
        }

    async def extend_claim(self, ids: Sequence[int], *, token: uuid.UUID, claim_ms: int) -> None:
        """See :meth:`sdcore.outbox.PostgresOutboxStore.extend_claim`."""
        checked, token = check_ids(ids), _check_token(token)
        self._check_up()
        now = self._clock()
        for row_id in checked:
            row = self._rows.get(row_id)
            if row is None or row.status is not OutboxStatus.PENDING or row.claim_token != token:
                continue
            self._rows[row_id] = replace(row, claimed_until=now + timedelta(milliseconds=claim_ms))

    async def stats(self) -> OutboxStats:
        """See :meth:`sdcore.outbox.OutboxStore.stats`."""
        self._check_up()
        now = self._clock()
        rows = list(self._rows.values())
        pending = [row for row in rows if row.status is OutboxStatus.PENDING]
        oldest = min((row.created_at for row in pending), default=None)
        return OutboxStats(
            pending=len(pending),
            due=sum(1 for row in pending if row.next_attempt_at <= now),
            dead=sum(1 for row in rows if row.status is OutboxStatus.DEAD),
            published=sum(
                1 for row in rows if row.status is OutboxStatus.PUBLISHED and row.pruned_at is None
            ),
            oldest_pending_age_s=None if oldest is None else (now - oldest).total_seconds(),
            tombstones=sum(1 for row in rows if row.pruned_at is not None),
        )

    def _published_before(self, older_than_ms: int) -> Callable[[MemoryOutboxRow], bool]:
        cutoff = self._clock() - timedelta(milliseconds=older_than_ms)
        return lambda row: row.published_at is not None and row.published_at < cutoff

    async def tombstone(self, *, older_than_ms: int, limit: int) -> int:
        """See :meth:`sdcore.outbox.OutboxStore.tombstone`."""
        older_than_ms, limit = check_age(older_than_ms, limit)
        self._check_up()
        old = self._published_before(older_than_ms)
        now = self._clock()
        chosen = [
            row
            for row in self.rows()
            if row.status is OutboxStatus.PUBLISHED and row.pruned_at is None and old(row)
        ][:limit]
        for row in chosen:
            self._rows[row.id] = replace(row, payload={}, options={}, pruned_at=now)
        return len(chosen)

    async def prune(self, *, older_than_ms: int, limit: int) -> int:
        """See :meth:`sdcore.outbox.OutboxStore.prune`."""
        older_than_ms, limit = check_age(older_than_ms, limit)
        self._check_up()
        old = self._published_before(older_than_ms)
        chosen = [row for row in self.rows() if row.pruned_at is not None and old(row)][:limit]
        for row in chosen:
            del self._rows[row.id]
            del self._by_key[row.idempotency_key]
        return len(chosen)
