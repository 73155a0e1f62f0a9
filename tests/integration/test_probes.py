"""Liveness and readiness: in FastAPI, on the CLI's monitoring port, with the database made
unreachable (a PgBouncer of our own that we stop) and with the relay stuck (a Redis of our own
that we stop). The shared servers are never touched."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import conninfo_to_dict

from sdcore.fastapi import Sdcore, install, probes_router
from sdcore.outbox import RelaySettings
from sdcore.postgres import PoolSettings
from sdcore.probes import serve
from tests._servers import free_port, pgbouncer

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]


async def _get(client: httpx.AsyncClient, path: str) -> tuple[int, dict[str, object]]:
    response = await client.get(path)
    return response.status_code, response.json()


async def test_readiness_follows_the_database(make_dsn: Callable[[], str]) -> None:
    dbname = str(conninfo_to_dict(make_dsn())["dbname"])
    with pgbouncer(
        upstream_host="127.0.0.1", upstream_port=5432, mode="session", pool_size=8
    ) as bouncer:
        # A first connection through a PgBouncer just started can take seconds on a busy machine.
        sd = Sdcore(
            database_url=bouncer.dsn(dbname), pool=PoolSettings(max_size=4, connect_timeout=10)
        )
        app = FastAPI()
        install(app, sd)
        app.include_router(probes_router(details=True))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            status, _ = await _get(client, "/readyz")
            assert status == 503  # not started yet: not ready, and not alive either
            assert (await client.get("/livez")).status_code == 503
            await sd.start()
            port = free_port()
            server = await serve(sd, host="127.0.0.1", port=port)
            try:
                status, body = await _get(client, "/readyz")
                assert status == 200, body
                assert body["checks"] == {
                    "runtime": {"ok": True, "detail": "started"},
                    "scheduler": {"ok": True, "detail": "running"},
                    "database": {"ok": True, "detail": "reachable"},
                }
                bouncer.process.terminate()
                bouncer.process.wait(timeout=10)
                async with asyncio.timeout(15):
                    status, body = await _get(client, "/readyz")
                assert status == 503
                checks = body["checks"]
                assert isinstance(checks, dict)
                assert checks["database"]["ok"] is False
                # Liveness never waits for the database: a restart does not cure an outage.
                status, body = await _get(client, "/livez")
                assert status == 200, body
                # The same answers on the monitoring port, without details.
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as plain:
                    ready = await plain.get("/readyz")
                    live = await plain.get("/livez")
                    metrics = await plain.get("/metrics")
                assert ready.status_code == 503
                assert ready.json()["checks"]["database"] == {"ok": False}
                assert live.status_code == 200
                assert metrics.status_code == 404  # this runtime has no metrics
            finally:
                server.close()
                await server.wait_closed()
                # With the database gone the stop still ends promptly: leaving the control plane
                # gives up after 5 s instead of waiting the pool's 30 s checkout timeout.
                async with asyncio.timeout(20):
                    await sd.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server of this test (stopped by the test, killed at the end if still up)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)", pytrace=False)
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while (
            subprocess.run(
                ["redis-cli", "-p", str(port), "ping"], capture_output=True, check=False
            ).stdout.strip()
            != b"PONG"
        ):
            if time.monotonic() > deadline:
                pytest.fail("the test's redis-server did not start", pytrace=False)
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}", process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


async def test_readiness_fails_while_the_relay_is_stuck(
    make_dsn: Callable[[], str], own_redis: tuple[str, subprocess.Popen[bytes]]
) -> None:
    url, redis_process = own_redis
    sd = Sdcore(
        database_url=make_dsn(),
        redis_url=url,
        relay=RelaySettings(stuck_after_s=1.0),
        scheduling=None,
    )
    async with sd:
        ready = await sd.readiness()
        assert ready.ok, ready
        redis_process.kill()
        redis_process.wait(timeout=10)
        # Idle and nothing due: a relay that cannot reach the broker is not stuck yet.
        await asyncio.sleep(1.5)
        async with sd.pool.connection() as conn, conn.transaction():
            await sd.outbox.enqueue_once(conn, idempotency_key="k", queue="q", name="n", payload={})
        async with asyncio.timeout(30):
            while (ready := await sd.readiness()).ok:
                await asyncio.sleep(0.2)
        relay = ready.checks["relay"]
        assert not relay.ok
        assert relay.detail.startswith("stuck: 1 row(s) due")
        assert ready.checks["database"].ok
        assert (await sd.liveness()).ok  # the relay loop still runs: it recovers with Redis


@pytest.mark.slow
def test_sdcore_run_serves_probes_and_metrics(pg_dsn: str) -> None:
    port = free_port()
    env = {**os.environ, "SDCORE_RUN_TEST_DSN": pg_dsn, "SDCORE_LOG_JSON": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sdcore.cli",
            "run",
            "tests.integration._run_app:runtime",
            "--metrics-port",
            str(port),
            "--metrics-host",
            "127.0.0.1",
            "--log-level",
            "INFO",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        runs = 0.0
        while runs < 1:
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("no successful tick on /metrics")
            time.sleep(0.3)
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.TransportError:
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "sdcore_schedule_runs_total" and sample.labels == {
                        "schedule": "heartbeat-row",
                        "outcome": "success",
                    }:
                        runs = sample.value
        assert httpx.get(f"http://127.0.0.1:{port}/livez", timeout=5).status_code == 200
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert ready.status_code == 200
        assert ready.json()["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0
    # SDCORE_LOG_JSON=1: every log line is one JSON object with the record's extra fields.
    started = [line for line in stderr.splitlines() if '"action":"started"' in line]
    assert started, stderr
    assert started[0].startswith("{")
