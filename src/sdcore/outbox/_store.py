"""The relay's storage port, ``OutboxStore``, and its PostgreSQL implementation.

The relay's policy (batches, retry delays, dead-lettering, back-off, pruning cadence) lives in
:class:`~sdcore.outbox.OutboxRelay`; everything it reads or writes goes through these methods.
``sdcore.testing.MemoryOutboxStore`` implements the same port in memory, and one contract suite
(``tests/contract/test_outbox_store.py``) runs against both.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import psycopg
from psycopg.rows import RowMaker
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.errors import error_text
from sdcore._internal.redact import redact_text
from sdcore._internal.validation import at_least, non_empty_str
from sdcore.outbox._listen import pg_notifications
from sdcore.outbox._model import (
    OutboxDatabaseError,
    OutboxMessage,
    OutboxStatus,
    ReadOnlyDict,
    UndecodedPayload,
    job_id_v2,
    read_only_json,
)
from sdcore.outbox._outbox import Outbox

MAX_ERROR_LENGTH = 2000
NO_BYTE_BOUND = 2**62
"""The byte budget of a claim given ``max_bytes=None`` (more than any table holds)."""
"""Longest ``last_error`` a store keeps (the relay cuts errors to this length)."""

_decode = json.JSONDecoder().decode  # the claim's jsonb columns, read as text
# Distinct options values kept decoded per store (cleared when full); longer texts are decoded
# per row.
_SHARED_OPTIONS_MAX = 256
_SHARED_OPTIONS_MAX_CHARS = 4096
_NO_OPTIONS = ReadOnlyDict()


def _undecoded(row: Sequence[Any]) -> UndecodedPayload:
    """Name the claimed row's first JSON column that Python cannot decode (see ``claim``)."""
    for field, text in (("payload", row[5]), ("options", row[6]), ("trace_context", row[10])):
        try:
            if text is not None:
                _decode(text)
        except (ValueError, RecursionError) as exc:
            return UndecodedPayload(field, error_text(exc)[:300])
    return UndecodedPayload("payload", "not decodable")


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxStats:
    """Row counts of the outbox table."""

    pending: int
    due: int
    dead: int
    published: int
    oldest_pending_age_s: float | None
    tombstones: int = 0
    """Published rows pruned to their key (kept for the outbox's deduplication window)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxFailure:
    """One message's failed publish attempt, as the relay records it.

    Attributes:
        id: The row's id.
        error: What went wrong (at most :data:`MAX_ERROR_LENGTH` characters are kept).
        delay_ms: When the row is due again, from now (ignored if the row becomes ``DEAD``).
    """

    id: int
    error: str
    delay_ms: int


@runtime_checkable
class OutboxStore(Protocol):
    """Where the relay claims outbox rows and records what became of them.

    Every outcome but a delivery is fenced by the claim token: a relay whose claim expired and
    was taken over by another cannot record a failure or an unclaim over the other's outcome.
    Times are the store's clock (PostgreSQL's ``clock_timestamp()``).
    """

    @property
    def listens(self) -> bool:
        """Whether :meth:`notifications` can wake the relay (else it only polls)."""
        ...

    def notifications(self) -> AsyncIterator[None]:
        """Yield once when listening starts (to catch up) and once per new-row notification.

        Raises whatever broke the subscription; the relay logs it and subscribes again.
        """
        ...

    async def claim(
        self, *, limit: int, claim_ms: int, token: uuid.UUID, max_bytes: int | None = None
    ) -> list[OutboxMessage]:
        """Claim due rows for ``claim_ms`` under ``token``, counting an attempt.

        Due: ``PENDING``, ``next_attempt_at`` reached, and not under a live claim; oldest
        ``next_attempt_at`` first, then by id. A claim takes at most ``limit`` rows and at most
        ``max_bytes`` of payload (as jsonb text; ``None``: no byte bound), but always the first
        due row, however large. A row whose last claim expired with no outcome (its relay died
        while publishing it) is claimed alone, and a batch stops before it; if its attempts are
        already spent it becomes ``DEAD`` (``last_error`` says how many claims were lost) and
        is not returned. The messages carry the attempts after this one.
        """
        ...

    async def mark_published(self, ids: Sequence[int]) -> None:
        """Record deliveries: ``PENDING`` or ``DEAD`` rows become ``PUBLISHED``, whoever's claim.

        A delivery is a fact: the job is in the broker, so the row is neither due nor dead.
        """
        ...

    async def mark_failed(
        self, failures: Sequence[OutboxFailure], *, token: uuid.UUID
    ) -> dict[int, OutboxStatus]:
        """Record failed attempts under ``token``: back off, or ``DEAD`` after ``max_attempts``.

        Returns:
            ``{id: new status}`` of the rows this claim still held; the others are left alone.
        """
        ...

    async def unclaim(self, ids: Sequence[int], *, token: uuid.UUID, error: str) -> None:
        """Give back rows claimed under ``token`` without counting the attempt (broker down)."""
        ...

    async def stats(self) -> OutboxStats:
        """Count the rows by status."""
        ...

    async def tombstone(self, *, older_than_ms: int, limit: int) -> int:
        """Drop the payload of up to ``limit`` rows published before ``older_than_ms`` ago.

        The key, digest and job id are kept (the key stays taken). Returns how many changed.
        """
        ...

    async def prune(self, *, older_than_ms: int, limit: int) -> int:
        """Delete up to ``limit`` tombstones published before ``older_than_ms`` ago.

        Returns how many were deleted (their keys are free again).
        """
        ...


@contextlib.contextmanager
def database_errors(action: str) -> Iterator[None]:
    """Raise a driver error (or a lost connection) as :class:`OutboxDatabaseError`."""
    try:
        yield
    except psycopg.Error as exc:
        detail = redact_text(error_text(exc)[:500])
        raise OutboxDatabaseError(action, exc.sqlstate, detail) from exc
    except OSError as exc:
        raise OutboxDatabaseError(action, None, redact_text(error_text(exc)[:500])) from exc


def check_claim(
    limit: object, claim_ms: object, token: object, max_bytes: object = None
) -> tuple[int, int, uuid.UUID, int]:
    """Validate :meth:`OutboxStore.claim`'s arguments (every store calls this one check).

    Returns:
        ``(limit, claim_ms, token, max_bytes)``, with :data:`NO_BYTE_BOUND` for ``None``.
    """
    if not isinstance(token, uuid.UUID):
        raise TypeError(f"token must be a uuid.UUID, got {type(token).__name__}")
    budget = NO_BYTE_BOUND if max_bytes is None else at_least("max_bytes", max_bytes, 1)
    return at_least("limit", limit, 1), at_least("claim_ms", claim_ms, 1), token, budget


def check_ids(ids: object) -> list[int]:
    """Validate row ids: a sequence (not a str) of ints."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
    return [at_least("id", value, 1) for value in ids]


