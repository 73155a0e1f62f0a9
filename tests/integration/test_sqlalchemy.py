"""``sdcore.sqlalchemy`` against real PostgreSQL: the declared table is the DDL, the ORM reads rows.

Three ways to build the table must give the same catalog: ``JobSchedulerService.ensure_schema()``
(the DDL of ``schema_sql()``), ``metadata.create_all()`` and the migration Alembic autogenerate
renders from the metadata. Alembic's own comparison must find no difference either.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata, produce_migrations, render_python_code
from alembic.migration import MigrationContext
from alembic.operations import Operations
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import CreateSchema

import sdcore.sqlalchemy
from sdcore.job_scheduler import JobSchedulerService, JobSchedulerStatus, JobSchedulerType
from sdcore.postgres import (
    SCHEMA_LOCK_ID,
    InvalidIdentifierError,
    migration_scripts,
    migration_status,
    migrations,
)
from sdcore.sqlalchemy import (
    JobSchedulerColumns,
    JobSchedulerRecord,
    ReadOnlyJobRecordError,
    forbid_orm_writes,
    job_scheduler_table,
    make_job_scheduler_model,
)

# (table, schema): the defaults, names that need quoting (a double quote, a space, upper case)
# and a 63-byte multibyte name whose derived constraint names must be clipped like the DDL's.
NAMES = [
    pytest.param("job_scheduler", None, id="default"),
    pytest.param('we"ird Job', 'tenant "a"', id="quoted"),
    pytest.param("é" * 31 + "x", "ops", id="63-bytes"),
]


# -- helpers -----------------------------------------------------------------------------------


def sa_url(dsn: str) -> URL:
    """Turn a libpq DSN (key/value or URI) into a ``postgresql+psycopg`` SQLAlchemy URL.

    The recipe of docs/how-to/sqlalchemy-alembic.md: every part goes through ``URL.create``
    unescaped, so passwords or names with ``@``, ``/`` or ``%`` survive; host, port (also a socket
    directory or a multi-host list) and every other keyword reach libpq through the query.
    """
    params = {key: str(value) for key, value in conninfo_to_dict(dsn).items()}
    return URL.create(
        "postgresql+psycopg",
        username=params.pop("user", None),
        password=params.pop("password", None),
        database=params.pop("dbname", None),
        query=params,
    )


@asynccontextmanager
async def engine_for(dsn: str) -> AsyncIterator[AsyncEngine]:
    """An async engine without a pool (nothing outlives the test), disposed on exit."""
    engine = create_async_engine(sa_url(dsn), poolclass=NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()


async def ensure_schema_db(dsn: str, table: str, schema: str | None) -> None:
    async with JobSchedulerService.connect(dsn, table=table, schema=schema) as service:
        await service.ensure_schema()


async def create_schema(conn: AsyncConnection, schema: str | None) -> None:
    if schema is not None:
        await conn.execute(CreateSchema(schema, if_not_exists=True))


async def create_all_db(dsn: str, table: str, schema: str | None) -> None:
    metadata = sa.MetaData()
    job_scheduler_table(metadata, table=table, schema=schema)
    async with engine_for(dsn) as engine, engine.begin() as conn:
        await create_schema(conn, schema)
        await conn.run_sync(metadata.create_all)


def _migration_opts(schema: str | None) -> dict[str, Any]:
    def include_name(name: str | None, type_: str, parents: object) -> bool:
        # sdcore's own bookkeeping, as docs/how-to/sqlalchemy-alembic.md tells users to skip it.
        if type_ == "table":
            return name != "sdcore_migrations"
        return type_ != "schema" or name in (None, schema)

    return {
        "compare_type": True,
        "compare_server_default": True,
        "include_schemas": schema is not None,
        "include_name": include_name,
    }


async def autogenerate_db(dsn: str, table: str, schema: str | None) -> str:
    """Render the migration Alembic autogenerates for an empty database, then run it there."""
    metadata = sa.MetaData()
    job_scheduler_table(metadata, table=table, schema=schema)

    def migrate(sync_conn: sa.Connection) -> str:
        context = MigrationContext.configure(sync_conn, opts=_migration_opts(schema))
        script = produce_migrations(context, metadata)
        assert script.upgrade_ops is not None
        code = render_python_code(script.upgrade_ops, migration_context=context)
        # The body of upgrade() in a revision file, with the imports of Alembic's template.
        namespace = {"op": Operations(context), "sa": sa, "postgresql": postgresql}
        exec(f"def upgrade():\n    {code}\nupgrade()\n", namespace)  # noqa: S102
        # Autogenerate does not create sequences: the docs tell users to add this line.
        for sequence in metadata._sequences.values():
            Operations(context).execute(sa.schema.CreateSequence(sequence))
        return code

    async with engine_for(dsn) as engine, engine.begin() as conn:
        await create_schema(conn, schema)
        return await conn.run_sync(migrate)


_COLUMNS = """\
SELECT column_name, ordinal_position, data_type, udt_name, character_maximum_length,
       numeric_precision, datetime_precision, is_nullable, column_default, is_identity,
       is_generated, collation_name
