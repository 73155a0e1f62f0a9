"""Versioned migrations: a 0.1.0 database upgrades in place, N upgraders apply each once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sdcore.job_scheduler import JobSchedulerService, idempotency_key, lock_key
from sdcore.outbox import Outbox
from sdcore.postgres import (
    InvalidIdentifierError,
    Migration,
    _migrations,
    full_sql,
    migrate,
    migration_scripts,
    migration_status,
    migrations,
)

DDL_0_1_0 = Path(__file__).parent / "data" / "ddl_0_1_0.sql"
LEGACY_CODE = "legacy-0.1.0"
# Rows as sdcore 0.1.0 wrote them: every status, both types, an outbox row in each state.
SEED_0_1_0 = f"""
INSERT INTO job_scheduler (lock_key, idempotency_key, code, name, type, run_key, status,
                           owner_token, fencing_token, data, created_at, modified_at)
VALUES
 ('{lock_key(LEGACY_CODE, "2026-07-20T03:00:00Z")}',
  '{idempotency_key(LEGACY_CODE, "2026-07-20T03:00:00Z")}', '{LEGACY_CODE}', 'Nightly',
  'SCHEDULE', '2026-07-20T03:00:00Z', 'SUCCESS', gen_random_uuid(), 1, '{{"rows": 3}}',
  now() - interval '2 days', now()),
 ('{lock_key(LEGACY_CODE, "2026-07-21T03:00:00Z")}',
  '{idempotency_key(LEGACY_CODE, "2026-07-21T03:00:00Z")}', '{LEGACY_CODE}', NULL, 'SCHEDULE',
  '2026-07-21T03:00:00Z', 'FAIL', gen_random_uuid(), 4, NULL, now() - interval '1 day', now()),
 ('{lock_key(LEGACY_CODE, None, "INITIAL")}', '{idempotency_key(LEGACY_CODE, None, "INITIAL")}',
  '{LEGACY_CODE}', NULL, 'INITIAL', NULL, 'RUNNING', gen_random_uuid(), 2, NULL, now(), now());
INSERT INTO outbox (idempotency_key, queue, name, job_id, payload, options, status, attempts,
                    max_attempts, published_at)
VALUES
 ('legacy-pending', 'emails', 'send', 'sd-1', '{{"to": "a@example.org"}}', '{{}}', 'PENDING', 0,
  10, NULL),
 ('legacy-published', 'emails', 'send', 'sd-2', '{{"n": 1}}', '{{}}', 'PUBLISHED', 1, 10, now()),
 ('legacy-dead', 'emails', 'send', 'sd-3', '{{"n": 2}}', '{{}}', 'DEAD', 10, 10, NULL);
"""

_CATALOG = """
SELECT 'column', c.relname, a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
       || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
       || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), '')
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r' AND a.attnum > 0
  AND NOT a.attisdropped AND c.relname <> 'sdcore_migrations'
