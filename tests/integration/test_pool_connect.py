"""``connect()``: open timeout, the server's reason, the weak-commit warning, reconnect timing."""

from __future__ import annotations

import asyncio
import logging
import time

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sdcore.job_scheduler import JobSchedulerService, JobSchedulerUnavailableError
from sdcore.postgres import PoolSettings
from tests._servers import free_port


def _with(dsn: str, **changes: str) -> str:
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    params.update(changes)
    return make_conninfo(**params)


async def test_a_refusing_server_fails_at_once_with_its_reason(pg_dsn: str) -> None:
    dsn = _with(pg_dsn, dbname="sdcore_no_such_database", password="pw-hidden")
    started = time.monotonic()
    with pytest.raises(JobSchedulerUnavailableError) as caught:
        async with JobSchedulerService.connect(
            dsn, pool=PoolSettings(max_size=4, open_timeout_ms=20_000)
        ):
            pass
    elapsed = time.monotonic() - started
    text = str(caught.value)
    assert 'database "sdcore_no_such_database" does not exist' in text
    assert "pw-hidden" not in text
    assert "pool initialization incomplete" not in text
    assert elapsed < 10  # not the 20 s open timeout: a refusal is final


async def test_nothing_listening_waits_for_the_open_timeout_then_says_why(pg_dsn: str) -> None:
    dsn = _with(pg_dsn, host="127.0.0.1", port=str(free_port()))
    started = time.monotonic()
    with pytest.raises(JobSchedulerUnavailableError, match="Connection refused"):
        async with JobSchedulerService.connect(
            dsn, pool=PoolSettings(max_size=4, open_timeout_ms=1_500)
        ):
            pass
    assert 1.0 < time.monotonic() - started < 15


async def test_the_server_coming_up_during_the_open_timeout_is_waited_for(pg_dsn: str) -> None:
    """A relay in front of the real server starts listening 1 s after connect() began."""
    target = conninfo_to_dict(pg_dsn)
    port = free_port()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        sreader, swriter = await asyncio.open_connection(
            str(target.get("host", "127.0.0.1")), int(str(target.get("port", 5432)))
        )
        await asyncio.gather(pipe(creader, swriter), pipe(sreader, cwriter))

    async def later() -> asyncio.Server:
        await asyncio.sleep(1.0)
        return await asyncio.start_server(handle, "127.0.0.1", port)

    starting = asyncio.create_task(later())
    dsn = _with(pg_dsn, host="127.0.0.1", port=str(port))
    try:
        async with JobSchedulerService.connect(
            dsn, pool=PoolSettings(max_size=4, open_timeout_ms=15_000)
        ) as jobs:
            await jobs.ensure_schema()
            assert await jobs.statuses(["x"]) == {}
    finally:
        server = await starting
        server.close()


async def test_weak_synchronous_commit_is_logged_once(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    dbname = str(conninfo_to_dict(pg_dsn)["dbname"])
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute(f'ALTER DATABASE "{dbname}" SET synchronous_commit = off'.encode())
    caplog.set_level(logging.WARNING, logger="sdcore.postgres")
    async with JobSchedulerService.connect(pg_dsn, pool=PoolSettings(max_size=3)) as jobs:
        await jobs.ensure_schema()
        for index in range(3):
            outcome = await jobs.run_exclusive(
                {"code": "weak", "run_key": f"r{index}"}, lambda lease: None
            )
            assert outcome.acquired
    weak = [r for r in caplog.records if getattr(r, "action", None) == "synchronous_commit_weak"]
    assert len(weak) == 1
    assert "'off'" in weak[0].getMessage()


async def test_strong_synchronous_commit_is_not_logged(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sdcore.postgres")
    async with JobSchedulerService.connect(pg_dsn) as jobs:
        await jobs.ensure_schema()
    assert not [r for r in caplog.records if getattr(r, "action", None)]