def check_token(token: object) -> uuid.UUID:
    """Validate a claim token."""
    if not isinstance(token, uuid.UUID):
        raise TypeError(f"token must be a uuid.UUID, got {type(token).__name__}")
    return token


def check_error(error: object) -> str:
    """Validate an error text; return it cut to :data:`MAX_ERROR_LENGTH` and storable."""
    if not isinstance(error, str):
        raise TypeError(f"error must be a str, got {type(error).__name__}")
    text = error.replace("\x00", "\\0")[:MAX_ERROR_LENGTH]
    return text.encode("utf-8", "replace").decode("utf-8")


def check_failures(failures: object) -> list[OutboxFailure]:
    """Validate failures: a sequence of :class:`OutboxFailure`, each id once."""
    if isinstance(failures, str | bytes) or not isinstance(failures, Sequence):
        raise TypeError("failures must be a sequence of OutboxFailure")
    checked: list[OutboxFailure] = []
    seen: set[int] = set()
    for failure in failures:
        if not isinstance(failure, OutboxFailure):
            raise TypeError(f"failures must be OutboxFailure, got {type(failure).__name__}")
        row_id = at_least("failure.id", failure.id, 1)
        if row_id in seen:
            raise ValueError(f"failure for row {row_id} given twice")
        seen.add(row_id)
        error = check_error(failure.error)
        checked.append(
            OutboxFailure(
                id=row_id, error=error, delay_ms=at_least("delay_ms", failure.delay_ms, 0)
            )
        )
    return checked


def check_age(older_than_ms: object, limit: object) -> tuple[int, int]:
    """Validate a prune step's age and batch size."""
    return at_least("older_than_ms", older_than_ms, 0), at_least("limit", limit, 1)


