"""``sdcore.outbox.celery`` on real servers: the ledger on PostgreSQL, the broker's refusals.

``exactly_once`` runs under Celery's eager mode (the task's own request id, no broker); the
publisher's per-message refusals are provoked on the shared RabbitMQ with queues of the test's
own (unique names, deleted after).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from celery import Celery  # type: ignore[import-untyped]
from kombu import entity
from kombu.connection import Connection

from sdcore.outbox import OutboxMessage, PublisherUnavailableError
from sdcore.outbox.celery import (
    BrokerRefusedError,
    CeleryPublisher,
    LedgerTransactionRequiredError,
    TaskLedger,
    exactly_once,
)
from tests._tcpproxy import TcpProxy

# kombu's entities are untyped: built through Any.
Queue: Any = entity.Queue
Exchange: Any = entity.Exchange

AMQP_URL = os.environ.get("SDCORE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


@pytest.fixture
def ledger_dsn(pg_dsn: str) -> str:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        TaskLedger().ensure_schema(conn)
        TaskLedger().ensure_schema(conn)  # idempotent
        conn.execute("CREATE TABLE effects (key text NOT NULL)")
    return pg_dsn


def _effects(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT key FROM effects ORDER BY key").fetchall()]


def _eager_task(dsn: str, *, pause_s: float = 0.0) -> Any:
    app = Celery("eager", set_as_current=False)
    app.conf.task_always_eager = True

    @app.task(name="effects.add")  # type: ignore[untyped-decorator]
    @exactly_once(dsn)
    def add(conn: psycopg.Connection[Any], key: str, fail: bool = False) -> str:
        conn.execute("INSERT INTO effects (key) VALUES (%s)", (key,))
        time.sleep(pause_s)
        if fail:
            raise RuntimeError("the task failed after writing")
        return key

    return add


def test_a_repeat_of_a_task_id_is_skipped_and_the_first_result_stands(ledger_dsn: str) -> None:
    add = _eager_task(ledger_dsn)
    first = add.apply(kwargs={"key": "a"}, task_id="job-1")
    again = add.apply(kwargs={"key": "a"}, task_id="job-1")
    other = add.apply(kwargs={"key": "b"}, task_id="job-2")
    assert (first.state, first.result) == ("SUCCESS", "a")
    assert again.state == "IGNORED"
    assert other.state == "SUCCESS"
    assert _effects(ledger_dsn) == ["a", "b"]
    with psycopg.connect(ledger_dsn) as conn:
        rows = conn.execute("SELECT task_id, task FROM sdcore_celery_done ORDER BY 1").fetchall()
    assert rows == [("job-1", "effects.add"), ("job-2", "effects.add")]


def test_a_failed_run_leaves_no_mark_and_its_retry_runs(ledger_dsn: str) -> None:
    add = _eager_task(ledger_dsn)
    failed = add.apply(kwargs={"key": "a", "fail": True}, task_id="job-1")
    assert failed.state == "FAILURE"
    assert _effects(ledger_dsn) == []  # the effect rolled back with the mark
    retried = add.apply(kwargs={"key": "a"}, task_id="job-1")
    assert retried.state == "SUCCESS"
    assert _effects(ledger_dsn) == ["a"]


def test_two_runs_of_one_task_id_at_once_write_one_effect(ledger_dsn: str) -> None:
    # Two workers: a task object each (Celery's eager apply of one task object from two
    # threads at once races on the task's request stack).
    adds = [_eager_task(ledger_dsn, pause_s=0.5) for _ in range(2)]
    states: list[str] = []

    def run(add: Any) -> None:
        try:
            states.append(add.apply(kwargs={"key": "a"}, task_id="job-1").state)
        except BaseException as exc:
            states.append(repr(exc))

    threads = [threading.Thread(target=run, args=(add,)) for add in adds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(states) == ["IGNORED", "SUCCESS"]
    assert _effects(ledger_dsn) == ["a"]


def test_a_connection_closed_by_the_server_is_replaced_before_the_task_fails(
    ledger_dsn: str,
) -> None:
    add = _eager_task(ledger_dsn)
    assert add.apply(kwargs={"key": "a"}, task_id="job-1").state == "SUCCESS"
    with psycopg.connect(ledger_dsn, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    assert add.apply(kwargs={"key": "b"}, task_id="job-2").state == "SUCCESS"
    assert _effects(ledger_dsn) == ["a", "b"]


def test_record_needs_the_tasks_transaction_and_prune_forgets_old_ids(ledger_dsn: str) -> None:
    ledger = TaskLedger()
    with psycopg.connect(ledger_dsn, autocommit=True) as conn:
        with pytest.raises(LedgerTransactionRequiredError, match="transaction"):
            ledger.record(conn, "job-1", task="t")
        with conn.transaction():
            assert ledger.record(conn, "job-1", task="t") is True
            assert ledger.record(conn, "job-1", task="t") is False
        conn.execute("UPDATE sdcore_celery_done SET done_at = done_at - interval '2 days'")
        with conn.transaction():
            assert ledger.record(conn, "job-2", task="t") is True
        assert ledger.prune(conn, older_than=timedelta(days=1)) == 1
        with conn.transaction():
            assert ledger.record(conn, "job-1", task="t") is True  # forgotten: runs again


# The publisher's per-message refusals on RabbitMQ.


@pytest.fixture
def amqp() -> Iterator[tuple[Any, Callable[[str], str]]]:
    """A kombu connection to the shared RabbitMQ, and a maker of unique queue names (deleted)."""
    conn: Any = Connection(AMQP_URL)  # type: ignore[no-untyped-call]
    names: list[str] = []

    def name(tag: str) -> str:
        names.append(f"sdcore-{tag}-{uuid.uuid4().hex[:10]}")
        return names[-1]

    try:
        yield conn, name
    finally:
        channel = conn.channel()
        for queue in names:
            channel.queue_delete(queue)
            channel.exchange_delete(queue)
        conn.release()


def message(queue: str, n: int, name: str = "effects.add", pad: int = 0) -> OutboxMessage:
    return OutboxMessage(
        id=n, idempotency_key=f"k{n}", queue=queue, name=name, job_id=f"sd2-{n:064x}",
        payload={"key": f"k{n}", "pad": "x" * pad}, options={}, attempts=1, max_attempts=3,
        created_at=datetime.now(UTC),
    )  # fmt: skip


def _drain(conn: Any, queue: str) -> list[tuple[str, str]]:
    simple = conn.SimpleQueue(queue)
    found: list[tuple[str, str]] = []
    try:
        while True:
            try:
                got = simple.get(timeout=0.3)
            except simple.Empty:
                return found
            found.append((got.headers["id"], got.headers["task"]))
            got.ack()
    finally:
        simple.close()


async def test_messages_the_broker_nacks_fail_alone(amqp: tuple[Any, Any]) -> None:
    _, name = amqp
    queue = name("full")
    full = Queue(queue, Exchange(queue, type="direct"), routing_key=queue,
                 queue_arguments={"x-max-length": 1, "x-overflow": "reject-publish"})  # fmt: skip
    async with CeleryPublisher(AMQP_URL, queues=[full]) as publisher:
        results = await publisher.publish([message(queue, n) for n in range(3)])
    assert results[0] is None
    assert all(isinstance(r, BrokerRefusedError) and "nacked" in str(r) for r in results[1:])


async def test_a_queue_declared_otherwise_fails_its_messages_only(amqp: tuple[Any, Any]) -> None:
    conn, name = amqp
    odd, fine = name("odd"), name("fine")
    await asyncio.to_thread(
        Queue(odd, Exchange(odd, type="direct"), routing_key=odd,
              queue_arguments={"x-max-length": 5})(conn.channel()).declare
    )  # fmt: skip
    async with CeleryPublisher(AMQP_URL) as publisher:
        results = await publisher.publish([message(odd, 0), message(fine, 1), message(odd, 2)])
    assert isinstance(results[0], BrokerRefusedError)
    assert f"queue {odd!r} cannot be declared" in str(results[0])
    assert "PRECONDITION_FAILED" in str(results[0])
    assert results[0].job_id == message(odd, 0).job_id
    assert results[1] is None
    assert isinstance(results[2], BrokerRefusedError)
    assert await asyncio.to_thread(_drain, conn, fine) == [(message(fine, 1).job_id, "effects.add")]


async def test_a_queue_deleted_under_the_publisher_is_declared_again(
    amqp: tuple[Any, Any],
) -> None:
    conn, name = amqp
    queue = name("deleted")
    async with CeleryPublisher(AMQP_URL) as publisher:
        assert await publisher.publish([message(queue, 0)]) == [None]
        await asyncio.to_thread(conn.channel().queue_delete, queue)
        returned = await publisher.publish([message(queue, 1)])
        assert isinstance(returned[0], BrokerRefusedError)
        assert "unroutable" in str(returned[0])
        assert await publisher.publish([message(queue, 2)]) == [None]
    assert await asyncio.to_thread(_drain, conn, queue) == [
        (message(queue, 2).job_id, "effects.add")
    ]


async def test_a_configured_exchange_routing_key_and_task_name_are_used(
    amqp: tuple[Any, Any],
) -> None:
    conn, name = amqp
    queue, exchange = name("routed"), name("tasks")  # unique: tests run side by side
    routed = Queue(queue, Exchange(exchange, type="direct"), routing_key="emails")
    async with CeleryPublisher(
        AMQP_URL, queues=[routed], task_names={"send": "app.tasks.send_email"}
    ) as publisher:
        assert await publisher.publish([message(queue, 0, name="send")]) == [None]
    assert await asyncio.to_thread(_drain, conn, queue) == [
        (message(queue, 0).job_id, "app.tasks.send_email")
    ]


async def test_an_exchange_that_does_not_exist_fails_its_batch_and_the_next_goes_on(
    amqp: tuple[Any, Any],
) -> None:
    conn, name = amqp
    lost, fine = name("lost"), name("fine")
    nowhere = Queue(lost, Exchange(f"{lost}-missing", type="direct"), routing_key=lost)
    async with CeleryPublisher(AMQP_URL, queues=[nowhere], declare=False) as publisher:
        results = await publisher.publish([message(lost, 0), message(lost, 1)])
        assert all(isinstance(r, BrokerRefusedError) for r in results)
        assert "closed the channel" in str(results[0])
        assert "NOT_FOUND" in str(results[0])
        declared = Queue(fine, Exchange(fine, type="direct"), routing_key=fine)
        await asyncio.to_thread(declared(conn.channel()).declare)  # declare=False: the workers'
        assert await publisher.publish([message(fine, 2)]) == [None]  # on a new channel
    assert await asyncio.to_thread(_drain, conn, fine) == [(message(fine, 2).job_id, "effects.add")]


@pytest.mark.parametrize("rows", [2, 300], ids=["confirms-wait", "writes-block"])
async def test_a_broker_that_stops_answering_is_unavailable_within_the_timeouts(
    amqp: tuple[Any, Any], rows: int
) -> None:
    """Confirms that never come (2 small messages), or writes that block once the TCP buffers
    are full (300 of 60 KB): the batch is refused within the timeouts, never hangs."""
    conn, name = amqp
    queue = name("stalled")
    parts = urlsplit(AMQP_URL)
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672) as proxy:
        url = f"amqp://{parts.username}:{parts.password}@127.0.0.1:{proxy.port}{parts.path}"
        async with CeleryPublisher(url, confirm_timeout_s=0.5, connect_timeout_s=1.0) as publisher:
            assert await publisher.publish([message(queue, 0)]) == [None]
            proxy.holding = True
            started = time.monotonic()
            batch = [message(queue, n, pad=60_000 if rows > 2 else 0) for n in range(1, rows + 1)]
            with pytest.raises(PublisherUnavailableError):
                await publisher.publish(batch)
            # Confirms: 0.5 s, not waited for twice nor for a close; blocked writes: 0.5 s,
            # then one new connection, which the held proxy never answers (1 s).
            assert time.monotonic() - started < 4
            proxy.holding = False
            assert await publisher.publish([message(queue, rows + 1)]) == [None]  # reconnected
    ids = {job_id for job_id, _ in await asyncio.to_thread(_drain, conn, queue)}
    assert {message(queue, 0).job_id, message(queue, rows + 1).job_id} <= ids
