"""``OutboxRelay``'s policy on the in-memory store: retry, back-off, dead-letter, fencing, pruning.

No server: the store is ``sdcore.testing.MemoryOutboxStore`` on a ``FakeClock`` (the contract
suite in ``tests/contract/test_outbox_store.py`` holds it to PostgreSQL's answers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import (
    Outbox,
    OutboxMessage,
    OutboxRelay,
    OutboxStatus,
    PostgresOutboxStore,
    PublisherUnavailableError,
)
from sdcore.testing import FakeClock, MemoryOutboxStore, RecordingPublisher
from tests.unit._looptime import in_loop_time


def _store(clock: FakeClock, **outbox: Any) -> MemoryOutboxStore:
    return MemoryOutboxStore(outbox=Outbox(namespace="unit", **outbox), clock=clock)


def _enqueue(store: MemoryOutboxStore, *keys: str, name: str = "job") -> None:
    for key in keys:
        assert store.enqueue(idempotency_key=key, queue="q", name=name, payload={"k": key})


async def test_run_once_publishes_due_rows_and_marks_them() -> None:
    clock = FakeClock()
    store, publisher = _store(clock), RecordingPublisher()
    _enqueue(store, "a", "b", "c")
    relay = OutboxRelay(store, publisher, batch_size=2)
    assert relay.outbox is store.outbox
    assert await relay.run_once() == 2
    assert await relay.run_once() == 1
    assert await relay.run_once() == 0
    assert [m.idempotency_key for m in publisher.publishes] == ["a", "b", "c"]
    assert {row.status for row in store.rows()} == {OutboxStatus.PUBLISHED}
    assert relay.state.published == 3
    stats = await relay.stats()
    assert (stats.published, stats.pending) == (3, 0)


async def test_a_failing_message_backs_off_exponentially_then_dies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    store, publisher = _store(clock, max_attempts=4), RecordingPublisher()
    publisher.fail.add("poison")
    _enqueue(store, "bad", name="poison")
    _enqueue(store, "good")
    relay = OutboxRelay(store, publisher, retry_base_ms=1_000, retry_max_ms=3_000)
    assert await relay.run_once() == 2  # the good row flows past the poison one
    assert store.by_key("good").status is OutboxStatus.PUBLISHED  # type: ignore[union-attr]
    # Delays: 1 s, 2 s, 3 s (capped), then DEAD on the 4th attempt.
    for delay_ms in (1_000, 2_000, 3_000):
        clock.advance(ms=delay_ms - 1)
        assert await relay.run_once() == 0
        clock.advance(ms=1)
        with caplog.at_level(logging.WARNING, logger="sdcore.outbox"):
            assert await relay.run_once() == 1
    row = store.by_key("bad")
    assert row is not None
    assert (row.status, row.attempts) == (OutboxStatus.DEAD, 4)
    assert row.last_error is not None
    assert "poison" in row.last_error
    assert relay.state.failed == 4
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("outbox_publish_failed") == 3
    assert actions.count("outbox_dead") == 1
    clock.advance(seconds=3600)
    assert await relay.run_once() == 0


async def test_an_unavailable_broker_releases_the_claims_without_counting() -> None:
    clock = FakeClock()
    store, publisher = _store(clock), RecordingPublisher()
    _enqueue(store, "a")
    publisher.unavailable = True
    relay = OutboxRelay(store, publisher)
    with pytest.raises(PublisherUnavailableError):
        await relay.run_once()
    row = store.by_key("a")
    assert row is not None
    assert (row.attempts, row.claim_token, row.status) == (0, None, OutboxStatus.PENDING)
    assert row.last_error is not None
    assert "unavailable" in row.last_error
    publisher.unavailable = False
    assert await relay.run_once() == 1  # at once: the row was given back, not backed off
    assert store.by_key("a").attempts == 1  # type: ignore[union-attr]


class _Broken:
    """A publisher with a bug: it raises, or returns the wrong number of results."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def publish(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        if self.mode == "raise":
            raise RuntimeError("publisher bug")
        return [None]


@pytest.mark.parametrize("mode", ["raise", "short"])
async def test_a_publisher_bug_fails_the_whole_batch_counted(mode: str) -> None:
    clock = FakeClock()
    store = _store(clock)
    _enqueue(store, "a", "b")
    relay = OutboxRelay(store, _Broken(mode))
    assert await relay.run_once() == 2
    rows = store.rows()
    assert [(r.status, r.attempts) for r in rows] == [(OutboxStatus.PENDING, 1)] * 2
    expected = "publisher bug" if mode == "raise" else "wrong number of results"
    assert all(r.last_error is not None and expected in r.last_error for r in rows)


