"""``OutboxRelay``: publish committed outbox rows, at least once, in every replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.errors import error_text
from sdcore._internal.lifecycle import AsyncStartStop
from sdcore._internal.redact import redact_text
from sdcore._internal.supervisor import Supervisor
from sdcore._internal.telemetry import NOOP, Telemetry
from sdcore._internal.validation import at_least, int_between
from sdcore.outbox._listen import Notifications
from sdcore.outbox._model import (
    InvalidOutboxMessageError,
    OutboxDatabaseError,
    OutboxMessage,
    Publisher,
    PublisherUnavailableError,
)
from sdcore.outbox._outbox import Outbox
from sdcore.outbox._outcomes import invalid_message, log_failures
from sdcore.outbox._store import (
    MAX_ERROR_LENGTH,
    OutboxFailure,
    OutboxStats,
    OutboxStore,
    PostgresOutboxStore,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayState:
    """What the relay has been doing (for health checks)."""

    running: bool
    listening: bool
    broker_available: bool
    published: int
    failed: int
    last_publish_at: datetime | None
    last_error: str | None
    last_round_at: float | None = None
    """``time.monotonic()`` when a round (claim, publish, record) last completed."""


# Rows per claim: the throughput knee of benchmarks/outbox.py's sweep (docs/benchmarks.md#outbox).
DEFAULT_RELAY_BATCH_SIZE = 500
MAX_CLAIM_ROWS = 100_000
"""The most rows one claim may take (``batch_size``): a claim holds them all in memory."""
# Payload bytes per claim: bounds the relay's memory (about 4 copies of each batch in flight,
# two in flight: benchmarks/relay_memory.py) and the size of a Redis pipeline.
DEFAULT_RELAY_BATCH_BYTES = 8 * 1024 * 1024


def _store_of(
    given: object, outbox: Outbox | None, listen_dsn: str | None, transaction_pooling: bool
) -> OutboxStore:
    """Return the relay's store: ``given``, or (deprecated) a pool wrapped in a Postgres store."""
    if isinstance(given, OutboxStore):
        own: object = getattr(given, "outbox", None)
        if outbox is not None and outbox is not own:
            raise ValueError("outbox= is the store's own: leave it unset with a store")
        if listen_dsn is not None or transaction_pooling:
            raise ValueError(
                "listen_dsn / transaction_pooling configure a PostgresOutboxStore: pass"
                " them to the store, not to a relay given a store"
            )
        if outbox is not None:
            warnings.warn(
                "OutboxRelay(store, publisher, outbox=…) is deprecated: the relay's outbox is"
                " the store's, leave outbox= unset",
                DeprecationWarning,
                stacklevel=3,
            )
        return given
    if not isinstance(given, AsyncConnectionPool):
        raise TypeError(
            "store must be an OutboxStore, e.g. PostgresOutboxStore(pool), got"
            f" {type(given).__name__}"
        )
    warnings.warn(
        "OutboxRelay(pool, publisher, outbox=…, listen_dsn=…, transaction_pooling=…) is"
        " deprecated: pass a store, OutboxRelay(PostgresOutboxStore(pool, outbox=…,"
        " listen_dsn=…, transaction_pooling=…), publisher)",
        DeprecationWarning,
        stacklevel=3,
    )
    return PostgresOutboxStore(
        given, outbox=outbox, listen_dsn=listen_dsn, transaction_pooling=transaction_pooling
    )