class PostgresOutboxStore:
    """:class:`OutboxStore` on an outbox table in PostgreSQL (the relay's production store).

    Claims and outcomes are short autocommit statements on ``pool``; ``FOR UPDATE SKIP LOCKED``
    and the claim time keep concurrent relays off each other's rows. A failed statement raises
    :class:`~sdcore.outbox.OutboxDatabaseError` (the driver's error is its ``__cause__``).

    Args:
        pool: Connection pool for the outbox's database.
        outbox: The outbox table (default ``Outbox()``).
        listen_dsn: LISTEN on a direct connection to this DSN instead of one made from the
            pool's settings (for a pool behind PgBouncer in transaction mode).
        transaction_pooling: The pool goes through a transaction-pooling proxy: statements are
            never prepared server-side, and without ``listen_dsn`` the store does not listen.

    Raises:
        TypeError: ``listen_dsn`` is not a str (nor ``None``).
        ValueError: ``listen_dsn`` is empty.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        outbox: Outbox | None = None,
        listen_dsn: str | None = None,
        transaction_pooling: bool = False,
    ) -> None:
        if listen_dsn is not None:
            non_empty_str("listen_dsn", listen_dsn)
        self.pool = pool
        self.outbox = outbox or Outbox()
        self._sql = self.outbox.sql
        self._listen_dsn = listen_dsn
        self._transaction_pooling = bool(transaction_pooling)
        # Under transaction pooling, a server-side prepared statement may be met (or missed) by
        # another client of the proxy.
        self._prepare: bool | None = False if self._transaction_pooling else None
        self._options: dict[str, Any] = {}  # options text -> its read-only decoded value
        self._identity: str | None = None  # the outbox's default namespace, read once

    @property
    def listens(self) -> bool:
        """``False`` only under transaction pooling without a ``listen_dsn``."""
        return self._listen_dsn is not None or not self._transaction_pooling

    def notifications(self) -> AsyncIterator[None]:
        """LISTEN on the outbox's channel on a connection of its own; yield per notification."""
        return pg_notifications(self.pool, channel=self.outbox.channel, listen_dsn=self._listen_dsn)

    async def _execute(self, action: str, query: bytes, params: tuple[Any, ...]) -> int:
        with database_errors(action):
            async with self.pool.connection() as conn:
                cur = await conn.execute(query, params, prepare=self._prepare)
                return int(cur.rowcount)

    async def claim(
        self, *, limit: int, claim_ms: int, token: uuid.UUID, max_bytes: int | None = None
    ) -> list[OutboxMessage]:
        """See :meth:`OutboxStore.claim`."""
        limit, claim_ms, token, budget = check_claim(limit, claim_ms, token, max_bytes)
        params = (limit, budget, claim_ms, token)
        with database_errors("claim"):
            async with self.pool.connection() as conn:
                cur: psycopg.AsyncCursor[OutboxMessage] = conn.cursor(row_factory=self._messages)
                await cur.execute(self._sql.claim, params, prepare=self._prepare)
                return await cur.fetchall()

    def _messages(self, cursor: psycopg.AsyncCursor[Any]) -> RowMaker[OutboxMessage]:
        # A row factory: each row becomes its message as it is read (no list of row tuples
        # kept alive beside the messages). The claim returns its JSON columns as text, decoded
        # here; equal options (usually every row's) are decoded once and shared, read-only.
        decode, options = _decode, self._options_of

        def message(r: Sequence[Any]) -> OutboxMessage:
            try:
                payload, opts = decode(r[5]), options(r[6])
                trace = None if r[10] is None else decode(r[10])
            except (ValueError, RecursionError):
                payload, opts, trace = _undecoded(r), _NO_OPTIONS, None
            return OutboxMessage(
                id=r[0],
                idempotency_key=r[1],
                queue=r[2],
                name=r[3],
                job_id=r[4],
                payload=payload,
                options=opts,
                attempts=r[7],
                max_attempts=r[8],
                created_at=r[9],
                trace_context=trace,
                job_namespace=r[11],
            )

        return message

    def _options_of(self, text: str) -> Any:
        known = self._options.get(text)
        if known is None:
            known = read_only_json(_decode(text))
            if len(text) <= _SHARED_OPTIONS_MAX_CHARS:
                if len(self._options) >= _SHARED_OPTIONS_MAX:
                    self._options.clear()
                self._options[text] = known
        return known

    async def mark_published(self, ids: Sequence[int]) -> None:
        """See :meth:`OutboxStore.mark_published`."""
        checked = check_ids(ids)
        if checked:
            await self._execute("mark_published", self._sql.published, (checked,))

    async def mark_failed(
        self, failures: Sequence[OutboxFailure], *, token: uuid.UUID
    ) -> dict[int, OutboxStatus]:
        """See :meth:`OutboxStore.mark_failed`."""
        checked, token = check_failures(failures), check_token(token)
        if not checked:
            return {}
        params = (
            [f.id for f in checked],
            [f.error for f in checked],
            [f.delay_ms for f in checked],
            token,
        )
        with database_errors("mark_failed"):
            async with self.pool.connection() as conn:
                cur = await conn.execute(self._sql.failed, params, prepare=self._prepare)
                return {row[0]: OutboxStatus(row[1]) for row in await cur.fetchall()}

    async def unclaim(self, ids: Sequence[int], *, token: uuid.UUID, error: str) -> None:
        """See :meth:`OutboxStore.unclaim`."""
        checked, token, text = check_ids(ids), check_token(token), check_error(error)
        if checked:
            await self._execute("unclaim", self._sql.unclaim, (text, checked, token))

    async def shared_job_ids(self, messages: Sequence[OutboxMessage]) -> set[int]:
        """Return the ids of the messages whose job id another row of the table holds too.

        Only rows with an ``sd2-`` id and no stored ``job_namespace`` (older than migration
        ``outbox/0005``, or written by hand) are looked up, and of those only the ones whose id
        is not their key's under the outbox's default namespace or its ``namespace``: every
        other id is checked against its key by the relay. Optional for other stores.
        """
        unknown = [m for m in messages if m.job_namespace is None and m.job_id.startswith("sd2-")]
        if not unknown:
            return set()
        with database_errors("shared_job_ids"):
            if self._identity is None:
                async with self.pool.connection() as conn:
                    cur = await conn.execute(
                        self._sql.identity, (self.outbox._target,), prepare=self._prepare
                    )
                    row = await cur.fetchone()
                self._identity = "" if row is None else str(row[0])
            namespaces = [ns for ns in (self._identity, self.outbox.namespace) if ns]
            suspect = [
                m.id
                for m in unknown
                if m.job_id not in {job_id_v2(ns, m.idempotency_key) for ns in namespaces}
            ]
            if not suspect:
                return set()
            async with self.pool.connection() as conn:
                cur = await conn.execute(self._sql.shared_job_ids, (suspect,), prepare=False)
                return {int(row[0]) for row in await cur.fetchall()}

    async def extend_claim(self, ids: Sequence[int], *, token: uuid.UUID, claim_ms: int) -> None:
        """Make the claim ``token`` of these rows last ``claim_ms`` from now (a publish still runs).

        Rows no longer held under ``token`` are left alone. Optional for other stores: the relay
        extends a claim only through a store that has this method.
        """
        checked, token = check_ids(ids), check_token(token)
        claim_ms = at_least("claim_ms", claim_ms, 1)
        if checked:
            await self._execute("extend_claim", self._sql.extend, (claim_ms, checked, token))

    async def stats(self) -> OutboxStats:
        """See :meth:`OutboxStore.stats` (one query)."""
        with database_errors("stats"):
            async with self.pool.connection() as conn:
                cur = await conn.execute(self._sql.stats, prepare=self._prepare)
                row = await cur.fetchone()
        assert row is not None  # noqa: S101 - an aggregate always returns one row
        age = None if row[4] is None else float(row[4])
        return OutboxStats(
            pending=row[0],
            due=row[1],
            dead=row[2],
            published=row[3],
            oldest_pending_age_s=age,
            tombstones=row[5],
        )

    async def tombstone(self, *, older_than_ms: int, limit: int) -> int:
        """See :meth:`OutboxStore.tombstone`."""
        return await self._execute(
            "tombstone", self._sql.tombstone, check_age(older_than_ms, limit)
        )

    async def prune(self, *, older_than_ms: int, limit: int) -> int:
        """See :meth:`OutboxStore.prune`."""
        return await self._execute("prune", self._sql.prune, check_age(older_than_ms, limit))