FROM information_schema.columns
WHERE table_schema = %(schema)s AND table_name = %(table)s
ORDER BY ordinal_position"""

_INDEXES = """\
SELECT indexname, indexdef FROM pg_indexes
WHERE schemaname = %(schema)s AND tablename = %(table)s
ORDER BY indexname"""

_CONSTRAINTS = """\
SELECT c.conname, c.contype, pg_get_constraintdef(c.oid), c.condeferrable, c.convalidated,
       c.connoinherit
FROM pg_constraint c
JOIN pg_class r ON r.oid = c.conrelid
JOIN pg_namespace n ON n.oid = r.relnamespace
WHERE n.nspname = %(schema)s AND r.relname = %(table)s
ORDER BY c.conname"""

_TABLES = """\
SELECT n.nspname, c.relname, c.relkind, c.relpersistence
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
  AND c.relname NOT IN ('sdcore_migrations', 'sdcore_migrations_pkey')
ORDER BY 1, 2"""


def catalog(dsn: str, table: str, schema: str | None) -> dict[str, list[tuple[Any, ...]]]:
    """What PostgreSQL says about the table: columns, indexes, constraints, relations."""
    params = {"schema": schema or "public", "table": table}
    with psycopg.connect(dsn) as conn:
        return {
            query_name: conn.execute(query, params).fetchall()
            for query_name, query in (
                ("columns", _COLUMNS),
                ("indexes", _INDEXES),
                ("constraints", _CONSTRAINTS),
                ("relations", _TABLES),
            )
        }


# -- (1) the declared table is the DDL ---------------------------------------------------------


@pytest.mark.parametrize(("table", "schema"), NAMES)
async def test_alembic_finds_no_difference_with_ensure_schema(
    pg_dsn: str, table: str, schema: str | None
) -> None:
    await ensure_schema_db(pg_dsn, table, schema)
    metadata = sa.MetaData()
    job_scheduler_table(metadata, table=table, schema=schema)

    def compare(sync_conn: sa.Connection) -> list[Any]:
        context = MigrationContext.configure(sync_conn, opts=_migration_opts(schema))
        return list(compare_metadata(context, metadata))

    async with engine_for(pg_dsn) as engine, engine.connect() as conn:
        diffs = await conn.run_sync(compare)
    assert diffs == []


async def test_alembic_sees_a_missing_index_so_the_comparison_is_real(pg_dsn: str) -> None:
    await ensure_schema_db(pg_dsn, "job_scheduler", None)
    async with engine_for(pg_dsn) as engine:
        async with engine.begin() as conn:
            await conn.execute(sa.text("DROP INDEX job_scheduler_code_created_at_idx"))
            await conn.execute(sa.text("ALTER TABLE job_scheduler ALTER COLUMN name TYPE text"))
        metadata = sa.MetaData()
        job_scheduler_table(metadata)

        def compare(sync_conn: sa.Connection) -> list[Any]:
            context = MigrationContext.configure(sync_conn, opts=_migration_opts(None))
            return list(compare_metadata(context, metadata))

        async with engine.connect() as conn:
            diffs = await conn.run_sync(compare)
    kinds = sorted(str(diff[0][0] if isinstance(diff, list) else diff[0]) for diff in diffs)
    assert kinds == ["add_index", "modify_type"]


@pytest.mark.parametrize(("table", "schema"), NAMES)
async def test_create_all_and_autogenerate_build_the_ensure_schema_catalog(
    pg_dsn: str, make_dsn: Callable[[], str], table: str, schema: str | None
) -> None:
    create_all_dsn, alembic_dsn = make_dsn(), make_dsn()
    await ensure_schema_db(pg_dsn, table, schema)
    await create_all_db(create_all_dsn, table, schema)
    code = await autogenerate_db(alembic_dsn, table, schema)

    expected = catalog(pg_dsn, table, schema)
    assert len(expected["columns"]) == 17
    assert len(expected["indexes"]) == 5  # pkey, lock_key_key and the three declared indexes
    assert len(expected["constraints"]) == 8  # pkey, unique, six checks
    assert catalog(create_all_dsn, table, schema) == expected
    assert catalog(alembic_dsn, table, schema) == expected, code


@pytest.mark.parametrize(("table", "schema"), NAMES)
async def test_explicit_migration_recipe_from_the_docs(
    pg_dsn: str, table: str, schema: str | None
) -> None:
    metadata = sa.MetaData()
    job_scheduler_table(metadata, table=table, schema=schema)

    def upgrade_then_compare(sync_conn: sa.Connection) -> list[Any]:
        context = MigrationContext.configure(sync_conn, opts=_migration_opts(schema))
        op = Operations(context)
        # docs/how-to/sqlalchemy-alembic.md, "Option B":
        op.execute(sa.text("SELECT pg_advisory_xact_lock(:id)").bindparams(id=SCHEMA_LOCK_ID))
        for script in migration_scripts("lease", table=table, schema=schema):
            op.execute(script.sql)
        return list(compare_metadata(context, metadata))

    async with engine_for(pg_dsn) as engine, engine.begin() as conn:
        assert await conn.run_sync(upgrade_then_compare) == []
    # ensure_schema() at start-up then sees every migration as applied: a no-op.
    async with await psycopg.AsyncConnection.connect(pg_dsn) as pconn:
        status = await migration_status(pconn, "lease", table=table, schema=schema)
    assert status.up_to_date
    assert len(status.applied) == len(migrations("lease"))
    await ensure_schema_db(pg_dsn, table, schema)


def test_names_are_the_ddl_names_even_under_a_naming_convention() -> None:
    metadata = sa.MetaData(
        naming_convention={
            "ix": "ix_%(column_0_label)s",
            "uq": "uq_%(table_name)s_%(column_0_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    table = job_scheduler_table(metadata)
    names = {str(c.name) for c in table.constraints} | {str(i.name) for i in table.indexes}
    assert names == {
        "job_scheduler_pkey",
        "job_scheduler_lock_key_key",
        "job_scheduler_type_check",
        "job_scheduler_status_check",
        "job_scheduler_run_key_check",
        "job_scheduler_fencing_token_check",
        "job_scheduler_lease_ms_check",
        "job_scheduler_attempts_check",
        "job_scheduler_code_created_at_idx",
        "job_scheduler_created_at_idx",
        "job_scheduler_running_idx",
    }
    code_index = next(i for i in table.indexes if i.name == "job_scheduler_code_created_at_idx")
    assert [str(e) for e in code_index.expressions] == [
        "job_scheduler.code",
        "job_scheduler.created_at DESC",
    ]


# -- (2) ORM reads of rows the service wrote ---------------------------------------------------


async def test_async_orm_reads_rows_written_by_the_service(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    data = {"ok": True, "n": 2**53 - 1, "x": 1.5, "s": "é ✓ 🙂", "list": [1, None, "a"], "o": {}}
    done = await jobs.acquire({"code": "orm", "run_key": "t1", "name": "Nightly"})
    assert done.acquired
    assert await jobs.complete(done.lease, data)
    first = await jobs.acquire({"code": "orm", "run_key": "t2"})
    assert first.acquired
    assert await jobs.fail(first.lease, {"error": "boom"})
    running = await jobs.acquire({"code": "orm", "run_key": "t2"})
    assert running.acquired
    initial = await jobs.acquire({"code": "boot", "type": JobSchedulerType.INITIAL})
    assert initial.acquired

    async with engine_for(pg_dsn) as engine, AsyncSession(engine) as session:
        rows = (
            await session.scalars(
                sa.select(JobSchedulerRecord)
                .where(JobSchedulerRecord.status == "RUNNING")
                .order_by(JobSchedulerRecord.created_at)
            )
        ).all()
        success = (
            await session.scalars(
                sa.select(JobSchedulerRecord).where(
                    JobSchedulerRecord.status == JobSchedulerStatus.SUCCESS
                )
            )
        ).one()

    assert [(r.code, r.run_key) for r in rows] == [("orm", "t2"), ("boot", None)]
    record = rows[0]
    expected = running.row
    assert record.id == running.id == expected.id
    assert record.owner_token == running.owner_token != first.owner_token
    assert record.fencing_token == running.fencing_token > first.fencing_token
    assert record.lease_ms == running.row.lease_ms
    assert record.idempotency_key == first.idempotency_key == expected.idempotency_key
    assert record.lock_key == expected.lock_key
    assert (record.type, record.status, record.data) == ("SCHEDULE", "RUNNING", None)
    assert record.created_at == expected.created_at
    assert record.modified_at == expected.modified_at
    assert rows[1].type == JobSchedulerType.INITIAL
    assert rows[1].fencing_token == initial.fencing_token

    assert success.id == done.id
    assert success.name == "Nightly"
    assert success.data == data
    assert json.dumps(success.data, sort_keys=True) == json.dumps(data, sort_keys=True)
    for stamp in (success.created_at, success.modified_at, record.created_at):
        assert stamp.tzinfo is not None
        assert stamp.utcoffset() is not None
    assert success.modified_at >= success.created_at
    assert success.modified_at - success.created_at < timedelta(minutes=5)


async def test_orm_filters_by_lease_id_string(jobs: JobSchedulerService, pg_dsn: str) -> None:
    acquired = await jobs.acquire({"code": "by-id", "run_key": "k"})
    assert acquired.acquired
    async with engine_for(pg_dsn) as engine, AsyncSession(engine) as session:
        record = await session.get(JobSchedulerRecord, acquired.id)
        by_where = await session.scalar(
            sa.select(JobSchedulerRecord.code).where(JobSchedulerRecord.id == acquired.id)
        )
    assert record is not None
    assert record.code == by_where == "by-id"


@pytest.mark.parametrize("operation", ["update", "insert", "delete"])
async def test_orm_writes_are_refused(
    jobs: JobSchedulerService, pg_dsn: str, operation: str
) -> None:
    acquired = await jobs.acquire({"code": "ro", "run_key": "k"})
    assert acquired.acquired
    async with engine_for(pg_dsn) as engine:
        async with AsyncSession(engine) as session:
            record = await session.get(JobSchedulerRecord, acquired.id)
            assert record is not None
            if operation == "update":
                record.status = "SUCCESS"
            elif operation == "delete":
                await session.delete(record)
            else:
                session.add(
                    JobSchedulerRecord(
                        lock_key="v2:x",
                        idempotency_key="v2:y",
                        code="ro",
                        type="INITIAL",
                        status="RUNNING",
                        owner_token=str(uuid.uuid4()),
                    )
                )
            with pytest.raises(ReadOnlyJobRecordError) as caught:
                await session.flush()
            assert caught.value.operation == operation
            await session.rollback()
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT status FROM job_scheduler"))).all()
    assert [tuple(r) for r in rows] == [("RUNNING",)]
    assert await jobs.complete(acquired.lease)


# -- (3) custom table and schema names ---------------------------------------------------------


def explicit_class(
    base: type[DeclarativeBase], table: str, schema: str | None
) -> type[JobSchedulerColumns]:
    """The documented alternative to the factory: a class statement mypy sees as ``Base``."""

    class Job(JobSchedulerColumns, base):  # type: ignore[valid-type,misc]
        __table__ = job_scheduler_table(base.metadata, table=table, schema=schema)

    forbid_orm_writes(Job)
    return Job


def factory(
    base: type[DeclarativeBase], table: str, schema: str | None
) -> type[JobSchedulerColumns]:
    return make_job_scheduler_model(base, table=table, schema=schema)


@pytest.mark.parametrize("build", [factory, explicit_class], ids=["factory", "class"])
@pytest.mark.parametrize(("table", "schema"), NAMES)
async def test_model_on_a_user_base_reads_a_custom_table(
    pg_dsn: str,
    table: str,
    schema: str | None,
    build: Callable[[type[DeclarativeBase], str, str | None], type[JobSchedulerColumns]],
) -> None:
    class Base(DeclarativeBase):
        pass

    model = build(Base, table, schema)
    assert issubclass(model, Base)
    assert model.__table__ is Base.metadata.tables[f"{schema}.{table}" if schema else table]

    async with JobSchedulerService.connect(pg_dsn, table=table, schema=schema) as service:
        await service.ensure_schema()
        acquired = await service.acquire({"code": "custom", "run_key": "r"})
        assert acquired.acquired
        async with engine_for(pg_dsn) as engine, AsyncSession(engine) as session:
            record = (await session.scalars(sa.select(model).where(model.code == "custom"))).one()
            seen = (record.id, record.owner_token, record.status, record.fencing_token)
            record.status = "FAIL"
            with pytest.raises(ReadOnlyJobRecordError):
                await session.flush()
    assert seen == (acquired.id, acquired.owner_token, "RUNNING", 1)


async def test_model_can_opt_out_of_the_read_only_guard(pg_dsn: str) -> None:
    class Base(DeclarativeBase):
        pass

    model = make_job_scheduler_model(Base, class_name="FixtureJob", read_only=False)
    async with engine_for(pg_dsn) as engine:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        async with AsyncSession(engine) as session, session.begin():
            session.add(
                model(
                    lock_key="v2:a",
                    idempotency_key="v2:b",
                    code="fixture",
                    type="INITIAL",
                    status="SUCCESS",
                    owner_token=str(uuid.uuid4()),
                    data=None,
                )
            )
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    sa.text("SELECT fencing_token, data IS NULL, id IS NOT NULL FROM job_scheduler")
                )
            ).one()
    assert model.__name__ == "FixtureJob"
    assert tuple(row) == (1, True, True)


@pytest.mark.parametrize(
    ("table", "schema"),
    [
        pytest.param("", None, id="empty-table"),
        pytest.param("x" * 64, None, id="64-bytes"),
        pytest.param("é" * 32, None, id="64-bytes-multibyte"),
        pytest.param("a\x00b", None, id="nul"),
        pytest.param("job_scheduler", "", id="empty-schema"),
        pytest.param("job_scheduler", "s" * 64, id="long-schema"),
    ],
)
def test_bad_identifiers_are_refused_before_anything_is_declared(
    table: str, schema: str | None
) -> None:
    class Base(DeclarativeBase):
        pass

    metadata = sa.MetaData()
    with pytest.raises(InvalidIdentifierError):
        job_scheduler_table(metadata, table=table, schema=schema)
    with pytest.raises(InvalidIdentifierError):
        make_job_scheduler_model(Base, table=table, schema=schema)
    assert not metadata.tables
    assert not Base.metadata.tables


def test_model_factory_refuses_a_mapped_class_and_a_second_declaration() -> None:
    class Base(DeclarativeBase):
        pass

    model = make_job_scheduler_model(Base)
    with pytest.raises(TypeError):
        make_job_scheduler_model(model)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        make_job_scheduler_model(object)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        make_job_scheduler_model(Base, class_name="Again")


def test_ready_record_is_on_a_private_metadata() -> None:
    class Base(DeclarativeBase):
        pass

    table = JobSchedulerRecord.__table__
    assert isinstance(table, sa.Table)
    assert (table.name, table.schema) == ("job_scheduler", None)
    assert table.metadata is not Base.metadata
    assert [c.name for c in table.columns] == [
        "id",
        "lock_key",
        "idempotency_key",
        "code",
        "name",
        "type",
        "run_key",
        "status",
        "owner_token",
        "fencing_token",
        "data",
        "created_at",
        "modified_at",
        "lease_ms",
        "attempts",
        "released",
        "given_back",
    ]


# -- (4) the core never imports SQLAlchemy -----------------------------------------------------


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip()


def test_core_imports_do_not_load_sqlalchemy() -> None:
    out = _run(
        "import sys, json\n"
        "import sdcore, sdcore.job_scheduler, sdcore.postgres\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "    if m.split('.')[0] in ('sqlalchemy', 'alembic'))))\n"
    )
    assert json.loads(out) == []


def test_missing_sqlalchemy_gives_the_install_hint() -> None:
    out = _run(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'sqlalchemy':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import sdcore.job_scheduler\n"
        "try:\n"
        "    import sdcore.sqlalchemy\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert "pip install 'sdcore[sqlalchemy]'" in out


def test_public_surface() -> None:
    assert sdcore.sqlalchemy.__all__ == [
        "JobSchedulerColumns",
        "JobSchedulerRecord",
        "ReadOnlyJobRecordError",
        "enqueue_once",
        "forbid_orm_writes",
        "job_scheduler_table",
        "make_job_scheduler_model",
    ]
    assert sorted(sdcore.sqlalchemy.__all__) == sdcore.sqlalchemy.__all__


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        pytest.param(
            "postgresql://u%40x:p%2Fw%40@db.example:6543/my%20db?sslmode=require",
            ("u@x", "p/w@", "my db", {"host": "db.example", "port": "6543", "sslmode": "require"}),
            id="uri",
        ),
        pytest.param(
            "host=/var/run/postgresql port=5433 dbname=d user=u",
            ("u", None, "d", {"host": "/var/run/postgresql", "port": "5433"}),
            id="socket",
        ),
    ],
)
def test_sa_url_helper_keeps_every_part(dsn: str, expected: tuple[Any, ...]) -> None:
    url = sa_url(dsn)
    assert url.drivername == "postgresql+psycopg"
    assert (url.username, url.password, url.database, dict(url.query)) == expected
    assert url.host is None