UNION ALL
SELECT 'constraint', conrelid::regclass::text, conname || ' ' || pg_get_constraintdef(oid)
FROM pg_constraint WHERE connamespace = 'public'::regnamespace
UNION ALL
SELECT 'index', tablename, indexdef FROM pg_indexes WHERE schemaname = 'public'
UNION ALL
SELECT 'sequence', relname, '' FROM pg_class
WHERE relnamespace = 'public'::regnamespace AND relkind = 'S'
ORDER BY 1, 2, 3
"""


def _catalog(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return list(conn.execute(_CATALOG).fetchall())


def _rows(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(dsn) as conn:
        jobs = conn.execute(
            "SELECT lock_key, status, fencing_token, data, owner_token FROM job_scheduler"
            " WHERE code = %s ORDER BY lock_key",
            (LEGACY_CODE,),
        ).fetchall()
        outbox = conn.execute(
            "SELECT idempotency_key, status, job_id, payload FROM outbox"
            " WHERE idempotency_key LIKE 'legacy-%' ORDER BY idempotency_key"
        ).fetchall()
    return {"jobs": list(jobs), "outbox": list(outbox)}


def _recorded(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return list(
            conn.execute(
                "SELECT component, target, version, count(*) OVER (PARTITION BY component,"
                " target, version) FROM sdcore_migrations ORDER BY 1, 2, 3"
            ).fetchall()
        )


def _legacy(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL_0_1_0.read_bytes())
        conn.execute(SEED_0_1_0.encode())


def _shipped() -> list[tuple[str, str, int, int]]:
    return [
        (component, table, m.version, 1)
        for component, table in (("lease", "job_scheduler"), ("outbox", "outbox"))
        for m in migrations(component)
    ]


def test_the_first_migration_is_the_0_1_0_ddl() -> None:
    text = DDL_0_1_0.read_text()
    for component in ("lease", "outbox"):
        first = migrations(component)[0]
        body = "\n".join(
            line
            for line in first.render(table=_migrations.DEFAULT_TABLES[component]).splitlines()
            if not line.startswith("--")
        )
        assert body in text, component


def test_upgrade_from_0_1_0_by_four_processes_at_once_keeps_every_row(
    pg_dsn: str, make_dsn: Any
) -> None:
    _legacy(pg_dsn)
    before = _rows(pg_dsn)
    command = [
        sys.executable,
        "-m",
        "sdcore.cli",
        "--database-url",
        pg_dsn,
        "db",
        "upgrade",
        "--outbox",
    ]
    for round_ in range(2):
        procs = [
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(4)
        ]
        outputs = [proc.communicate(timeout=60) for proc in procs]
        assert [proc.returncode for proc in procs] == [0] * 4, outputs
        reports = "".join(out for out, _ in outputs)
        applied = reports.count("applied ")
        # Every shipped migration applied exactly once over the four processes, none the 2nd time.
        assert applied == (len(_shipped()) if round_ == 0 else 0), reports
    assert _recorded(pg_dsn) == _shipped()
    after = _rows(pg_dsn)
    assert [r[:4] for r in after["jobs"]] == [r[:4] for r in before["jobs"]]
    assert [r[4] for r in after["jobs"]] == [r[4] for r in before["jobs"]]
    assert [r[:2] for r in after["outbox"]] == [r[:2] for r in before["outbox"]]
    assert [r[3] for r in after["outbox"]] == [r[3] for r in before["outbox"]]

    # The upgraded database has exactly the catalog of a database created by this sdcore.
    fresh = make_dsn()
    assert subprocess.run([*command[:4], fresh, *command[5:]], check=False).returncode == 0
    assert _catalog(pg_dsn) == _catalog(fresh)


async def test_ensure_schema_upgrades_0_1_0_and_the_lease_still_works(pg_dsn: str) -> None:
    _legacy(pg_dsn)
    async with JobSchedulerService.connect(pg_dsn) as jobs:
        await jobs.ensure_schema()
        await jobs.ensure_schema()
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            await Outbox().ensure_schema(conn)
            status = await migration_status(conn, "lease")
            assert status.up_to_date
            assert [a.name for a in status.applied] == [m.name for m in migrations("lease")]
        # A legacy FAIL row is takeable, a legacy SUCCESS row is not, with fencing continuing.
        taken = await jobs.acquire({"code": LEGACY_CODE, "run_key": "2026-07-21T03:00:00Z"})
        done = await jobs.acquire({"code": LEGACY_CODE, "run_key": "2026-07-20T03:00:00Z"})
        assert not done.acquired
        assert taken.acquired
        assert taken.fencing_token >= 5


def test_status_before_and_after(pg_dsn: str) -> None:
    import asyncio

    async def status() -> Any:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            return await migration_status(conn, "outbox", table="events_out")

    empty = asyncio.run(status())
    assert not empty.up_to_date
    assert empty.applied == ()
    assert [m.name for m in empty.pending] == [m.name for m in migrations("outbox")]

    async def apply() -> list[Migration]:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            return await migrate(conn, "outbox", table="events_out")

    assert [m.name for m in asyncio.run(apply())] == [m.name for m in migrations("outbox")]
    assert asyncio.run(apply()) == []
    done = asyncio.run(status())
    assert done.up_to_date
    assert done.modified == ()
    assert done.unknown == ()


def test_a_failing_migration_rolls_back_alone_and_is_retried(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    shipped = migrations("lease")
    broken = Migration(
        component="lease",
        version=9999,
        slug="broken",
        template="ALTER TABLE {table} ADD COLUMN zz int; SELECT 1 / 0;",
    )
    monkeypatch.setattr(_migrations, "migrations", lambda component: (*shipped, broken))

    async def apply() -> list[Migration]:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            return await migrate(conn, "lease")

    with pytest.raises(psycopg.errors.DivisionByZero):
        asyncio.run(apply())
    with psycopg.connect(pg_dsn) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM sdcore_migrations")]
        columns = [
            r[0]
            for r in conn.execute(
                "SELECT column_name FROM information_schema.columns"
                " WHERE table_name = 'job_scheduler' AND column_name = 'zz'"
            )
        ]
    assert sorted(versions) == [m.version for m in shipped]
    assert columns == []


def test_migration_scripts_run_by_another_tool_count_as_applied(pg_dsn: str) -> None:
    import asyncio

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for component, table in (("lease", "jobs_x"), ("outbox", "out_x")):
            for script in migration_scripts(component, table=table, schema="ops"):  # type: ignore[arg-type]
                conn.execute(script.sql.encode())

    async def check() -> tuple[list[Migration], bool]:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            applied = await migrate(conn, "lease", table="jobs_x", schema="ops")
            status = await migration_status(conn, "outbox", table="out_x", schema="ops")
            return applied, status.up_to_date

    assert asyncio.run(check()) == ([], True)


def test_rendering_fills_only_sdcore_placeholders() -> None:
    migration = Migration(
        component="lease",
        version=2,
        slug="demo",
        template=(
            "ALTER TABLE {table} ADD COLUMN x jsonb DEFAULT '{}';\n"
            "CREATE SEQUENCE {object:fencing_seq};\nCREATE INDEX {name:x_idx} ON {table} (x);\n"
            "SELECT '{other}', '{name:}';"
        ),
    )
    text = migration.render(table="jobs", schema="ops")
    assert text == (
        'ALTER TABLE "ops"."jobs" ADD COLUMN x jsonb DEFAULT \'{}\';\n'
        'CREATE SEQUENCE "ops"."jobs_fencing_seq";\n'
        'CREATE INDEX "jobs_x_idx" ON "ops"."jobs" (x);\n'
        "SELECT '{other}', '{name:}';"
    )
    long = migration.render(table="t" * 63)
    names = re.findall(r'"([^"]+)"', long)
    assert len(names) == 4
    assert all(len(name.encode()) <= 63 for name in names), names
    with pytest.raises(InvalidIdentifierError, match="reserved"):
        full_sql("lease", table="sdcore_migrations")
    with pytest.raises(ValueError, match="unknown component"):
        migrations("nope")


def test_db_status_json(pg_dsn: str) -> None:
    base = [sys.executable, "-m", "sdcore.cli", "--database-url", pg_dsn, "db"]
    out = subprocess.run(
        [*base, "status", "--json", "--outbox"], capture_output=True, text=True, check=True
    ).stdout
    docs = [json.loads(line) for line in out.splitlines()]
    assert [(d["component"], d["up_to_date"], d["applied"]) for d in docs] == [
        ("lease", False, []),
        ("outbox", False, []),
    ]
    subprocess.run([*base, "upgrade"], capture_output=True, check=True)
    text = subprocess.run([*base, "status"], capture_output=True, text=True, check=True).stdout
    assert text.splitlines()[0] == 'lease table "job_scheduler": up to date'
    assert re.search(r"^  0001_initial +applied +20\d\d-", text, re.MULTILINE), text
