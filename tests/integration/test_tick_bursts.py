"""Batch tick acquires on PostgreSQL: the same outcome per key as ``acquire_attempt``, and a burst
of a few hundred exclusive schedules due at one instant run exactly once on three replica
processes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import pytest

from sdcore.job_scheduler import (
    AttemptBudget,
    BaseJobScheduler,
    JobAcquireOptions,
    JobSchedulerService,
)
from sdcore.testing import MemoryJobScheduler

REPO_ROOT = Path(__file__).resolve().parents[2]
BUDGET = AttemptBudget(max_attempts=2, backoff_ms=50)
EXPIRING_MS = 500


def _tick(
    code: str, run_key: str = "2026-07-20T03:00:00Z", lease_ms: int = 30_000
) -> JobAcquireOptions:
    return JobAcquireOptions(code=code, run_key=run_key, lease_ms=lease_ms, heartbeat_ms=0)


async def _nothing(store: BaseJobScheduler, code: str) -> None:
    return None


async def _running(store: BaseJobScheduler, code: str) -> None:
    got, _ = await store.acquire_attempt(_tick(code), BUDGET)
    assert got.acquired


async def _running_expired(store: BaseJobScheduler, code: str) -> None:
    # Long enough that a loaded machine's acquire answers within it (an answer later than the
    # lease is given up: not acquired), short enough to expire before the comparison.
    got, _ = await store.acquire_attempt(_tick(code, lease_ms=EXPIRING_MS), BUDGET)
    assert got.acquired


async def _failed_once(store: BaseJobScheduler, code: str) -> None:
    got, _ = await store.acquire_attempt(_tick(code), BUDGET)
    assert got.acquired
    assert await store.fail(got.lease, {"error": "boom"})


async def _exhausted(store: BaseJobScheduler, code: str) -> None:
    await _failed_once(store, code)
    await asyncio.sleep(0.06)
    await _failed_once(store, code)


async def _released(store: BaseJobScheduler, code: str) -> None:
    await _exhausted(store, code)
    got = await store.acquire(_tick(code))  # the plain lease takes a FAIL row; release it
    assert got.acquired
    assert await store.release(got.lease)


async def _succeeded(store: BaseJobScheduler, code: str) -> None:
    got, _ = await store.acquire_attempt(_tick(code), BUDGET)
    assert got.acquired
    assert await store.complete(got.lease)


async def _skipped(store: BaseJobScheduler, code: str) -> None:
    assert await store.record_skipped(_tick(code), "overlap")


STATES: dict[str, Callable[[BaseJobScheduler, str], Awaitable[None]]] = {
    "no-row": _nothing,
    "running": _running,
    "running-expired": _running_expired,
    "failed-once": _failed_once,
    "exhausted": _exhausted,
    "released": _released,
    "succeeded": _succeeded,
    "skipped": _skipped,
}


async def test_each_key_of_a_batch_answers_as_a_single_acquire_attempt(
    jobs: JobSchedulerService,
) -> None:
    await _batch_matches_single(jobs)


async def test_the_memory_double_batch_answers_as_its_single_acquire_attempt() -> None:
    await _batch_matches_single(MemoryJobScheduler())


async def _batch_matches_single(store: BaseJobScheduler) -> None:
    for state, make in STATES.items():
        await make(store, f"single-{state}")
        await make(store, f"batch-{state}")
    await asyncio.sleep(EXPIRING_MS / 1000 + 0.15)  # past the expired lease and the backoff
    single = {}
    for state in STATES:
        got, attempt = await store.acquire_attempt(_tick(f"single-{state}"), BUDGET)
        single[state] = (got.acquired, attempt)
    items = [(_tick(f"batch-{state}"), BUDGET) for state in reversed(STATES)]
    results = await store.acquire_attempts(items)
    batch = {
        state: (got.acquired, attempt)
        for state, (got, attempt) in zip(reversed(STATES), results, strict=True)
    }
    assert batch == single
    assert single == {
        "no-row": (True, 1),
        "running": (False, 0),
        "running-expired": (True, 2),
        "failed-once": (True, 2),
        "exhausted": (False, 0),
        "released": (True, 1),
        "succeeded": (False, 0),
        "skipped": (True, 1),
    }
    for (options, _), (got, _) in zip(items, results, strict=True):
        if got.acquired:
            assert got.lease.idempotency_key == options.idempotency_key
            assert await store.complete(got.lease)


@pytest.mark.parametrize("mixed", [False, True], ids=["shared-columns", "per-key-columns"])
async def test_a_batch_writes_each_keys_own_columns(
    jobs: JobSchedulerService, pg_dsn: str, mixed: bool
) -> None:
    # The statement sends a column once when every key shares its value, else one value per
    # key: either way each row holds its own key's values, and each key's budget decides.
    def options(i: int) -> JobAcquireOptions:
        if mixed and i % 3 == 0:
            return JobAcquireOptions(code=f"cols-{i}", type="INITIAL", lease_ms=40_000 + i)
        return JobAcquireOptions(
            code=f"cols-{i}",
            run_key="2026-07-20T03:00:00Z" if not mixed else f"2026-07-20T03:00:{i:02d}Z",
            name=None if not mixed or i % 2 else f"name, with a comma {i}",
            lease_ms=30_000 if not mixed else 30_000 + i,
        )

    count = 12
    budgets = [
        AttemptBudget(max_attempts=2 + (i % 2 if mixed else 0), backoff_ms=0) for i in range(count)
    ]
    # Each key failed twice: a budget of 2 attempts is spent, one of 3 is not.
    for i in range(count):
        for _ in range(2):
            got, _ = await jobs.acquire_attempt(options(i), budgets[i])
            assert got.acquired
            assert await jobs.fail(got.lease, {"error": "boom"})
    items = [(options(i), budgets[i]) for i in reversed(range(count))]
    results = await jobs.acquire_attempts(items)
    won = {
        o.code: attempt
        for (o, _), (got, attempt) in zip(items, results, strict=True)
        if got.acquired
    }
    assert won == {f"cols-{i}": 3 for i in range(count) if budgets[i].max_attempts == 3}
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        cur = await conn.execute(
            "SELECT code, name, type, run_key, lease_ms, owner_token::text, status"
            " FROM job_scheduler"
        )
        rows = {row[0]: row[1:] for row in await cur.fetchall()}
    for (opts, _), (got, _) in zip(items, results, strict=True):
        name, type_, run_key, lease_ms, token, status = rows[opts.code]
        assert (type_, run_key) == (str(opts.type), opts.run_key)
        if got.acquired:
            assert (name, lease_ms, token, status) == (
                opts.name,
                opts.lease_ms,
                got.lease.owner_token,
                "RUNNING",
            )
            assert await jobs.complete(got.lease)
        else:
            assert status == "FAIL"


async def test_batch_input_is_checked_before_any_sql(jobs: JobSchedulerService) -> None:
    with pytest.raises(ValueError, match="two items for one lock key"):
        await jobs.acquire_attempts([(_tick("a"), BUDGET), (_tick("a"), BUDGET)])
    with pytest.raises(ValueError, match="item 0"):
        await jobs.acquire_attempts([(_tick("a"), None)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at most 10000"):
        await jobs.acquire_attempts([(_tick("a", run_key=str(i)), BUDGET) for i in range(10_001)])
    assert await jobs.acquire_attempts([]) == []
    assert await jobs.statuses([_tick("a").lock_key]) == {}


async def test_overlapping_batches_on_many_connections_win_each_key_once(pg_dsn: str) -> None:
    async with JobSchedulerService.connect(pg_dsn) as first:
        await first.ensure_schema()
        async with (
            JobSchedulerService.connect(pg_dsn) as second,
            JobSchedulerService.connect(pg_dsn) as third,
        ):
            services = [first, second, third]
            keys = [f"2026-07-20T03:00:{i:02d}Z" for i in range(60)]

            async def contend(index: int, service: JobSchedulerService) -> list[str]:
                # Overlapping, differently ordered key sets: no deadlock may abort a batch.
                mine = keys[index * 10 :] + keys[: index * 10]
                items = [(_tick("burst", key), BUDGET) for key in reversed(mine)]
                results = await service.acquire_attempts(items)
                return [
                    o.run_key or ""
                    for (o, _), (got, _) in zip(items, results, strict=True)
                    if got.acquired
                ]

            for _ in range(5):
                won = await asyncio.gather(*(contend(i, s) for i, s in enumerate(services)))
                assert Counter(k for keys_won in won for k in keys_won) == Counter(keys)
                async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
                    await conn.execute("DELETE FROM job_scheduler")


REPLICA = """\
import asyncio, json, sys, time
from sdcore.job_scheduler import JobSchedulerService
from sdcore.postgres import PoolSettings
from sdcore.scheduling import Scheduler

