"""The claim's limits, on memory and PostgreSQL alike: lost claims and the byte budget."""

from __future__ import annotations

import uuid
from typing import Any

from tests.contract._outbox import MAX_ATTEMPTS, StoreBackend


async def _claim(store: StoreBackend, *, limit: int = 10, max_bytes: int | None = None) -> Any:
    token = uuid.uuid4()
    messages = await store.store.claim(
        limit=limit, claim_ms=1_000, token=token, max_bytes=max_bytes
    )
    return token, [m.idempotency_key for m in messages], messages


async def test_a_row_whose_claims_keep_expiring_is_isolated_then_dead(
    store: StoreBackend,
) -> None:
    """A message that kills every relay publishing it: its claims expire with no outcome."""
    for key in ("poison", "a", "b"):
        assert await store.enqueue(key)
    _, keys, first = await _claim(store)
    assert keys == ["poison", "a", "b"]
    poison = first[0].id
    await store.age(2_000)  # the relay died: the claim expired with no outcome
    # Each row of the lost batch is now claimed alone, poison first.
    _, keys, _ = await _claim(store)
    assert keys == ["poison"]
    _, keys, rest = await _claim(store)
    assert keys == ["a"]
    await store.store.mark_published([rest[0].id])
    _, keys, rest = await _claim(store)
    assert keys == ["b"]
    await store.store.mark_published([rest[0].id])
    for attempt in range(3, MAX_ATTEMPTS + 1):
        await store.age(2_000)
        _, keys, again = await _claim(store)
        assert (keys, again[0].attempts) == (["poison"], attempt)
    await store.age(2_000)
    assert await store.enqueue("c")
    # The spent poison is marked DEAD by the claim that meets it, which takes "c" instead.
    _, keys, _ = await _claim(store)
    assert keys == ["c"]
    row = await store.read(poison)
    assert (row["status"], row["attempts"], row["claimed"]) == ("DEAD", MAX_ATTEMPTS, False)
    assert row["last_error"] == (
        f"claimed {MAX_ATTEMPTS} times, {MAX_ATTEMPTS} of them with no outcome: the relay died"
        " (or lost its database) while publishing it; its job may already be in the broker"
    )


async def test_a_batch_stops_before_a_row_whose_claim_was_lost(store: StoreBackend) -> None:
    for key in ("a", "b", "c", "d"):
        assert await store.enqueue(key)
    _, keys, _ = await _claim(store, limit=1)
    assert keys == ["a"]
    await store.age(2_000)
    _, keys, _ = await _claim(store, limit=1)  # "a" again, alone
    assert keys == ["a"]
    _, keys, _ = await _claim(store)
    assert keys == ["b", "c", "d"]


async def test_a_failure_outcome_is_not_a_lost_claim(store: StoreBackend) -> None:
    """Counted failures alone end DEAD through mark_failed, never through the claim."""
    for key in ("a", "b"):
        assert await store.enqueue(key)
    token, keys, messages = await _claim(store)
    await store.store.unclaim([m.id for m in messages], token=token, error="broker down")
    _, keys, _ = await _claim(store)
    assert keys == ["a", "b"]  # given back, not lost: still one batch


async def test_a_claim_stops_at_its_byte_budget_but_takes_one_row_at_least(
    store: StoreBackend,
) -> None:
    # {"blob": "xx…x"} as jsonb text: 12 bytes besides the x's.
    for key in ("a", "b", "c", "d"):
        assert await store.enqueue(key, payload={"blob": "x" * 988})
    _, keys, _ = await _claim(store, max_bytes=2_500)
    assert keys == ["a", "b"]
    _, keys, _ = await _claim(store, max_bytes=1_999)
    assert keys == ["c"]
    _, keys, _ = await _claim(store, max_bytes=10)  # larger than the budget: alone
    assert keys == ["d"]
    assert await store.enqueue("e", payload={"blob": "x" * 988})
    assert await store.enqueue("f", payload={"blob": "x" * 988})
    _, keys, _ = await _claim(store, max_bytes=2_000)  # 1,000 + 1,000: exactly the budget
    assert keys == ["e", "f"]
