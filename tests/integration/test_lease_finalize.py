"""Outcomes recorded together (``_finals.py``): ``complete``/``fail`` calls made while others are
in flight share one ``finalize_many`` statement, each row by the rules of ``finalize`` (real
PostgreSQL).

What must hold: every caller learns ``True`` only if its own row was updated under its own
owner token; a lost lease in the batch is ``False`` and leaves the row as its new owner wrote
it; two outcomes of one row never share a statement; a caller cancelled before its row was sent
leaves the row ``RUNNING``; and when the batch statement fails, each row ends as the single
path would end it (ambiguous commit resolved by reading the row, a refusal re-sent row by row,
no answer in time reported as unknown).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from sdcore.job_scheduler import (
    JobAcquired,
    JobAcquireOptions,
    JobExecutionLease,
    JobSchedulerService,
    JobSchedulerUnavailableError,
)
from sdcore.job_scheduler._watchdog import _Abandoned
from tests.integration.test_lease_deadlines import _sql


async def _leases(jobs: JobSchedulerService, code: str, count: int) -> list[JobExecutionLease]:
    results = await jobs.acquire_many(
        [JobAcquireOptions(code=code, run_key=f"r{i:03d}", lease_ms=60_000) for i in range(count)]
    )
    leases = []
    for result in results:
        assert isinstance(result, JobAcquired)
        leases.append(result.lease)
    return leases


def _count_statements(jobs: JobSchedulerService) -> dict[str, int]:
    """Count the finalize statements the service sends (single-row and batch)."""
    counts = {"one": 0, "many": 0, "rows": 0}
    finals = jobs._finals
    one, many = finals._one, finals._many

    async def counted_one(params: Any, limit: float | None) -> bool:
        counts["one"] += 1
        return await one(params, limit)

    async def counted_many(columns: tuple[list[Any], ...], limit: float | None) -> set[str]:
        counts["many"] += 1
        counts["rows"] += len(columns[0])
        return await many(columns, limit)

    finals._one = counted_one
    finals._many = counted_many
    return counts


async def _rows(dsn: str, code: str) -> dict[str, tuple[str, Any]]:
    rows = await _sql(
        dsn, "SELECT run_key, status, data FROM job_scheduler WHERE code = %s", (code,)
    )
    return {str(key): (str(status), data) for key, status, data in rows}


async def test_outcomes_made_together_share_a_statement_and_keep_their_own_data(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    leases = await _leases(jobs, "together", 60)
    counts = _count_statements(jobs)
    results = await asyncio.gather(
        *(
            jobs.complete(lease, {"n": i}) if i % 3 else jobs.fail(lease, {"error": f"e{i}"})
            for i, lease in enumerate(leases)
        )
    )
    assert results == [True] * 60
    # The first calls go out alone, at once, one per connection the service holds; the rest
    # queue meanwhile and leave together.
    slots = jobs._finals._in_flight
    assert counts["one"] + counts["rows"] == 60
    assert counts["one"] == slots, counts
    assert 1 <= counts["many"] <= 2, counts
    rows = await _rows(pg_dsn, "together")
    for i in range(60):
        status, data = rows[f"r{i:03d}"]
        if i % 3:
            assert (status, data) == ("SUCCESS", {"n": i})
        else:
            assert (status, data) == ("FAIL", {"error": f"e{i}"})


async def test_a_lost_lease_in_the_batch_is_false_and_its_new_owner_row_is_untouched(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    leases = await _leases(jobs, "lost-one", 20)
    # Another replica took r007 over (a new owner token): our outcome for it must not apply.
    await _sql(
        pg_dsn,
        "UPDATE job_scheduler SET owner_token = gen_random_uuid() "
        "WHERE code = 'lost-one' AND run_key = 'r007'",
    )
    counts = _count_statements(jobs)
    results = await asyncio.gather(*(jobs.complete(lease, {"mine": True}) for lease in leases))
    assert counts["many"] >= 1
    assert results == [i != 7 for i in range(20)]
    rows = await _rows(pg_dsn, "lost-one")
    assert rows["r007"] == ("RUNNING", None)
    assert all(rows[f"r{i:03d}"] == ("SUCCESS", {"mine": True}) for i in range(20) if i != 7)


async def test_two_outcomes_of_one_row_never_share_a_statement(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """As with two single ``finalize`` calls: the first recorded wins, the second is refused."""
    leases = await _leases(jobs, "twice", 10)
    counts = _count_statements(jobs)
    doubled = leases[4]
    calls: list[Awaitable[bool]] = [jobs.complete(lease) for lease in leases]
    calls.append(jobs.fail(doubled, {"error": "second"}))
    results = await asyncio.gather(*calls)
    assert results[:10] == [True] * 10
    assert results[10] is False
    assert counts["many"] + counts["one"] >= 2
    assert (await _rows(pg_dsn, "twice"))["r004"] == ("SUCCESS", None)


async def test_a_caller_cancelled_before_its_row_was_sent_leaves_it_running(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    slots = jobs._finals._in_flight
    leases = await _leases(jobs, "cancelled", slots + 3)
    counts = _count_statements(jobs)
    tasks = [asyncio.create_task(jobs.complete(lease)) for lease in leases]
    await asyncio.sleep(0)  # the first calls are sent, the last three wait in the queue
    queued = slots + 1
    tasks[queued].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[queued], asyncio.CancelledError)
    assert all(result is True for i, result in enumerate(done) if i != queued), done
    assert counts["rows"] + counts["one"] == slots + 2
    rows = await _rows(pg_dsn, "cancelled")
    assert rows[f"r{queued:03d}"] == ("RUNNING", None)
    assert sum(status == "SUCCESS" for status, _ in rows.values()) == slots + 2


def _break_many(
    jobs: JobSchedulerService, *, commit_first: bool, error: BaseException
) -> dict[str, int]:
    """Make the next batch statement fail with ``error``, after committing it if asked."""
    finals = jobs._finals
    many = finals._many
    seen = {"failed": 0}

    async def broken(columns: tuple[list[Any], ...], limit: float | None) -> set[str]:
        if seen["failed"]:
            return await many(columns, limit)
        seen["failed"] += 1
        if commit_first:
            await many(columns, limit)
        raise error

    finals._many = broken
    return seen


@pytest.mark.parametrize("commit_first", [True, False], ids=["committed", "not-committed"])
async def test_an_ambiguous_batch_is_resolved_row_by_row(
    jobs: JobSchedulerService, pg_dsn: str, commit_first: bool
) -> None:
    """The connection breaks around the batch: each row reports ``True`` exactly when it shows
    the outcome, whether the batch had committed or not (never a false "lost")."""
    leases = await _leases(jobs, f"ambiguous-{commit_first}", 12)
    await jobs.complete(leases[0])  # the single-row statement of the first call goes alone
    seen = _break_many(
        jobs,
        commit_first=commit_first,
        error=psycopg.OperationalError("server closed the connection unexpectedly"),
    )
    results = await asyncio.gather(*(jobs.complete(lease, {"k": 1}) for lease in leases[1:]))
    assert seen["failed"] == 1
    assert results == [True] * 11
    rows = await _rows(pg_dsn, f"ambiguous-{commit_first}")
    assert all(status == "SUCCESS" for status, _ in rows.values())


async def test_a_refused_batch_is_sent_again_row_by_row(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    leases = await _leases(jobs, "refused", 8)
    await jobs.complete(leases[0])
    seen = _break_many(
        jobs, commit_first=False, error=pg_errors.DeadlockDetected("deadlock detected")
    )
    counts = _count_statements(jobs)
    results = await asyncio.gather(*(jobs.fail(lease, {"error": "x"}) for lease in leases[1:]))
    assert seen["failed"] == 1
    assert results == [True] * 7
    assert counts["one"] >= 7
    rows = await _rows(pg_dsn, "refused")
    assert [rows[f"r{i:03d}"][0] for i in range(1, 8)] == ["FAIL"] * 7


async def test_a_batch_without_an_answer_in_time_is_reported_unknown(
    jobs: JobSchedulerService,
) -> None:
    slots = jobs._finals._in_flight
    leases = await _leases(jobs, "abandoned", slots + 4)
    _break_many(jobs, commit_first=False, error=_Abandoned("the statement did not answer"))
    results = await asyncio.gather(
        *(jobs.complete(lease) for lease in leases), return_exceptions=True
    )
    assert results[:slots] == [True] * slots  # sent alone, at once, one per connection
    assert all(isinstance(r, JobSchedulerUnavailableError) for r in results[slots:]), results
    assert all("outcome unknown" in str(r) for r in results[slots:])


async def test_bad_data_is_refused_before_sql_and_the_others_are_recorded(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    leases = await _leases(jobs, "bad-data", 4)
    data: list[dict[str, float]] = [{"ok": 1}, {"ok": 1}, {"nan": float("nan")}, {"ok": 1}]

    async def complete(lease: JobExecutionLease, values: dict[str, float]) -> bool:
        return await jobs.complete(lease, values)

    results = await asyncio.gather(
        *(complete(lease, values) for lease, values in zip(leases, data, strict=True)),
        return_exceptions=True,
    )
    assert results[0] is True
    assert results[1] is True
    assert results[3] is True
    assert isinstance(results[2], ValueError)
    rows = await _rows(pg_dsn, "bad-data")
    assert rows["r002"] == ("RUNNING", None)
    assert json.dumps(rows["r000"][1]) == '{"ok": 1}'


async def test_still_running_statements_never_scan_the_running_index(schema_dsn: str) -> None:
    """A burst after the last ANALYZE: 10,000 RUNNING rows where the statistics counted none.

    The planner answered ``finalize``, ``heartbeat``, ``finalize_many`` and the operators'
    ``release`` from ``running_idx`` whenever it believed that partial index nearly empty, and an
    ``id =`` condition on its second column is checked against every RUNNING entry (a
    ``finalize_many`` of 300 rows took 24 ms instead of 5). Each must find its row by the
    primary key.
    """
    from psycopg import sql

    from sdcore._internal.sql import queries, render
    from sdcore.job_scheduler._sql import LeaseStatements

    table = sql.Identifier("job_scheduler")
    statements = LeaseStatements.render(table)
    release = render(queries("admin")["release"], table).as_string(None)
    async with await psycopg.AsyncConnection.connect(schema_dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO job_scheduler (lock_key, idempotency_key, code, type, run_key, status,"
            " owner_token) SELECT 'k' || g, 'i' || g, 'c', 'SCHEDULE', 'r' || g, 'SUCCESS',"
            " gen_random_uuid() FROM generate_series(1, 50000) AS g"
        )
        await conn.execute("ANALYZE job_scheduler")
        await conn.execute(
            "UPDATE job_scheduler SET status = 'RUNNING'"
            " WHERE lock_key IN (SELECT 'k' || g FROM generate_series(1, 10000) AS g)"
        )
        cur = await conn.execute(
            "SELECT id, owner_token FROM job_scheduler WHERE status = 'RUNNING' LIMIT 300"
        )
        rows = await cur.fetchall()
        ids, tokens = [r[0] for r in rows], [r[1] for r in rows]
        plans = {}
        for name, query, params in (
            ("finalize", statements.finalize, ("SUCCESS", None, ids[0], tokens[0])),
            ("heartbeat", statements.heartbeat, (ids[0], tokens[0])),
            (
                "finalize_many",
                statements.finalize_many,
                (["SUCCESS"] * 300, [None] * 300, ids, tokens),
            ),
            ("release", release.encode(), {"id": ids[0], "reason": "test"}),
        ):
            cur = await conn.execute(b"EXPLAIN " + query, params)
            plans[name] = "\n".join(str(r[0]) for r in await cur.fetchall())
        # The planner does use the index where it belongs: the listing of RUNNING rows.
        cur = await conn.execute(
            "EXPLAIN SELECT id FROM job_scheduler WHERE status = 'RUNNING'"
            " ORDER BY created_at DESC, id DESC LIMIT 50"
        )
        listing = "\n".join(str(r[0]) for r in await cur.fetchall())
    for name, plan in plans.items():
        assert "running_idx" not in plan, (name, plan)
        assert "job_scheduler_pkey" in plan, (name, plan)
    assert "running_idx" in listing, listing