async def main(dsn, count, start_at, seconds):
    async with JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=4)) as jobs:
        scheduler = Scheduler(jobs=jobs)
        for i in range(count):
            async def handler(tick):
                print(json.dumps({"schedule": tick.schedule, "run_key": tick.run_key}), flush=True)
            scheduler.add_cron(f"digest-{i:04d}", "*/2 * * * * *", handler, lease_ms=60_000)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        async with scheduler:
            await asyncio.sleep(seconds)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])))
"""


def test_a_burst_of_exclusive_schedules_on_three_processes_runs_each_tick_once(
    pg_dsn: str,
) -> None:
    count = 300
    asyncio.run(_ensure_schema(pg_dsn))
    start_at = time.time() + 3.0
    replicas = [_spawn(REPLICA, pg_dsn, str(count), str(start_at), "5") for _ in range(3)]
    outputs = []
    for replica in replicas:
        out, err = replica.communicate(timeout=60)
        assert replica.returncode == 0, err[-3000:]
        outputs.append([json.loads(line) for line in out.splitlines() if line.strip()])
    runs = Counter((r["schedule"], r["run_key"]) for lines in outputs for r in lines)
    instants = {key for _, key in runs}
    assert len(instants) >= 2
    assert len(runs) == count * len(instants), "a tick never ran"
    assert set(runs.values()) == {1}, "a tick ran twice"
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute("SELECT status, count(*) FROM job_scheduler GROUP BY status").fetchall()
    assert dict(rows) == {"SUCCESS": count * len(instants)}


def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    """A replica process running ``script`` with ``args`` (this checkout's sources first)."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def _ensure_schema(dsn: str) -> None:
    async with JobSchedulerService.connect(dsn) as service:
        await service.ensure_schema()
