"""A caller cancelled while an acquire recovers from a broken connection never leaves a
committed ``RUNNING`` row with no owner: the outcome is resolved by the caller's token and a row
it won is given back, on every acquire path (``acquire``/``run_exclusive``, ``acquire_many``,
the scheduler's ``acquire_attempt`` and ``acquire_attempts``).

A local proxy forwards the acquire (its INSERT commits), then drops the connection before the
answer; from then on every answer through the proxy is slow, and the caller is cancelled while
the recovery reads the row back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sdcore.job_scheduler import AttemptBudget, JobAcquireOptions, JobSchedulerService

_READY_FOR_QUERY = b"Z\x00\x00\x00\x05"
SLOW_S = 1.0  # every answer's delay once the first acquire's answer was dropped
OPTIONS = JobAcquireOptions(code="recover", run_key="k", lease_ms=60_000)
BUDGET = AttemptBudget(max_attempts=1, backoff_ms=60_000)


class DropThenSlowProxy:
    """Forward the first message containing ``marker``, swallow its answer and cut that
    connection; then delay every server answer, on every connection, by ``SLOW_S``."""

    def __init__(self, target_dsn: str, marker: bytes) -> None:
        params = conninfo_to_dict(target_dsn)
        self.host = str(params.get("host") or "127.0.0.1")
        self.port = int(params.get("port") or 5432)
        self.target_dsn = target_dsn
        self.marker = marker
        self.armed = False
        self.tripped = False
        self.swallowed = asyncio.Event()
        self.listen_port = 0
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.WriteTransport] = set()

    @property
    def dsn(self) -> str:
        params = {k: str(v) for k, v in conninfo_to_dict(self.target_dsn).items()}
        params.update(host="127.0.0.1", port=str(self.listen_port), sslmode="disable")
        return make_conninfo(**params)

    async def __aenter__(self) -> DropThenSlowProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for transport in list(self._transports):
            transport.abort()
        await self._server.wait_closed()

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self._transports.add(cwriter.transport)
        try:
            sreader, swriter = await asyncio.open_connection(self.host, self.port)
        except OSError:
            cwriter.transport.abort()
            return
        self._transports.add(swriter.transport)
        cut = asyncio.Event()

        async def upstream() -> None:
            while data := await creader.read(65536):
                if self.armed and not self.tripped and self.marker in data:
                    self.tripped = True
                    cut.set()  # set before forwarding: the answer cannot overtake it
                swriter.write(data)
                await swriter.drain()
            swriter.close()

        async def downstream() -> None:
            swallowed = b""
            while data := await sreader.read(65536):
                if cut.is_set():
                    swallowed += data
                    if _READY_FOR_QUERY in swallowed:
                        self.swallowed.set()
                        cwriter.transport.abort()
                        swriter.transport.abort()
                        return
                    continue
                if self.tripped:
                    await asyncio.sleep(SLOW_S)
                cwriter.write(data)
                await cwriter.drain()
            cwriter.close()

        try:
            await asyncio.gather(upstream(), downstream(), return_exceptions=True)
        finally:
            cwriter.transport.abort()
            swriter.transport.abort()
            self._transports.discard(cwriter.transport)
            self._transports.discard(swriter.transport)


async def _run_exclusive(svc: JobSchedulerService) -> Any:
    async def never(lease: object) -> None:
        raise AssertionError("fn must not start")

    return await svc.run_exclusive(OPTIONS, never)


async def _acquire_many(svc: JobSchedulerService) -> Any:
    return await svc.acquire_many([OPTIONS])


async def _acquire_attempt(svc: JobSchedulerService) -> Any:
    return await svc.acquire_attempt(OPTIONS, BUDGET)


async def _acquire_attempts(svc: JobSchedulerService) -> Any:
    return await svc.acquire_attempts([(OPTIONS, BUDGET)])


PATHS: dict[str, Callable[[JobSchedulerService], Awaitable[Any]]] = {
    "run_exclusive": _run_exclusive,
    "acquire_many": _acquire_many,
    "acquire_attempt": _acquire_attempt,
    "acquire_attempts": _acquire_attempts,
}


@pytest.mark.parametrize("path", list(PATHS))
async def test_cancelled_during_recovery_gives_the_row_back(
    jobs: JobSchedulerService, pg_dsn: str, path: str
) -> None:
    async with (
        DropThenSlowProxy(pg_dsn, b"INSERT INTO") as proxy,
        JobSchedulerService.connect(proxy.dsn, max_size=2, max_connections=1) as svc,
    ):
        await svc.statuses(["warm-up"])  # the held connection is open before the fault
        proxy.armed = True
        call = asyncio.ensure_future(PATHS[path](svc))
        await asyncio.wait_for(proxy.swallowed.wait(), 30)
        await asyncio.sleep(SLOW_S / 2)  # the recovery is reading the row back now
        assert not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 60)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT status, given_back FROM job_scheduler WHERE lock_key = %s",
            (OPTIONS.lock_key,),
        )
        row = await cur.fetchone()
    assert row == ("FAIL", "cancelled")  # committed, then given back: not RUNNING, no owner
    # Another replica takes the run at once (the tick acquire with the same attempt number).
    if path.startswith("acquire_attempt"):
        got, attempt = await jobs.acquire_attempt(OPTIONS, BUDGET)
        assert (got.acquired, attempt) == (True, 1)
    else:
        got = await jobs.acquire(OPTIONS)
        assert got.acquired
    with contextlib.suppress(Exception):
        await jobs.complete(got.lease)  # type: ignore[union-attr]
