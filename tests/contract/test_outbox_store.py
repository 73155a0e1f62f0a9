"""The outbox store contract (``OutboxStore``), run against memory and real PostgreSQL alike."""

from __future__ import annotations

import copy
import pickle
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from sdcore.outbox import (
    OutboxFailure,
    OutboxKeyConflictError,
    OutboxStats,
    OutboxStatus,
    OutboxStore,
)
from sdcore.outbox._model import job_id_v2
from tests.contract._outbox import MAX_ATTEMPTS, StoreBackend


async def _claim(store: StoreBackend, limit: int = 10, claim_ms: int = 30_000) -> Any:
    token = uuid.uuid4()
    messages = await store.store.claim(limit=limit, claim_ms=claim_ms, token=token)
    return token, messages


def _fail(row_id: int, delay_ms: int = 60_000, error: str = "boom") -> OutboxFailure:
    return OutboxFailure(id=row_id, error=error, delay_ms=delay_ms)


async def test_both_are_outbox_stores(store: StoreBackend) -> None:
    assert isinstance(store.store, OutboxStore)
    assert store.store.listens


async def test_claim_returns_due_rows_oldest_first_and_counts_an_attempt(
    store: StoreBackend,
) -> None:
    for key in ("a", "b", "c"):
        assert await store.enqueue(key, payload={"key": key}, options={"priority": 2})
    _, first = await _claim(store, limit=2)
    assert [m.idempotency_key for m in first] == ["a", "b"]
    message = first[0]
    assert (message.queue, message.name, message.payload) == ("q", "n", {"key": "a"})
    assert message.options["priority"] == 2
    assert (message.attempts, message.max_attempts) == (1, MAX_ATTEMPTS)
    assert message.job_id == job_id_v2("contract", "a")
    assert message.created_at.tzinfo is not None
    _, rest = await _claim(store)
    assert [m.idempotency_key for m in rest] == ["c"]
    _, none = await _claim(store)
    assert none == []
    assert (await store.read(message.id))["claimed"]


async def test_claimed_options_are_read_only_and_copy_to_plain_values(
    store: StoreBackend,
) -> None:
    options = {"attempts": 3, "backoff": {"type": "fixed", "delay": 1000}}
    for key in ("a", "b"):
        assert await store.enqueue(key, options=options)
    _, (first, second) = await _claim(store)
    assert first.options == second.options
    assert first.options["backoff"] == {"type": "fixed", "delay": 1000}
    changes: list[Callable[[], object]] = [
        lambda: first.options.__setitem__("delay", 5),
        lambda: first.options.pop("attempts"),
        lambda: first.options.update(lifo=True),
        lambda: first.options["backoff"].__setitem__("delay", 0),
        lambda: first.options.clear(),
    ]
    for change in changes:
        with pytest.raises(TypeError, match="read-only"):
            change()
    assert second.options["backoff"]["delay"] == 1000
    assert second.options["attempts"] == 3
    mine = copy.deepcopy(first.options)
    mine["backoff"]["delay"] = 0
    assert type(mine) is dict
    assert type(mine["backoff"]) is dict
    assert first.options["backoff"]["delay"] == 1000
    assert type(pickle.loads(pickle.dumps(first.options))) is dict  # noqa: S301
    assert {**first.options, "jobId": "x"}["jobId"] == "x"
    first.payload["extra"] = 1  # the payload stays the message's own, plain dict
    assert "extra" not in second.payload


async def test_a_claim_holds_until_it_expires_then_anyone_may_take_the_row(
    store: StoreBackend,
) -> None:
    await store.enqueue("a")
    _, (first,) = await _claim(store, claim_ms=60_000)
    await store.age(50_000)  # PostgreSQL's clock runs on too: keep a margin for it
    assert (await _claim(store))[1] == []
    await store.age(10_001)
    _, (again,) = await _claim(store)
    assert (again.id, again.attempts) == (first.id, 2)


async def test_published_rows_are_done_whoever_claimed_them(store: StoreBackend) -> None:
    await store.enqueue("a")
    await store.enqueue("b")
    _, messages = await _claim(store)
    await store.store.mark_published([messages[0].id])
    await store.store.mark_published([])
    row = await store.read(messages[0].id)
    assert (row["status"], row["claimed"], row["last_error"]) == ("PUBLISHED", False, None)
    # A delivery needs no claim: the other row is marked too, by anyone.
    await store.store.mark_published([messages[1].id, 10**9])
    assert (await store.read(messages[1].id))["status"] == "PUBLISHED"
    await store.age(10**6)
    assert (await _claim(store))[1] == []
    stats = await store.store.stats()
    assert (stats.pending, stats.published, stats.dead) == (0, 2, 0)


