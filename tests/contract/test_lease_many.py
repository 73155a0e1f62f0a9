"""``acquire_many``: the lease contract for many runs in one call, on every backend.

Each item follows ``acquire``'s rules; the results come back in the input order; every item is
validated before anything is acquired.
"""

from __future__ import annotations

from typing import Any

import pytest

from sdcore.job_scheduler import (
    InvalidJobIdentityOptionsError,
    InvalidJobLeaseOptionsError,
    JobAcquired,
    JobAcquireOptions,
    JobSchedulerStatus,
)
from tests.contract._lease import Backend, _acquire, _opts


def _won(result: Any) -> JobAcquired:
    assert isinstance(result, JobAcquired)
    return result


async def test_new_keys_are_all_won_in_the_input_order(backend: Backend) -> None:
    # Not sorted by lock key: the statement sorts, the results keep the caller's order.
    run_keys = [f"tick-{i}" for i in (7, 3, 9, 1, 5)]
    options = [_opts(run_key=key, name=f"n-{key}") for key in run_keys]
    results = await backend.service.acquire_many(options)
    assert len(results) == len(options)
    leases = [_won(result) for result in results]
    for opts, won in zip(options, leases, strict=True):
        assert won.row.lock_key == opts.lock_key
        assert won.row.run_key == opts.run_key
        assert won.row.name == opts.name
        assert won.idempotency_key == opts.idempotency_key
        assert won.row.status is JobSchedulerStatus.RUNNING
        assert won.lease.time_left > 0
    tokens = {won.fencing_token for won in leases}
    assert tokens == set(range(backend.base + 1, backend.base + 6)), "one fresh token per key"
    assert len({won.owner_token for won in leases}) == 5
    assert len({won.id for won in leases}) == 5
    assert await backend.count() == 5
    # Every lease is an ordinary lease: it heartbeats and completes.
    assert await backend.service.heartbeat(leases[0].lease)
    assert await backend.service.complete(leases[1].lease, {"ok": True})
    assert (await backend.read(leases[1].id))["status"] == "SUCCESS"


async def test_a_second_batch_wins_nothing_and_writes_nothing(backend: Backend) -> None:
    options = [_opts(run_key=f"k{i}") for i in range(4)]
    first = [_won(result) for result in await backend.service.acquire_many(options)]
    again = await backend.service.acquire_many(options)
    assert [result.acquired for result in again] == [False] * 4
    assert await backend.count() == 4
    for won in first:
        row = await backend.read(won.id)
        assert (row["owner_token"], row["fencing_token"]) == (won.owner_token, won.fencing_token)


async def test_each_key_follows_the_rules_of_acquire(backend: Backend) -> None:
    running = await _acquire(backend, run_key="running", lease_ms=60_000)
    expired = await _acquire(backend, run_key="expired", lease_ms=1_000)
    failed = await _acquire(backend, run_key="failed")
    done = await _acquire(backend, run_key="done", lease_ms=10_000)  # completes under load too
    assert await backend.service.fail(failed.lease, {"error": "boom"})
    assert await backend.service.complete(done.lease)
    # Past 1 s, inside 60 s (the memory backend's clock ages every row at once).
    for won in (running,) if backend.name == "memory" else (running, expired, failed, done):
        await backend.age(won.id, 30_000)
    results = await backend.service.acquire_many(
        [
            _opts(run_key="running", lease_ms=1_000),  # the owner's 60 s lease decides
            _opts(run_key="fresh"),
            _opts(run_key="expired", lease_ms=120_000),
            _opts(run_key="done", lease_ms=5_000),  # bounds the statement: not a few ms
            _opts(run_key="failed", name="second try"),
        ]
    )
    assert [result.acquired for result in results] == [False, True, True, False, True]
    fresh, taken, retried = _won(results[1]), _won(results[2]), _won(results[4])
    for new, old in ((taken, expired), (retried, failed)):
        assert new.id == old.id
        assert new.owner_token != old.owner_token
        assert new.fencing_token > old.fencing_token
        assert new.idempotency_key == old.idempotency_key
        row = await backend.read(new.id)
        assert (row["status"], row["owner_token"], row["data"]) == (
            "RUNNING",
            new.owner_token,
            None,
        )
        assert not await backend.service.heartbeat(old.lease), "the old owner is fenced out"
    assert taken.row.lease_ms == 120_000
    assert retried.row.name == "second try"
    assert fresh.fencing_token > max(expired.fencing_token, failed.fencing_token)
    assert (await backend.read(done.id))["status"] == "SUCCESS"
    assert (await backend.read(running.id))["owner_token"] == running.owner_token
    assert await backend.service.heartbeat(running.lease)