class _SlowThenTakenOver:
    """Fails its publish, but only after the claim expired and another relay delivered the row."""

    def __init__(self, clock: FakeClock, other: OutboxRelay) -> None:
        self.clock, self.other = clock, other

    async def publish(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        self.clock.advance(ms=31_000)  # past the 30 s claim
        assert await self.other.run_once() == len(messages)
        return [TimeoutError("too slow")] * len(messages)


async def test_a_failure_under_a_lost_claim_does_not_overwrite_the_delivery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    store, fast = _store(clock, max_attempts=1), RecordingPublisher()
    _enqueue(store, "a")
    other = OutboxRelay(store, fast)
    slow = OutboxRelay(store, _SlowThenTakenOver(clock, other))
    with caplog.at_level(logging.INFO, logger="sdcore.outbox"):
        assert await slow.run_once() == 1
    row = store.by_key("a")
    assert row is not None
    # With max_attempts=1 the slow relay's failure would have made the row DEAD.
    assert (row.status, row.last_error) == (OutboxStatus.PUBLISHED, None)
    assert (slow.state.failed, other.state.published) == (0, 1)
    assert "outbox_claim_lost" in [getattr(r, "action", None) for r in caplog.records]


async def test_prune_tombstones_then_deletes_by_the_dedup_window() -> None:
    clock = FakeClock()
    store = _store(clock, dedup_window_ms=10_000)
    _enqueue(store, "a")
    relay = OutboxRelay(store, RecordingPublisher(), retention_ms=5_000)
    assert await relay.run_once() == 1
    clock.advance(ms=5_001)
    assert await relay.prune() == 1
    row = store.by_key("a")
    assert row is not None
    assert row.pruned_at is not None
    assert row.payload == {}
    assert not store.enqueue(idempotency_key="a", queue="q", name="job", payload={"k": "a"})
    clock.advance(ms=5_000)
    assert await relay.prune() == 0  # no new tombstone; the old one is deleted
    assert store.by_key("a") is None


async def _until(predicate: Any, seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():
            await asyncio.sleep(0.005)


async def test_the_background_relay_wakes_on_enqueue() -> None:
    store, publisher = MemoryOutboxStore(), RecordingPublisher()
    async with OutboxRelay(store, publisher, poll_interval_ms=60_000) as relay:
        await _until(lambda: relay.state.listening)
        for count, key in enumerate(("a", "b"), start=1):
            _enqueue(store, key)
            await _until(lambda: len(publisher.publishes) == count)  # noqa: B023 - awaited here
    assert not relay.state.running
    assert {row.status for row in store.rows()} == {OutboxStatus.PUBLISHED}


@in_loop_time
async def test_the_background_relay_backs_off_while_the_store_is_down() -> None:
    store, publisher = MemoryOutboxStore(), RecordingPublisher()
    store.unavailable = True
    async with OutboxRelay(store, publisher, poll_interval_ms=20) as relay:
        await _until(lambda: relay.state.last_error is not None)
        assert "store unavailable" in (relay.state.last_error or "")
        assert not relay.state.listening
        _enqueue(store, "a")
        store.unavailable = False
        await _until(lambda: len(publisher.publishes) == 1)  # after the 0.5 s back-off
    assert store.by_key("a").status is OutboxStatus.PUBLISHED  # type: ignore[union-attr]


async def test_a_store_that_does_not_listen_is_polled() -> None:
    store, publisher = MemoryOutboxStore(listens=False), RecordingPublisher()
    async with OutboxRelay(store, publisher, poll_interval_ms=20) as relay:
        _enqueue(store, "a")
        await _until(lambda: len(publisher.publishes) == 1)
        assert not relay.state.listening


def test_settings_of_the_postgres_store_are_refused_with_another_store() -> None:
    store = MemoryOutboxStore()
    with pytest.raises(ValueError, match="outbox= is the store's own"):
        OutboxRelay(store, RecordingPublisher(), outbox=Outbox())
    with pytest.raises(ValueError, match="listen_dsn / transaction_pooling"):
        OutboxRelay(store, RecordingPublisher(), listen_dsn="postgresql://x")
    with pytest.raises(ValueError, match="listen_dsn / transaction_pooling"):
        OutboxRelay(store, RecordingPublisher(), transaction_pooling=True)
    with pytest.warns(DeprecationWarning, match="leave outbox= unset"):
        relay = OutboxRelay(store, RecordingPublisher(), outbox=store.outbox)
    assert relay.outbox is store.outbox


async def test_a_pool_still_works_for_one_release_and_names_the_store_form() -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool("dbname=none", open=False)
    outbox = Outbox(table="orders_outbox")
    with pytest.warns(DeprecationWarning, match=r"OutboxRelay\(PostgresOutboxStore\(pool, outbox="):
        relay = OutboxRelay(pool, RecordingPublisher(), outbox=outbox, transaction_pooling=True)
    assert isinstance(relay.store, PostgresOutboxStore)
    assert (relay.store.pool, relay.store.outbox, relay.outbox) == (pool, outbox, outbox)
    assert not relay.store.listens  # transaction pooling without a listen_dsn


def test_what_is_neither_a_store_nor_a_pool_is_refused() -> None:
    with pytest.raises(TypeError, match=r"^store must be an OutboxStore.*got NoneType"):
        OutboxRelay(None, RecordingPublisher())  # type: ignore[arg-type]
