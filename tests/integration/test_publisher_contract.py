"""The publisher contract: what every ``sdcore.outbox.Publisher`` must do for the relay.

Run against each publisher on its real broker (``_publishers.BROKERS``: BullMQ on Redis, Celery
on RabbitMQ and on Redis). A new publisher passes this suite before the relay may use it:

1. one result per message, in order; ``None`` means a consumer receives that message, under its
   job id, with its name and payload; an empty batch publishes nothing;
2. a message published again (a relay died before marking it) is accepted again, and reaches
   the consumer under the same job id (deduplicated by the broker, or by the consumer);
3. a message that cannot be published (too large for the publisher) fails in its own slot, and
   the others of its batch are delivered (poison isolation);
4. a broker that cannot be reached, or whose connection was cut, raises
   ``PublisherUnavailableError`` for the batch (no attempt is counted), and the publisher
   publishes again once the broker is back, without being rebuilt;
5. under an ``OutboxRelay``, every row ends ``PUBLISHED`` and delivered, the poison row ``DEAD``
   after ``max_attempts``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from sdcore.outbox import (
    Outbox,
    OutboxMessage,
    OutboxRelay,
    OutboxStatus,
    Publisher,
    PublisherUnavailableError,
)
from sdcore.testing import MemoryOutboxStore
from tests._servers import free_port
from tests._tcpproxy import TcpProxy
from tests.integration._publishers import BROKERS, Broker
from tests.integration._publishers import broker as make_broker

pytestmark = pytest.mark.slow
SMALL_LIMIT = 2_000  # bytes: a payload of 4,000 characters is over it for every publisher


@pytest.fixture(params=BROKERS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    async for value in make_broker(request.param):
        yield value


def message(broker: Broker, n: int, **payload: Any) -> OutboxMessage:
    return OutboxMessage(
        id=n,
        idempotency_key=f"key-{n}",
        queue=broker.queue,
        name="contract.task",
        job_id=Outbox(namespace="contract").job_id(f"{broker.queue}-{n}"),
        payload={"n": n, **payload},
        options={},
        attempts=1,
        max_attempts=3,
        created_at=datetime.now(UTC),
    )


async def publish(publisher: Publisher, messages: list[OutboxMessage]) -> list[Any]:
    return list(await publisher.publish(messages))


async def test_each_published_message_reaches_the_consumer_by_its_job_id(broker: Broker) -> None:
    batch = [message(broker, n, text="é✓") for n in range(5)]
    async with broker.make() as publisher:
        assert await publish(publisher, []) == []
        assert await publish(publisher, batch) == [None] * 5
    received = await broker.received()
    assert sorted(r.job_id for r in received) == sorted(m.job_id for m in batch)
    by_id = {r.job_id: r for r in received}
    for m in batch:
        assert by_id[m.job_id].name == "contract.task"
        assert by_id[m.job_id].payload == m.payload


async def test_a_message_published_again_keeps_its_job_id(broker: Broker) -> None:
    batch = [message(broker, n) for n in range(3)]
    async with broker.make() as publisher:
        assert await publish(publisher, batch) == [None] * 3
        assert await publish(publisher, batch[1:]) == [None] * 2
    received = await broker.received()
    assert {r.job_id for r in received} == {m.job_id for m in batch}
    assert 3 <= len(received) <= 5  # deduplicated by the broker (BullMQ) or not (Celery)


async def test_a_poison_message_fails_alone(broker: Broker) -> None:
    batch = [message(broker, 0), message(broker, 1, blob="x" * 4_000), message(broker, 2)]
    async with broker.make(max_bytes=SMALL_LIMIT) as publisher:
        results = await publish(publisher, batch)
    assert results[0] is None
    assert isinstance(results[1], ValueError)  # too large: the message's fault, not the broker's
    assert "bytes" in str(results[1])
    assert results[2] is None
    assert {r.job_id for r in await broker.received()} == {batch[0].job_id, batch[2].job_id}


async def test_an_unreachable_broker_raises_unavailable(broker: Broker) -> None:
    async with broker.make(port=free_port()) as publisher:
        started = time.monotonic()
        with pytest.raises(PublisherUnavailableError):
            await publish(publisher, [message(broker, 0), message(broker, 1)])
        assert time.monotonic() - started < 10
    assert await broker.received() == []


async def test_a_cut_connection_is_unavailable_then_publishing_resumes(broker: Broker) -> None:
    async with TcpProxy(*broker.target) as proxy, broker.make(port=proxy.port) as publisher:
        assert await publish(publisher, [message(broker, 0)]) == [None]
        proxy.refusing = True
        assert proxy.cut() >= 1
        with pytest.raises(PublisherUnavailableError):
            await publish(publisher, [message(broker, 1)])
        proxy.refusing = False
        assert await publish(publisher, [message(broker, 2)]) == [None]
    received = {r.job_id for r in await broker.received()}
    assert {message(broker, 0).job_id, message(broker, 2).job_id} <= received


async def test_under_a_relay_rows_end_published_and_the_poison_row_dead(broker: Broker) -> None:
    store = MemoryOutboxStore(outbox=Outbox(namespace="contract", max_attempts=2))
    keys = [f"row-{n}" for n in range(12)]
    for key in keys:
        store.enqueue(
            idempotency_key=key, queue=broker.queue, name="contract.task", payload={"key": key}
        )
    store.enqueue(
        idempotency_key="poison", queue=broker.queue, name="contract.task",
        payload={"blob": "x" * 4_000},
    )  # fmt: skip
    async with broker.make(max_bytes=SMALL_LIMIT) as publisher:
        relay = OutboxRelay(store, publisher, batch_size=5, retry_base_ms=1, retry_max_ms=1)
        deadline = time.monotonic() + 20
        while (await relay.stats()).pending:
            assert time.monotonic() < deadline, await relay.stats()
            await relay.run_once()
    statuses = {row.idempotency_key: row.status for row in store.rows()}
    assert statuses.pop("poison") is OutboxStatus.DEAD
    assert set(statuses.values()) == {OutboxStatus.PUBLISHED}
    received = await broker.received()
    assert sorted(r.payload["key"] for r in received) == sorted(keys)
