"""The outbox relay through a real PgBouncer.

A PgBouncer of this test (Debian's ``pgbouncer``, run as the postgres OS user when the tests run
as root, on a free loopback port) forwards to the test database. Measured per mode, and reported
(``pytest -s``): whether the relay says it listens, and the wake-up latency (commit → published).

- transaction pooling, ``transaction_pooling=True``: no LISTEN, ``listening`` false, rows found by
  the poll; two relays on their own default pools (psycopg would prepare statements after five
  runs) publish every row with no error;
- transaction pooling with ``listen_dsn`` (direct): woken by NOTIFY although the pool goes through
  PgBouncer;
- session pooling, default relay: LISTEN works through the pinned session.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import Outbox, OutboxMessage, OutboxRelay, PostgresOutboxStore
from sdcore.testing import RecordingPublisher

pytestmark = pytest.mark.slow


def _report(line: str) -> None:
    print(line)  # noqa: T201


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_postgres() -> dict[str, Any]:
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam("postgres")
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


@contextlib.contextmanager
def _pgbouncer(upstream: str, mode: str, pool_size: int) -> Iterator[int]:
    """Run a PgBouncer (``pool_mode = mode``) in front of ``upstream``."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists():
        pytest.fail("pgbouncer is not installed: apt-get install pgbouncer", pytrace=False)
    params = conninfo_to_dict(upstream)
    workdir = Path(tempfile.mkdtemp(prefix="sdcore-outbox-pgbouncer-"))
    port = _free_port()
    (workdir / "users.txt").write_text('"postgres" ""\n')
    (workdir / "pgbouncer.ini").write_text(
        "\n".join(
            [
                "[databases]",
                f"* = host={params.get('host', '127.0.0.1')} port={params.get('port', 5432)}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {workdir / 'users.txt'}",
                f"pool_mode = {mode}",
                f"default_pool_size = {pool_size}",
                "max_client_conn = 100",
                f"logfile = {workdir / 'pgbouncer.log'}",
                "",
            ]
        )
    )
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        for path in (workdir, workdir / "users.txt", workdir / "pgbouncer.ini"):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    proc = subprocess.Popen(
        [binary, str(workdir / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
        **_as_postgres(),
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                log = (workdir / "pgbouncer.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"pgbouncer did not start: {log}", pytrace=False)
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _via(port: int, dsn: str) -> str:
    dbname = conninfo_to_dict(dsn)["dbname"]
    return f"host=127.0.0.1 port={port} dbname={dbname} user=postgres"


class Stamped(RecordingPublisher):
    """Records when each key was published (monotonic s)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: dict[str, float] = {}

    async def publish(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        results = list(await super().publish(messages))
        now = time.monotonic()
        for message in messages:
            self.at.setdefault(message.idempotency_key, now)
        return results


async def _latencies(
    enqueue_dsn: str, publisher: Stamped, rows: int, *, timeout: float
) -> list[float | None]:
    """Commit ``rows`` rows one by one (0.3 s apart); per row, commit → published, or None."""
    outbox = Outbox()
    out: list[float | None] = []
    async with await psycopg.AsyncConnection.connect(enqueue_dsn, prepare_threshold=None) as conn:
        for i in range(rows):
            key = f"wake-{i}-{time.monotonic_ns()}"
            async with conn.transaction():
                await outbox.enqueue_once(
                    conn, idempotency_key=key, queue="q", name="n", payload={}
                )
            committed = time.monotonic()
            deadline = committed + timeout
            while key not in publisher.at and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            out.append(publisher.at[key] - committed if key in publisher.at else None)
            await asyncio.sleep(0.3)
    return out


def _shown(values: list[float | None]) -> str:
    woken = sorted(v for v in values if v is not None)
    if not woken:
        return f"0/{len(values)} published in time"
    return (
        f"{len(woken)}/{len(values)} published, median {woken[len(woken) // 2] * 1e3:.0f} ms,"
        f" max {woken[-1] * 1e3:.0f} ms"
    )


async def _listening(relay: OutboxRelay) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if relay.state.listening:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_relay_through_transaction_pooling(pg_dsn: str) -> None:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=1, open=False) as direct:
        await direct.open()
        await Outbox().ensure_schema(direct)
    # Two server connections for every client: a LISTEN's session is certainly reused.
    with _pgbouncer(pg_dsn, "transaction", pool_size=2) as port:
        bouncer = _via(port, pg_dsn)
        # Default pools (prepare_threshold=5): only the relay's prepare=False keeps them safe.
        async with (
            AsyncConnectionPool(bouncer, min_size=1, max_size=2, open=False) as pool_a,
            AsyncConnectionPool(bouncer, min_size=1, max_size=2, open=False) as pool_b,
        ):
            await pool_a.open()
            await pool_b.open()
            # Polling only.
            polled = Stamped()
            relay = OutboxRelay(
                PostgresOutboxStore(pool_a, transaction_pooling=True),
                polled,
                poll_interval_ms=200,
                batch_size=5,
            )
            other = OutboxRelay(
                PostgresOutboxStore(pool_b, transaction_pooling=True),
                polled,
                poll_interval_ms=200,
                batch_size=5,
            )
            async with relay, other:
                assert not await _listening(relay)
                poll_lat = await _latencies(bouncer, polled, 5, timeout=3)
                async with (
                    await psycopg.AsyncConnection.connect(bouncer, prepare_threshold=None) as conn,
                    conn.transaction(),
                ):
                    for i in range(200):
                        await Outbox().enqueue_once(
                            conn, idempotency_key=f"bulk-{i}", queue="q", name="n", payload={}
                        )
                deadline = time.monotonic() + 30
                while sum(k.startswith("bulk-") for k in polled.at) < 200:
                    assert time.monotonic() < deadline, "200 rows were not published"
                    await asyncio.sleep(0.05)
                errors = (relay.state.last_error, other.state.last_error)
            assert not relay.state.listening
            assert errors == (None, None)
            assert all(v is not None for v in poll_lat)
            # LISTEN on a direct connection, claims through PgBouncer.
            woken = Stamped()
            async with OutboxRelay(
                PostgresOutboxStore(pool_a, transaction_pooling=True, listen_dsn=pg_dsn),
                woken,
                poll_interval_ms=60_000,
            ) as listening:
                assert await _listening(listening)
                await asyncio.sleep(0.3)
                listen_lat = await _latencies(bouncer, woken, 5, timeout=3)
            assert all(v is not None and v < 3 for v in listen_lat)
            # For contrast, neither switch set: LISTEN through the pooler.
            naive = Stamped()
            async with OutboxRelay(
                PostgresOutboxStore(pool_a), naive, poll_interval_ms=60_000
            ) as fooled:
                said_listening = await _listening(fooled)
                await asyncio.sleep(0.3)
                naive_lat = await _latencies(bouncer, naive, 3, timeout=2)
    _report(
        f"relay via PgBouncer transaction mode: transaction_pooling=True listening=False,"
        f" poll 200 ms: {_shown(poll_lat)}; 2 relays x 200 rows, 0 errors |"
        f" listen_dsn direct: listening=True, {_shown(listen_lat)} |"
        f" no switch (0.1.0): listening={said_listening}, {_shown(naive_lat)} (poll 60 s)"
    )


async def test_relay_through_session_pooling_listens(pg_dsn: str) -> None:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=1, open=False) as direct:
        await direct.open()
        await Outbox().ensure_schema(direct)
    with _pgbouncer(pg_dsn, "session", pool_size=10) as port:
        bouncer = _via(port, pg_dsn)
        async with AsyncConnectionPool(bouncer, min_size=1, max_size=1, open=False) as pool:
            await pool.open()
            publisher = Stamped()
            async with OutboxRelay(
                PostgresOutboxStore(pool), publisher, poll_interval_ms=60_000
            ) as relay:
                assert await _listening(relay)
                await asyncio.sleep(0.3)
                lat = await _latencies(bouncer, publisher, 5, timeout=3)
    assert all(v is not None and v < 3 for v in lat)
    _report(f"relay via PgBouncer session mode: listening=True, {_shown(lat)} (poll 60 s)")