async def test_a_failure_backs_off_by_its_delay_and_keeps_the_error(store: StoreBackend) -> None:
    await store.enqueue("a")
    token, (message,) = await _claim(store)
    landed = await store.store.mark_failed([_fail(message.id, 60_000, "E" * 3000)], token=token)
    assert landed == {message.id: OutboxStatus.PENDING}
    row = await store.read(message.id)
    assert (row["status"], row["attempts"], row["claimed"]) == ("PENDING", 1, False)
    assert row["last_error"] == "E" * 2000
    stats = await store.store.stats()
    assert (stats.pending, stats.due) == (1, 0)
    await store.age(59_000)
    assert (await _claim(store))[1] == []
    await store.age(1_001)
    _, (again,) = await _claim(store)
    assert again.attempts == 2


async def test_the_last_attempt_makes_the_row_dead_and_it_stays_dead(store: StoreBackend) -> None:
    await store.enqueue("poison")
    landed: dict[int, OutboxStatus] = {}
    for attempt in range(1, MAX_ATTEMPTS + 1):
        token, messages = await _claim(store, limit=1)
        (message,) = messages
        assert (message.idempotency_key, message.attempts) == ("poison", attempt)
        landed = await store.store.mark_failed([_fail(message.id, 1)], token=token)
        await store.age(2)
    assert landed == {message.id: OutboxStatus.DEAD}
    await store.enqueue("next")
    await store.age(10**6)
    _, rest = await _claim(store)
    assert [m.idempotency_key for m in rest] == ["next"]
    stats = await store.store.stats()
    assert (stats.dead, stats.pending) == (1, 1)
    # A relay that delivered it after all (its publish was only slow) makes it PUBLISHED.
    await store.store.mark_published([message.id])
    assert (await store.read(message.id))["status"] == "PUBLISHED"


async def test_outcomes_under_a_taken_over_claim_are_fenced_out(store: StoreBackend) -> None:
    await store.enqueue("a")
    old, (first,) = await _claim(store, claim_ms=100)
    await store.age(101)
    new, (second,) = await _claim(store)
    assert second.id == first.id
    assert await store.store.mark_failed([_fail(first.id)], token=old) == {}
    await store.store.unclaim([first.id], token=old, error="late unclaim")
    row = await store.read(first.id)
    assert (row["status"], row["attempts"], row["claimed"], row["last_error"]) == (
        "PENDING",
        2,
        True,
        None,
    )
    assert await store.store.mark_failed([_fail(first.id)], token=new) == {
        first.id: OutboxStatus.PENDING
    }
    # Nor may any token record an outcome over a published row.
    await store.store.mark_published([first.id])
    assert await store.store.mark_failed([_fail(first.id)], token=new) == {}
    assert (await store.read(first.id))["status"] == "PUBLISHED"


async def test_unclaim_gives_rows_back_without_counting_the_attempt(store: StoreBackend) -> None:
    await store.enqueue("a")
    token, (message,) = await _claim(store)
    await store.store.unclaim([message.id], token=token, error="broker down\x00")
    row = await store.read(message.id)
    assert (row["attempts"], row["claimed"], row["last_error"]) == (0, False, "broker down\\0")
    _, (again,) = await _claim(store)
    assert again.attempts == 1


async def test_stats_count_every_state(store: StoreBackend) -> None:
    assert await store.store.stats() == OutboxStats(
        pending=0, due=0, dead=0, published=0, oldest_pending_age_s=None, tombstones=0
    )
    await store.enqueue("dead")
    for _ in range(MAX_ATTEMPTS):
        token, (message,) = await _claim(store)
        await store.store.mark_failed([_fail(message.id, 1)], token=token)
        await store.age(2)
    for key in ("published", "failed", "due"):
        await store.enqueue(key)
    await store.age(5_000)
    token, (published, failed) = await _claim(store, limit=2)
    assert (published.idempotency_key, failed.idempotency_key) == ("published", "failed")
    await store.store.mark_published([published.id])
    await store.store.mark_failed([_fail(failed.id, 60_000)], token=token)
    stats = await store.store.stats()
    assert (stats.pending, stats.due, stats.dead, stats.published, stats.tombstones) == (
        2,
        1,
        1,
        1,
        0,
    )
    assert stats.oldest_pending_age_s is not None
    assert 5.0 <= stats.oldest_pending_age_s < 60.0


