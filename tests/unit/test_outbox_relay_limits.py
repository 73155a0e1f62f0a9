"""``OutboxRelay``'s claim limits on the in-memory store: the byte budget and refused batches."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from sdcore.outbox import (
    DEFAULT_RELAY_BATCH_BYTES,
    Outbox,
    OutboxMessage,
    OutboxRelay,
    OutboxStatus,
    PublisherUnavailableError,
)
from sdcore.testing import FakeClock, MemoryOutboxStore, RecordingPublisher


def _store(**outbox: Any) -> MemoryOutboxStore:
    return MemoryOutboxStore(outbox=Outbox(namespace="unit", **outbox), clock=FakeClock())


def _enqueue(store: MemoryOutboxStore, count: int, blob: int = 988) -> None:
    for i in range(count):
        # {"blob": "x…x"} is 12 bytes besides the x's: 1,000 bytes per row by default.
        assert store.enqueue(
            idempotency_key=f"k{i}", queue="q", name="n", payload={"blob": "x" * blob}
        )


class _Pipeline:
    """A broker that cannot take more than ``fits`` jobs at once (a write timing out)."""

    def __init__(self, fits: int) -> None:
        self.fits = fits
        self.sizes: list[int] = []
        self.inner = RecordingPublisher()

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        self.sizes.append(len(messages))
        if len(messages) > self.fits:
            raise PublisherUnavailableError("Redis unavailable: Timeout writing to socket")
        return await self.inner.publish(messages)


async def test_claims_stop_at_the_byte_budget_and_drain_goes_on() -> None:
    store, publisher = _store(), RecordingPublisher()
    _enqueue(store, 10)
    relay = OutboxRelay(store, publisher, batch_bytes=3_500)
    assert await relay.run_once() == 3
    assert await relay.drain() == 7  # claims cut by bytes do not end the drain
    assert {r.status for r in store.rows()} == {OutboxStatus.PUBLISHED}


async def test_a_row_larger_than_the_budget_is_claimed_alone() -> None:
    store, publisher = _store(), RecordingPublisher()
    _enqueue(store, 3)
    relay = OutboxRelay(store, publisher, batch_bytes=10)
    assert [await relay.run_once() for _ in range(4)] == [1, 1, 1, 0]


async def test_a_batch_the_broker_refuses_is_split_until_it_fits() -> None:
    store, broker = _store(max_attempts=1), _Pipeline(fits=3)
    _enqueue(store, 20)
    relay = OutboxRelay(store, broker)
    refused = 0
    for _ in range(30):
        try:
            await relay.run_once()
        except PublisherUnavailableError:
            refused += 1
        if (await relay.stats()).pending == 0:
            break
    assert broker.sizes[:4] == [20, 10, 5, 2]  # halved after each refusal
    assert refused >= 3
    stats = await relay.stats()
    assert (stats.pending, stats.dead, stats.published) == (0, 0, 20)


def test_batch_bytes_is_checked_and_has_a_default() -> None:
    assert DEFAULT_RELAY_BATCH_BYTES == 8 * 1024 * 1024
    with pytest.raises(ValueError, match="batch_bytes"):
        OutboxRelay(_store(), RecordingPublisher(), batch_bytes=0)


class _Overlap:
    """Records, for each publish, which other publishes were in flight meanwhile."""

    def __init__(self) -> None:
        self.active: set[str] = set()
        self.beside: dict[str, set[str]] = {}

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        keys = {m.idempotency_key for m in messages}
        for key in keys:
            self.beside.setdefault(key, set()).update(self.active)
        for other in self.active:
            self.beside[other].update(keys)
        self.active |= keys
        await asyncio.sleep(0.01)
        self.active -= keys
        return [None] * len(messages)


async def test_a_row_whose_claim_was_lost_is_published_with_nothing_else_in_flight() -> None:
    clock = FakeClock()
    store = MemoryOutboxStore(outbox=Outbox(namespace="unit"), clock=clock)
    for key in ("lost", "b", "c", "d", "e"):
        assert store.enqueue(idempotency_key=key, queue="q", name="n", payload={"k": key})
    token = uuid.uuid4()
    await store.claim(limit=1, claim_ms=1_000, token=token)  # "lost": its relay dies
    clock.advance(ms=2_000)
    publisher = _Overlap()
    relay = OutboxRelay(store, publisher, batch_size=1)
    assert await relay.drain() == 5
    assert publisher.beside["lost"] == set()
    assert any(publisher.beside[k] for k in "bcde")  # the others are pipelined as before


class _TooSlowForOne:
    """A broker whose link cannot carry the ``big`` row's job within the socket timeout.

    Any batch holding that row times out (``timeout_s`` set, as ``BullMQPublisher`` does);
    ``ping()`` says whether Redis answers meanwhile (``answering``), or there is none.
    """

    def __init__(self, *, answering: bool, timeout_s: float | None = 0.5) -> None:
        self.answering = answering
        self.timeout_s = timeout_s
        self.pings = 0
        self.inner = RecordingPublisher()

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        if any(m.idempotency_key == "big" for m in messages):
            raise PublisherUnavailableError(
                "Redis unavailable: Timeout writing to socket", timeout_s=self.timeout_s
            )
        return await self.inner.publish(messages)

    async def ping(self) -> bool:
        self.pings += 1
        return self.answering


def _big_then_small(store: MemoryOutboxStore, small: int) -> None:
    assert store.enqueue(idempotency_key="big", queue="q", name="n", payload={"b": "x" * 5000})
    _enqueue(store, small)


async def _rounds(relay: OutboxRelay, store: MemoryOutboxStore, clock: FakeClock) -> int:
    refused = 0
    for _ in range(40):
        try:
            await relay.run_once()
        except PublisherUnavailableError:
            refused += 1
        clock.advance(seconds=1)  # past the retry delay of a failed row
        if (await relay.stats()).pending == 0:
            break
    return refused


async def test_a_row_whose_one_job_write_times_out_while_redis_answers_ends_dead() -> None:
    clock = FakeClock()
    store = MemoryOutboxStore(outbox=Outbox(namespace="unit", max_attempts=3), clock=clock)
    _big_then_small(store, 20)
    broker = _TooSlowForOne(answering=True)
    relay = OutboxRelay(store, broker, retry_base_ms=100)
    refused = await _rounds(relay, store, clock)
    stats = await relay.stats()
    assert (stats.pending, stats.dead, stats.published) == (0, 1, 20), refused
    # 21 → 10 → 5 → 2 → 1 rows: split; alone, the row counts an attempt. Due again, it may come
    # back in a batch that is split again.
    assert refused >= 5, refused
    assert len(broker.inner.jobs) == 20
    (big,) = [r for r in store.rows() if r.idempotency_key == "big"]
    assert (big.status, big.attempts) == (OutboxStatus.DEAD, 3)
    assert big.last_error is not None
    assert "(5008 bytes of payload)" in big.last_error
    assert "socket timeout of 0.5 s" in big.last_error
    assert "raise the publisher's socket timeout" in big.last_error
    assert broker.pings == 3  # only one-row refusals ask


@pytest.mark.parametrize(
    ("answering", "timeout_s"),
    [(False, 0.5), (True, None)],
    ids=["redis-not-answering", "not-a-timeout"],
)
async def test_an_outage_burns_no_attempt_of_a_row_alone(
    answering: bool, timeout_s: float | None
) -> None:
    """A timeout while Redis does not answer PING (stopped), or a refusal that is no timeout
    (connection refused): an outage, so the row is handed back with its attempts untouched."""
    clock = FakeClock()
    store = MemoryOutboxStore(outbox=Outbox(namespace="unit", max_attempts=2), clock=clock)
    _big_then_small(store, 0)
    broker = _TooSlowForOne(answering=answering, timeout_s=timeout_s)
    relay = OutboxRelay(store, broker, retry_base_ms=100)
    for _ in range(5):
        with pytest.raises(PublisherUnavailableError):
            await relay.run_once()
    (big,) = store.rows()
    assert (big.status, big.attempts) == (OutboxStatus.PENDING, 0)
    assert broker.pings == (5 if timeout_s is not None else 0)