async def test_mappings_and_initial_runs_are_accepted(backend: Backend) -> None:
    results = await backend.service.acquire_many(
        [
            {"code": "contract", "run_key": "as-mapping", "lease_ms": 5_000},
            JobAcquireOptions(code="bootstrap", type="INITIAL"),
        ]
    )
    first, second = _won(results[0]), _won(results[1])
    assert first.row.lease_ms == 5_000
    assert second.row.run_key is None
    assert (
        await backend.service.acquire({"code": "bootstrap", "type": "INITIAL"})
    ).acquired is False


async def test_an_empty_batch_returns_nothing(backend: Backend) -> None:
    assert await backend.service.acquire_many([]) == []
    assert await backend.service.acquire_many(()) == []
    assert await backend.count() == 0


@pytest.mark.parametrize(
    ("items", "error", "field"),
    [
        (
            [{"code": "ok", "run_key": "a"}, {"code": "ok"}],
            InvalidJobIdentityOptionsError,
            "options[1].run_key",
        ),
        (
            [{"code": "ok", "run_key": "a"}, {"code": " "}],
            InvalidJobIdentityOptionsError,
            "options[1].code",
        ),
        (
            [{"code": "ok", "run_key": "a"}, {"code": "ok", "run_key": "b", "lease_ms": 2}],
            InvalidJobLeaseOptionsError,
            "options[1].lease_ms",
        ),
        (
            [{"code": "ok", "run_key": "a"}, "not options"],
            InvalidJobIdentityOptionsError,
            "options[1].options",
        ),
        (
            [{"code": "ok", "run_key": "a"}, {"code": "ok", "runKey": "b"}],
            InvalidJobIdentityOptionsError,
            "options[1].options",
        ),
        (
            [
                {"code": "ok", "run_key": "a"},
                {"code": "ok", "run_key": "b"},
                {"code": " ok ", "run_key": "a"},
            ],
            InvalidJobIdentityOptionsError,
            "options[2]",
        ),
    ],
    ids=["no-run-key", "blank-code", "short-lease", "not-options", "camel-case", "same-run-twice"],
)
async def test_a_bad_item_refuses_the_whole_batch_before_any_sql(
    backend: Backend, items: list[Any], error: type[Exception], field: str
) -> None:
    with pytest.raises(error) as caught:
        await backend.service.acquire_many(items)
    assert getattr(caught.value, "field", None) == field
    assert await backend.count() == 0, "a valid item was acquired before the bad one was seen"


@pytest.mark.parametrize(
    "batch",
    [
        {"code": "ok", "run_key": "a"},
        _opts(),
        "code",
        b"code",
        None,
        iter([{"code": "ok", "run_key": "a"}]),
        [{"code": "ok", "run_key": str(i)} for i in range(10_001)],
    ],
    ids=["a-mapping", "one-options", "a-str", "bytes", "none", "an-iterator", "10001-items"],
)
async def test_the_batch_itself_must_be_a_sequence_of_at_most_10000(
    backend: Backend, batch: Any
) -> None:
    with pytest.raises(InvalidJobIdentityOptionsError) as caught:
        await backend.service.acquire_many(batch)
    assert caught.value.field == "options"
    assert await backend.count() == 0


async def test_10000_keys_in_one_batch(backend: Backend) -> None:
    options = [_opts(run_key=f"burst-{i:05d}") for i in range(10_000)]
    results = await backend.service.acquire_many(options)
    assert all(result.acquired for result in results)
    tokens = {_won(result).fencing_token for result in results}
    assert len(tokens) == 10_000
    assert await backend.count() == 10_000