class OutboxRelay(AsyncStartStop):
    """Claims due rows in short transactions, publishes them, marks them published.

    Run one in every replica: ``FOR UPDATE SKIP LOCKED`` plus a claim time keep relays off each
    other's rows. It wakes on ``LISTEN/NOTIFY`` (the outbox notifies on commit; a notification
    that arrives during a batch starts the next claim as soon as the batch is recorded) and polls
    every ``poll_interval_ms`` as a fallback; after finding rows it looks again every
    ``outbox.notify_interval_ms`` for a while, for the rows whose NOTIFY was debounced. Batches
    are pipelined (:meth:`drain`); the loops run under a supervisor that logs and restarts a
    loop that raises. Each claim carries a fresh token: a relay whose
    claim expired and was taken over cannot record a failure over the other relay's outcome, and
    a row that a relay delivered ends ``PUBLISHED`` once that relay records it (a mark the
    database refused is made again before the relay's next claim). A message that fails is
    retried after ``retry_base_ms · 2^(attempts−1)`` (capped) and becomes ``DEAD`` after the
    outbox's ``max_attempts``; rows behind it keep flowing. A row whose claim expired with no
    outcome (its relay died publishing it) is claimed alone, and marked ``DEAD`` by the claim
    once a claim of its own was lost too and its attempts are spent. Claims are bounded by
    ``batch_size`` rows and ``batch_bytes`` of payload. When the broker is unreachable the
    relay backs off (up to ``unavailable_max_ms``) without counting attempts, and claims half
    as many rows as the refused batch next time (doubling back after each published batch, but
    for :data:`HOLD_S` not past a split batch that went through when twice it was refused).
    Published rows older than ``retention_ms`` become tombstones (key kept, payload dropped),
    deleted once the outbox's ``dedup_window_ms`` has passed since their publication.

    Args:
        store: Where the relay claims rows and records outcomes: a
            :class:`PostgresOutboxStore` (``PostgresOutboxStore(pool, outbox=…, listen_dsn=…)``),
            or ``sdcore.testing.MemoryOutboxStore`` in tests. The relay's :attr:`outbox` is the
            store's. A connection pool is still accepted, deprecated: the relay wraps it in a
            :class:`PostgresOutboxStore` built from ``outbox``, ``listen_dsn`` and
            ``transaction_pooling``.
        publisher: Where messages go (``sdcore.queues.BullMQPublisher``, or a test double).
        batch_size: Rows per claim (500: chosen by the sweep of ``benchmarks/outbox.py``,
            ``docs/benchmarks.md#outbox``; a batch waits for its whole ``addBulk`` before its
            first job is in Redis, and only a backlog fills a batch).
        batch_bytes: Payload bytes per claim (as jsonb text), besides ``batch_size``; a row
            larger than this is claimed alone. The relay's memory grows with it (about 7.5
            times ``batch_bytes`` with two batches in flight: ``docs/benchmarks.md#relay-memory``),
            and so does each Redis pipeline, which must be written within the publisher's
            socket timeout.
        poll_interval_ms: Fallback polling period.
        claim_ms: How long a claim lasts: a relay that dies mid-batch leaves its rows to others
            after this long (they are re-published with the same job id). A relay still
            publishing extends its claim every ``claim_ms / 3``, up to :data:`KEEP_CLAIMS`
            times ``claim_ms`` in all, through a store that has ``extend_claim``.
        retry_base_ms: First retry delay of a failed message.
        retry_max_ms: Largest retry delay.
        unavailable_max_ms: Largest back-off while the broker or database is down.
        retention_ms: Keep published rows' payloads this long (at most the outbox's
            ``dedup_window_ms``).
        prune_every_ms: How often to prune.
        logger_name: Logger for relay events.
        outbox: Deprecated, with a pool only: pass it to :class:`PostgresOutboxStore`.
        listen_dsn: Deprecated, with a pool only: pass it to :class:`PostgresOutboxStore`.
        transaction_pooling: Deprecated, with a pool only: pass it to
            :class:`PostgresOutboxStore`.

    Raises:
        TypeError: ``store`` is neither an :class:`OutboxStore` nor a pool, or an option is
            not an ``int``.
        ValueError: An out-of-range option, ``retention_ms`` longer than the outbox's
            ``dedup_window_ms``, or ``outbox`` / ``listen_dsn`` / ``transaction_pooling`` given
            with a store.

    Warns:
        DeprecationWarning: ``store`` is a connection pool (or ``outbox=`` repeats the
            store's own outbox).
    """

    telemetry: Telemetry = NOOP  # observers of batches and rounds (sdcore.metrics, .tracing)

    def __init__(
        self,
        store: OutboxStore | AsyncConnectionPool[Any],
        publisher: Publisher,
        *,
        batch_size: int = DEFAULT_RELAY_BATCH_SIZE,
        batch_bytes: int = DEFAULT_RELAY_BATCH_BYTES,
        poll_interval_ms: int = 1_000,
        claim_ms: int = 30_000,
        retry_base_ms: int = 1_000,
        retry_max_ms: int = 300_000,
        unavailable_max_ms: int = 30_000,
        retention_ms: int = 7 * 24 * 3600 * 1000,
        prune_every_ms: int = 3600 * 1000,
        logger_name: str = "sdcore.outbox",
        outbox: Outbox | None = None,
        listen_dsn: str | None = None,
        transaction_pooling: bool = False,
    ) -> None:
        self._publisher = publisher
        store = _store_of(store, outbox, listen_dsn, transaction_pooling)
        own: object = getattr(store, "outbox", None)
        self.outbox = own if isinstance(own, Outbox) else Outbox()
        self._batch = int_between("batch_size", batch_size, 1, MAX_CLAIM_ROWS)
        self._batch_bytes = at_least("batch_bytes", batch_bytes, 1)
        # Rows per claim after batches the broker refused: half the refused batch each time,
        # doubling back after each published one. A pipeline too big to be written within the
        # socket timeout looks like an outage; split this way it gets through.
        self._cap: int | None = None
        # A batch refused right after a smaller split one went through failed for its size (a
        # link too slow for its pipeline), not for an outage: growing back past the size that
        # went through would only be refused again, each time after a socket timeout and a
        # back-off. So claims stay at that size (rows) for HOLD_S, then may grow again.
        self._ok_rows: int | None = None  # rows of the last split batch the broker took
        self._hold: tuple[int, float] | None = None  # (largest rows per claim, until monotonic)
        self._poll = at_least("poll_interval_ms", poll_interval_ms, 10) / 1000
        self._claim_ms = at_least("claim_ms", claim_ms, 100)
        self._retry_base = at_least("retry_base_ms", retry_base_ms, 1)
        self._retry_max = at_least("retry_max_ms", retry_max_ms, 1)
        self._unavailable_max = at_least("unavailable_max_ms", unavailable_max_ms, 10) / 1000
        self._retention = at_least("retention_ms", retention_ms, 0)
        self._prune_every = at_least("prune_every_ms", prune_every_ms, 1000) / 1000
        self._lively = self.outbox.notify_interval_ms / 1000
        if self._retention > self.outbox.dedup_window_ms:
            raise ValueError(
                f"retention_ms ({self._retention}) must not exceed the outbox's dedup_window_ms"
                f" ({self.outbox.dedup_window_ms}): a key must stay taken at least as long as its"
                " row is kept"
            )
        self.store: OutboxStore = store
        """Where the relay claims rows and records outcomes."""
        self._log = logging.getLogger(logger_name)
        self._wake = asyncio.Event()
        self._stop_event = asyncio.Event()
        self._stopping = False
        self._tasks = Supervisor("sdcore-outbox", logger=self._log)
        self._task: asyncio.Task[None] | None = None
        self._notifications = Notifications(
            self.store.notifications, wake=self._wake, logger=self._log
        )
        self._broker_available = True
        self._published = 0
        self._failed = 0
        self._last_publish_at: datetime | None = None
        self._last_error: str | None = None
        self._last_round_at: float | None = None
        # Rows this relay put in Redis whose mark the database refused (it was down): marked
        # before the next claim, so that a delivery is recorded by the relay that made it even
        # if the row's claim expired meanwhile and a later claim marked it DEAD. No claim
        # succeeds until they are marked, so they are at most the rows of the batches in flight.
        self._unmarked: list[int] = []

    @property
    def state(self) -> RelayState:
        """A snapshot of the relay's state."""
        return RelayState(
            running=self._task is not None and not self._task.done(),
            listening=self._notifications.listening,
            broker_available=self._broker_available,
            published=self._published,
            failed=self._failed,
            last_publish_at=self._last_publish_at,
            last_error=self._last_error,
            last_round_at=self._last_round_at,
        )

    async def start(self) -> None:
        """Start relaying in the background."""
        if self._task is not None:
            return
        self._stopping = False
        self._stop_event.clear()
        await self._tasks.start()
        if self.store.listens:
            self._tasks.spawn("listen", self._notifications.run, cancel_on_close=True)
        self._task = self._tasks.spawn("relay", self._run)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Claim no more; finish the batches in flight (publish and mark); cancel after ``grace_s``.

        A batch cancelled by the grace stays claimed: it is published again, under the same job
        id, once its claim expires.
        """
        self._stopping = True
        self._stop_event.set()
        self._wake.set()
        await self._tasks.aclose(grace_s)
        self._task = None

    async def run_once(self) -> int:
        """Claim one batch of due rows, publish it, record the outcome.

        Returns:
            How many rows were claimed (0: nothing due).

        Raises:
            PublisherUnavailableError: The broker is down (the claims were released).
            OutboxDatabaseError: The database is down (a store's own error, for another store).
        """
        token, messages = await self._claim(self._batch)
        if not messages:
            return 0
        await self._deliver(messages, token)
        return len(messages)

    async def drain(self, max_rows: int | None = None) -> int:
        """Relay batch after batch until a claim finds nothing due (or ``max_rows`` were claimed).

        The background loop runs this. It is pipelined: each claimed batch is published and
        marked by its own delivery while the next batch is claimed, and up to
        :data:`PIPELINE_DEPTH` deliveries are in flight, so the database's round trips and
        commit flushes and Redis's replies overlap the relay's own work. Every batch still goes
        claim → publish → mark, so the guarantees are those of :meth:`run_once`: a relay that
        dies leaves its claimed rows to be published again (same job id, deduplicated by
        BullMQ) once the claim expires; a batch that could not be published because the broker
        is down is given back without counting an attempt. A one-row claim on its second attempt
        or later (how a row whose claim was lost comes back) is published with nothing else in
        flight.

        Returns:
            How many rows were claimed.

        Raises:
            PublisherUnavailableError: The broker is down (the unpublished claims were released).
            OutboxDatabaseError: The database is down (a store's own error, for another store).
        """
        if max_rows is not None:
            max_rows = at_least("max_rows", max_rows, 1)
        total = 0
        flights: list[asyncio.Future[None]] = []  # deliveries in flight, oldest first
        try:
            while True:
                limit = self._batch if max_rows is None else min(self._batch, max_rows - total)
                token, messages = await self._claim(limit)
                total += len(messages)
                if len(messages) == 1 and messages[0].attempts > 1:
                    # A row claimed alone after an earlier attempt may be one whose claim was
                    # lost with its relay: it is published with nothing else in flight, so
                    # that if it kills this process no other batch loses its outcome with it.
                    while flights:
                        await flights.pop(0)
                    await self._deliver(messages, token)
                elif messages:
                    flights.append(asyncio.ensure_future(self._deliver(messages, token)))
                if len(flights) >= PIPELINE_DEPTH:
                    await flights.pop(0)
                # A claim cut short by its byte budget or by a row claimed alone says nothing
                # about what is left: only an empty claim ends the drain.
                if not messages or self._stopping:
                    break
                if max_rows is not None and total >= max_rows:
                    break
            while flights:
                await flights.pop(0)
        except asyncio.CancelledError:  # stop()'s grace ran out: claims expire, marks may not land
            for flight in flights:
                flight.cancel()
            await asyncio.gather(*flights, return_exceptions=True)
            raise
        except BaseException:  # the first error stands; the other deliveries still finish
            await asyncio.gather(*flights, return_exceptions=True)
            raise
        return total

    async def _deliver(self, messages: list[OutboxMessage], token: uuid.UUID) -> None:
        batch = self.telemetry.relay_batch_started(messages)
        results: list[BaseException | None] = []  # stays empty when the broker is down
        try:
            results = await self._publish(messages, token)
            await self._record(messages, results, token)
        finally:
            self.telemetry.relay_batch_finished(batch, results)

    async def _claim(self, limit: int) -> tuple[uuid.UUID, list[OutboxMessage]]:
        token = uuid.uuid4()
        if self._unmarked:
            pending, self._unmarked = self._unmarked, []
            try:
                await self.store.mark_published(pending)
            except BaseException:
                self._unmarked = pending + self._unmarked
                raise
            self._published += len(pending)
            self._last_publish_at = datetime.now(UTC)
        if self._cap is not None:
            limit = min(limit, self._cap)
        if self._hold is not None:
            if time.monotonic() < self._hold[1]:
                limit = min(limit, self._hold[0])
            else:
                self._hold = None
        claimed = await self.store.claim(
            limit=limit, claim_ms=self._claim_ms, token=token, max_bytes=self._batch_bytes
        )
        return token, claimed

    async def _publish(
        self, messages: list[OutboxMessage], token: uuid.UUID
    ) -> list[BaseException | None]:
        # A row written straight into the table (not through enqueue_once) is checked again
        # here: a bad queue name or job id fails like a poison message and ends DEAD.
        invalid = {m.id: problem for m in messages if (problem := invalid_message(m)) is not None}
        # An sd2- id with no stored namespace cannot be checked against its key: it must at least
        # be no other row's (a row written by hand with another message's id).
        shared = getattr(self.store, "shared_job_ids", None)
        if shared is not None:
            for row_id in await shared([m for m in messages if m.id not in invalid]):
                invalid[row_id] = InvalidOutboxMessageError(
                    "job_id",
                    "is another row's job id too (BullMQ would drop one of the two messages as"
                    " its duplicate); row edited by hand?",
                )
        valid = [m for m in messages if m.id not in invalid]
        keeper = (
            asyncio.ensure_future(self._keep_claim([m.id for m in messages], token))
            if valid
            else None
        )
        try:
            published = list(await self._publisher.publish(valid)) if valid else []
        except PublisherUnavailableError as exc:
            too_slow = await self._too_slow(messages, exc)  # the claim is still kept meanwhile
            await _stop(keeper)
            self._cap = max(1, len(messages) // 2)
            if self._ok_rows is not None and len(messages) > self._ok_rows:
                self._hold = (self._ok_rows, time.monotonic() + HOLD_S)
            self._ok_rows = None
            if too_slow is not None:  # a failed attempt of this row; the rows behind it go on
                return [too_slow]
            await self.store.unclaim(
                [m.id for m in messages], token=token, error=error_text(exc)[:MAX_ERROR_LENGTH]
            )
            raise
        except Exception as exc:  # noqa: BLE001 - a publisher bug fails the batch, counted
            published = [exc] * len(valid)
        finally:
            await _stop(keeper)
        # Only a batch taken while claims are split says what size the broker takes: a refusal
        # after an unsplit one is an outage's start, whatever the batch sizes.
        self._ok_rows = len(messages) if self._cap is not None else None
        if self._cap is not None:
            self._cap = None if self._cap * 2 >= self._batch else self._cap * 2
        if len(published) != len(valid):
            error = RuntimeError("publisher returned the wrong number of results")
            published = [error] * len(valid)
        if not invalid:
            return published
        outcome = dict(zip((m.id for m in valid), published, strict=True))
        return [invalid[m.id] if m.id in invalid else outcome[m.id] for m in messages]

    async def _too_slow(
        self, messages: list[OutboxMessage], exc: PublisherUnavailableError
    ) -> TimeoutError | None:
        """The failure to record when a one-row batch was refused for its size, not an outage.

        Splitting cannot shrink a single job: a row whose one-job write cannot finish within the
        socket timeout would be handed back, attempts untouched, first in line, for ever. How
        the two are told apart: only a one-row batch whose write got no answer within the
        socket timeout (the publisher set ``timeout_s``) is considered, and the relay then asks
        the publisher's ``ping()``. Redis answering means it is up and this job cannot be
        written in time: a failed attempt (back-off, ``DEAD`` after ``max_attempts``). A ping
        that fails or times out (Redis down, stopped, refusing connections), an error that is
        no timeout, or a publisher without ``ping()``: an outage, which counts no attempt.
        """
        ping = getattr(self._publisher, "ping", None)
        if len(messages) != 1 or exc.timeout_s is None or ping is None:
            return None
        try:
            answering = bool(await ping())
        except Exception:  # noqa: BLE001 - a ping that fails is a broker that does not answer
            answering = False
        if not answering:
            return None
        size = len(json.dumps(messages[0].payload, separators=(",", ":")))
        return TimeoutError(
            f"the job ({size} bytes of payload) could not be written to Redis within the"
            f" publisher's socket timeout of {exc.timeout_s:g} s, while Redis answers PING:"
            " the link is too slow for a job this size; raise the publisher's socket timeout"
            " (socket_timeout_s) or send a smaller payload (the job may already be in Redis if"
            " the cut-off write still arrived)"
        )

    async def _keep_claim(self, ids: list[int], token: uuid.UUID) -> None:
        # A claim lasts while its relay is publishing (up to KEEP_CLAIMS times claim_ms): a
        # publish that outlasts claim_ms, e.g. a stalled Redis answered only by the socket
        # timeout, must not let another relay take the rows over, which would count this live
        # relay's claim as lost and, once the attempts are spent, bury a healthy message.
        extend = getattr(self.store, "extend_claim", None)
        if extend is None:
            return
        every = self._claim_ms / 3000
        for _ in range(KEEP_CLAIMS * 3):
            await asyncio.sleep(every)
            with contextlib.suppress(OutboxDatabaseError, psycopg.Error, OSError):
                await extend(ids, token=token, claim_ms=self._claim_ms)

    async def _record(
        self,
        messages: list[OutboxMessage],
        results: list[BaseException | None],
        token: uuid.UUID,
    ) -> None:
        published = [m.id for m, r in zip(messages, results, strict=True) if r is None]
        failed = [(m, r) for m, r in zip(messages, results, strict=True) if r is not None]
        if published:
            try:
                await self.store.mark_published(published)
            except (OutboxDatabaseError, psycopg.Error, OSError):
                self._unmarked.extend(published)
                raise
            self._published += len(published)
            self._last_publish_at = datetime.now(UTC)
        if failed:
            failures = [
                OutboxFailure(
                    id=m.id,
                    error=error_text(r)[:MAX_ERROR_LENGTH],
                    delay_ms=min(self._retry_base * 2 ** max(m.attempts - 1, 0), self._retry_max),
                )
                for m, r in failed
            ]
            landed = await self.store.mark_failed(failures, token=token)
            self._failed += len(landed)
            log_failures(self._log, failed, landed)

    async def stats(self) -> OutboxStats:
        """Count rows by status (one query on PostgreSQL)."""
        return await self.store.stats()

    async def prune(self) -> int:
        """Prune in batches; return how many published rows became tombstones.

        Published rows older than ``retention_ms`` lose their payload and options but keep their
        key, digest and job id, so the key stays taken; tombstones of messages published more
        than the outbox's ``dedup_window_ms`` ago are deleted, which frees their keys.
        """
        tombstoned = await self._batches(self.store.tombstone, self._retention)
        await self._batches(self.store.prune, self.outbox.dedup_window_ms)
        return tombstoned

    @staticmethod
    async def _batches(step: Callable[..., Awaitable[int]], age_ms: int) -> int:
        total = 0
        while True:
            changed = await step(older_than_ms=age_ms, limit=1000)
            total += changed
            if changed < 1000:
                return total

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.0
        next_prune = loop.time() + self._prune_every
        lively_until = 0.0
        while not self._stopping:
            # Cleared before the claim, never after it: a notification that arrives while this
            # round runs stays set, and the sleep below returns at once for another claim.
            self._wake.clear()
            try:
                claimed = await self.drain(max_rows=self._batch * 64)
            except PublisherUnavailableError as exc:
                self.telemetry.relay_error("broker_unavailable")
                backoff = self._back_off(backoff, "broker unavailable", exc)
                self._broker_available = False
                await self._pause(backoff)
                continue
            except (OutboxDatabaseError, psycopg.Error, OSError) as exc:
                self.telemetry.relay_error("database_unavailable")
                backoff = self._back_off(backoff, "database unavailable", exc)
                await self._pause(backoff)
                continue
            except Exception as exc:  # noqa: BLE001 - the relay must outlive a bad round
                self.telemetry.relay_error("error")
                self._log.exception("outbox relay round failed", extra={"action": "relay_error"})
                backoff = self._back_off(backoff, "unexpected error", exc)
                await self._pause(backoff)
                continue
            backoff = 0.0
            self._broker_available = True
            self._last_round_at = loop.time()
            self.telemetry.relay_round()
            if loop.time() >= next_prune:
                next_prune = loop.time() + self._prune_every
                with contextlib.suppress(OutboxDatabaseError, psycopg.Error, OSError):
                    pruned = await self.prune()
                    if pruned:
                        self._log.info("pruned %d published outbox row(s)", pruned)
            if claimed >= self._batch * 64:
                continue
            # Writers that debounce NOTIFY (Outbox.notify_interval_ms) commit rows nobody
            # announces: while rows keep coming, look again every interval instead of waiting.
            if claimed and self._lively:
                lively_until = loop.time() + max(1.0, 50 * self._lively)
            lively = self._lively and loop.time() < lively_until
            await self._sleep(min(self._poll, self._lively) if lively else self._poll)

    def _back_off(self, current: float, what: str, exc: BaseException) -> float:
        delay = min(max(current * 2, 0.5), self._unavailable_max)
        self._last_error = redact_text(error_text(exc)[:500])
        self._log.warning(
            "outbox relay: %s, retrying in %.1f s: %s",
            what,
            delay,
            self._last_error,
            extra={"action": "relay_backoff"},
        )
        return delay

    async def _sleep(self, seconds: float) -> None:
        """Wait for a notification (possibly one that came during the last round) or the poll."""
        if self._stopping:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _pause(self, seconds: float) -> None:
        """Back off: only ``stop()`` ends it early (new rows would find the broker still down)."""
        if self._stopping:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop_event.wait()


PIPELINE_DEPTH = 2
"""Batches a draining relay has in flight (published and marked) while it claims the next."""

HOLD_S = 60.0
"""How long claims stay at the size the broker took after a larger batch was refused."""

KEEP_CLAIMS = 10
"""A relay still publishing keeps its claim up to this many times ``claim_ms`` in all."""


async def _stop(task: asyncio.Future[None] | None) -> None:
    """Cancel ``task`` and wait for it to end (a cancellation of the caller still propagates).

    The claim keeper's own failure (a store error it does not expect) is logged, not raised: the
    batch's outcome is the publish's.
    """
    if task is None:
        return
    if not task.done():
        task.cancel()
        await asyncio.wait([task])
    if not task.cancelled() and (error := task.exception()) is not None:
        logging.getLogger("sdcore.outbox").warning(
            "outbox relay: extending a claim failed: %s",
            redact_text(error_text(error)[:300]),
            extra={"action": "relay_extend_failed"},
        )