async def test_tombstones_keep_the_key_until_pruned(store: StoreBackend) -> None:
    for key in ("a", "b"):
        await store.enqueue(key, payload={"big": key * 10}, options={"priority": 1})
    _, messages = await _claim(store)
    await store.store.mark_published([m.id for m in messages])
    assert await store.store.tombstone(older_than_ms=60_000, limit=10) == 0
    await store.age(60_001)
    assert await store.store.tombstone(older_than_ms=60_000, limit=1) == 1
    assert await store.store.tombstone(older_than_ms=60_000, limit=10) == 1
    assert await store.store.tombstone(older_than_ms=60_000, limit=10) == 0
    row = await store.read(messages[0].id)
    assert (row["payload"], row["options"], row["pruned"], row["status"]) == (
        {},
        {},
        True,
        "PUBLISHED",
    )
    assert row["job_id"] == job_id_v2("contract", "a")
    stats = await store.store.stats()
    assert (stats.published, stats.tombstones) == (0, 2)
    # The key is still taken: the same message is a no-op, another one a conflict.
    assert not await store.enqueue("a", payload={"big": "a" * 10}, options={"priority": 1})
    with pytest.raises(OutboxKeyConflictError) as info:
        await store.enqueue("a", payload={"other": 1})
    assert (info.value.pruned, info.value.existing_status) == (True, "PUBLISHED")
    assert await store.store.prune(older_than_ms=120_000, limit=10) == 0
    await store.age(60_000)
    assert await store.store.prune(older_than_ms=120_000, limit=1) == 1
    assert await store.store.prune(older_than_ms=120_000, limit=10) == 1
    assert (await store.store.stats()).tombstones == 0
    assert await store.enqueue("a", payload={"other": 1})  # a new message under a freed key


async def test_key_reuse_is_checked_as_one_message(store: StoreBackend) -> None:
    assert await store.enqueue("k", payload={"b": 1, "a": [1, 2.5]})
    assert not await store.enqueue("k", payload={"a": [1, 2.5], "b": 1})
    for other in ({"payload": {"a": [1, 2.5], "b": 2}}, {"queue": "q2"}, {"name": "n2"}):
        kwargs: dict[str, Any] = {"payload": {"b": 1, "a": [1, 2.5]}, **other}
        with pytest.raises(OutboxKeyConflictError) as info:
            await store.enqueue("k", **kwargs)
        assert (info.value.existing_queue, info.value.pruned) == ("q", False)


BAD_CALLS: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("claim", {"limit": 0, "claim_ms": 1000, "token": uuid.uuid4()}, ValueError),
    ("claim", {"limit": True, "claim_ms": 1000, "token": uuid.uuid4()}, TypeError),
    ("claim", {"limit": 1, "claim_ms": 0, "token": uuid.uuid4()}, ValueError),
    ("claim", {"limit": 1, "claim_ms": 1000, "token": str(uuid.uuid4())}, TypeError),
    ("mark_published", {"ids": "12"}, TypeError),
    ("mark_published", {"ids": [1, "2"]}, TypeError),
    ("mark_published", {"ids": [0]}, ValueError),
    ("mark_failed", {"failures": [_fail(1), _fail(1)], "token": uuid.uuid4()}, ValueError),
    ("mark_failed", {"failures": [(1, "e", 5)], "token": uuid.uuid4()}, TypeError),
    ("mark_failed", {"failures": [_fail(1, -1)], "token": uuid.uuid4()}, ValueError),
    ("mark_failed", {"failures": [_fail(1)], "token": None}, TypeError),
    ("unclaim", {"ids": [1], "token": uuid.uuid4(), "error": None}, TypeError),
    ("tombstone", {"older_than_ms": -1, "limit": 10}, ValueError),
    ("prune", {"older_than_ms": 0, "limit": 0}, ValueError),
]


async def test_bad_arguments_get_the_same_error_and_change_nothing(store: StoreBackend) -> None:
    await store.enqueue("a")
    for method, kwargs, error in BAD_CALLS:
        with pytest.raises(error) as info:
            await getattr(store.store, method)(**kwargs)
        assert type(info.value) is error, (method, kwargs)
    _, (message,) = await _claim(store)
    assert message.attempts == 1  # no bad call claimed or changed the row
