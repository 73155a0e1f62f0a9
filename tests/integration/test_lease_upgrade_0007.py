"""Migration lease/0007: the reopen marks move out of the caller's data into columns (existing
rows backfilled), and the fencing sequence is pinned to CACHE 1 so tokens never go backwards."""

from __future__ import annotations

import asyncio
import json

import psycopg
import pytest

from sdcore.job_scheduler import AttemptBudget, JobAcquireOptions, JobSchedulerService
from sdcore.postgres import PoolSettings, _migrations, migrate, migrations

BEFORE = [m for m in migrations("lease") if m.version < 7]


def _upgrade_to(dsn: str, monkeypatch: pytest.MonkeyPatch | None) -> None:
    """Apply the lease migrations, only those before 0007 while ``monkeypatch`` is given."""

    async def apply() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await migrate(conn, "lease")

    if monkeypatch is None:
        asyncio.run(apply())
        return
    with monkeypatch.context() as patch:
        patch.setattr(_migrations, "migrations", lambda component: tuple(BEFORE))
        asyncio.run(apply())


def _cache(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT cache_size FROM pg_sequences WHERE sequencename = 'job_scheduler_fencing_seq'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _fail_row(run_key: str, data: dict[str, object] | None, attempts: int = 1) -> str:
    options = JobAcquireOptions(code="old", run_key=run_key)
    return (
        "INSERT INTO job_scheduler (lock_key, idempotency_key, code, type, run_key, status,"
        " owner_token, fencing_token, data, attempts) VALUES"
        f" ('{options.lock_key}', '{options.idempotency_key}', 'old', 'SCHEDULE', '{run_key}',"
        f" 'FAIL', gen_random_uuid(), nextval('job_scheduler_fencing_seq'),"
        f" {'NULL' if data is None else repr(json.dumps(data))}::jsonb, {attempts})"
    )


def test_upgrade_moves_old_marks_into_columns_and_pins_the_cache(
    empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _upgrade_to(empty_dsn, monkeypatch)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(_fail_row("given-back", {"given_back": "acquire answered too late"}))
        conn.execute(_fail_row("operator", {"released_by": "operator", "reason": "hung"}))
        conn.execute(_fail_row("owner", {"released": True}))
        conn.execute(_fail_row("backfill", {"error": "boom", "released_by": "backfill:7"}))
        conn.execute(_fail_row("plain", {"error": "boom"}))
        conn.execute(_fail_row("skipped", {"skipped": "overlap"}, attempts=0))
        conn.execute("ALTER SEQUENCE job_scheduler_fencing_seq CACHE 20")
    assert _cache(empty_dsn) == 20
    _upgrade_to(empty_dsn, None)
    _upgrade_to(empty_dsn, None)  # nothing pending: a no-op
    with psycopg.connect(empty_dsn) as conn:
        rows = dict(
            (r[0], (r[1], r[2]))
            for r in conn.execute(
                "SELECT run_key, released, given_back FROM job_scheduler ORDER BY run_key"
            )
        )
    assert rows == {
        "backfill": ("backfill:7", None),
        "given-back": (None, "acquire answered too late"),
        "operator": ("operator", None),
        "owner": ("owner", None),
        "plain": (None, None),
        "skipped": (None, None),
    }
    assert _cache(empty_dsn) == 1

    async def retaken() -> dict[str, tuple[bool, int]]:
        budget = AttemptBudget(max_attempts=1, backoff_ms=60_000)
        async with JobSchedulerService.connect(empty_dsn) as jobs:
            result = {}
            for run_key in rows:
                got, attempt = await jobs.acquire_attempt(
                    JobAcquireOptions(code="old", run_key=run_key), budget
                )
                result[run_key] = (got.acquired, attempt)
            return result

    # The old rows keep their meaning: released ones start a new budget, the given-back one
    # keeps its attempt, the skipped one is taken, the plain failure has no budget left.
    assert asyncio.run(retaken()) == {
        "backfill": (True, 1),
        "given-back": (True, 1),
        "operator": (True, 1),
        "owner": (True, 1),
        "plain": (False, 0),
        "skipped": (True, 1),
    }


async def _recreated_token(dsn: str) -> tuple[int, int, int]:
    """Replica A draws a token, B creates run K, K is pruned, A creates K again: the tokens."""
    key = JobAcquireOptions(code="k", run_key="r")
    async with (
        JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=2), max_connections=1) as a,
        JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=2), max_connections=1) as b,
    ):
        first = await a.acquire(JobAcquireOptions(code="other", run_key="r"))
        created = await b.acquire(key)
        assert first.acquired
        assert created.acquired
        assert await b.complete(created.lease)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("DELETE FROM job_scheduler WHERE id = %s", (created.id,))
        again = await a.acquire(key)
        assert again.acquired
        return first.fencing_token, created.fencing_token, again.fencing_token


def test_a_recreated_key_never_gets_a_lower_token_after_the_upgrade(
    empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _upgrade_to(empty_dsn, monkeypatch)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("ALTER SEQUENCE job_scheduler_fencing_seq CACHE 20")
    # With CACHE 20 each session draws from its own block of 20 values: replica A's second
    # token would be 2, below the 21 that B's session handed to the pruned row.
    _upgrade_to(empty_dsn, None)
    first, created, again = asyncio.run(_recreated_token(empty_dsn))
    assert first < created < again


async def test_ensure_schema_warns_when_the_cache_is_raised_again(
    jobs: JobSchedulerService, pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    await jobs.ensure_schema()
    assert not [r for r in caplog.records if "fencing_sequence_cached" in str(r.__dict__)]
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute("ALTER SEQUENCE job_scheduler_fencing_seq CACHE 20")
    await jobs.ensure_schema()
    warned = [r for r in caplog.records if getattr(r, "action", None) == "fencing_sequence_cached"]
    assert len(warned) == 1
    assert "CACHE 20" in warned[0].getMessage()
    assert 'ALTER SEQUENCE "job_scheduler_fencing_seq" CACHE 1' in warned[0].getMessage()
