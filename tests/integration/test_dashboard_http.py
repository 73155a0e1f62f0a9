"""The dashboard over plain HTTP: forged requests refused, escaping, mounting, the CLI."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Annotated

import httpx
import psycopg
import pytest
from fastapi import FastAPI, Header
from psycopg_pool import AsyncConnectionPool

from sdcore.dashboard import DashboardError, dashboard_app
from sdcore.scheduling import ScheduleAdmin
from tests.integration._dashboard import (
    HOSTILE,
    TOKEN,
    Cluster,
    cluster,
    eventually,
    free_port,
    serve,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NAME = "heartbeat-every-second"
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def csrf_of(html: str) -> str:
    found = CSRF.search(html)
    assert found is not None, "the page has no CSRF field"
    return found.group(1)


async def paused(c: Cluster) -> bool:
    states = {s.name: s for s in await ScheduleAdmin(c.b.schedule_store).list_schedules()}
    return states[NAME].paused


async def test_actions_need_the_token_and_the_csrf_token(pg_dsn: str) -> None:
    async with cluster(pg_dsn) as c, serve(dashboard_app(c.a, token=TOKEN)) as url:
        async with httpx.AsyncClient(base_url=url) as anonymous:
            r = await anonymous.post("/schedule/pause", data={"name": NAME, "csrf": "x"})
            assert r.status_code == 401
            assert "Sign in" in r.text
            r = await anonymous.post("/outbox/retry", data={"id": str(c.dead_id)})
            assert r.status_code == 401

        async with httpx.AsyncClient(base_url=url) as alice:
            page = await alice.get("/login")
            assert "sdcore_dashboard" in alice.cookies
            login = csrf_of(page.text)
            wrong = {"name": "alice", "token": "wrong" * 5, "csrf": login}
            r = await alice.post("/login", data=wrong)
            assert r.status_code == 401
            r = await alice.post("/login", data={"name": "alice", "token": TOKEN})
            assert r.status_code == 403, "a login without its CSRF token"
            r = await alice.post("/login", data={"name": "alice", "token": TOKEN, "csrf": login})
            assert r.status_code == 303
            token = csrf_of((await alice.get("/")).text)
            assert token != login, "signing in starts a new session"

            forged = [
                ({"name": NAME}, {}),
                ({"name": NAME, "csrf": login}, {}),
                ({"name": NAME, "csrf": token[:-2] + "AA"}, {}),
                ({"name": NAME, "csrf": token}, {"Origin": "https://evil.example"}),
                ({"name": NAME, "csrf": token}, {"Sec-Fetch-Site": "cross-site"}),
            ]
            for fields, headers in forged:
                r = await alice.post("/schedule/pause", data=fields, headers=headers)
                assert r.status_code == 403, (fields, headers)
            assert not await paused(c)

            r = await alice.post(
                "/schedule/pause",
                data={"name": NAME, "csrf": token, "reason": "forged? no"},
                headers={"Origin": url},
            )
            assert r.status_code == 303
            assert r.headers["location"].startswith("/schedule?name=")
            assert await paused(c)
            # The same action again is a refused action with the reason, not a 500.
            r = await alice.post("/schedule/pause", data={"name": NAME, "csrf": token})
            assert r.status_code == 409
            assert "already paused" in r.text

            # A backfill of the last few seconds (UTC, as a datetime-local field sends it).
            now = datetime.now(UTC).replace(microsecond=0)
            window = {
                "name": NAME,
                "csrf": token,
                "from": (now - timedelta(seconds=8)).strftime("%Y-%m-%dT%H:%M:%S"),
                "to": (now - timedelta(seconds=2)).strftime("%Y-%m-%dT%H:%M:%S"),
            }
            r = await alice.post("/schedule/backfill", data={**window, "from": "yesterday"})
            assert r.status_code == 400
            r = await alice.post("/schedule/backfill", data=window)
            assert r.status_code == 303, r.text
            actions = await ScheduleAdmin(c.b.schedule_store).actions(NAME)
            assert [a.action.value for a in actions[:2]] == ["backfill", "pause"]
            assert {a.actor for a in actions[:2]} == {"alice (dashboard)"}

            # Another visitor's CSRF token does not fit alice's session.
            async with httpx.AsyncClient(base_url=url) as mallory:
                theirs = csrf_of((await mallory.get("/login")).text)
            r = await alice.post("/schedule/resume", data={"name": NAME, "csrf": theirs})
            assert r.status_code == 403
            assert await paused(c)


async def test_pages_escape_and_send_a_strict_policy(pg_dsn: str) -> None:
    async with (
        cluster(pg_dsn) as c,
        serve(dashboard_app(c.a, token=TOKEN)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        r = await client.get("/")
        assert r.status_code == 200
        assert HOSTILE not in r.text
        assert "&lt;img src=x onerror=alert(1)&gt;" in r.text
        assert "<script>alert" not in r.text
        assert "<b>bold</b>" not in r.text
        policy = r.headers["content-security-policy"]
        assert "default-src 'none'" in policy
        assert "script-src 'self'" in policy
        assert "'unsafe-inline'" not in policy
        assert r.headers["x-frame-options"] == "DENY"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie
        assert "samesite=strict" in cookie
        r = await client.get("/schedule", params={"name": HOSTILE})
        assert r.status_code == 200
        assert HOSTILE not in r.text
        r = await client.get("/outbox")
        assert "&lt;i&gt;poison&lt;/i&gt;" in r.text
        assert "<i>poison</i>" not in r.text
        fragment = await client.get("/", headers={"X-Sdcore-Fragment": "1"})
        assert "<html" not in fragment.text
        assert "<table" in fragment.text
        r = await client.get("/schedule", params={"name": "no such"})
        assert r.status_code == 404


async def test_without_credentials_the_dashboard_is_read_only(pg_dsn: str) -> None:
    async with (
        cluster(pg_dsn) as c,
        serve(dashboard_app(c.a)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        page = await client.get(f"/schedule?name={NAME}")
        assert "Pause" not in page.text
        assert "read-only" in page.text
        login = await client.get("/login")
        assert "no operator token" in login.text
        assert CSRF.search(login.text) is None
        token = "no-form-to-take-it-from"
        r = await client.post("/login", data={"name": "a", "token": TOKEN, "csrf": token})
        assert r.status_code == 403
        r = await client.post("/schedule/pause", data={"name": NAME, "csrf": token})
        assert r.status_code == 403
        assert not await paused(c)
    with pytest.raises(DashboardError, match="at least 16"):
        dashboard_app(c.a, token="short")


async def test_mounted_in_a_host_app_with_its_own_operator(pg_dsn: str) -> None:
    async def operator(x_user: Annotated[str | None, Header()] = None) -> str | None:
        return x_user  # a stand-in for the host application's own authentication

    async with cluster(pg_dsn) as c:
        host = FastAPI()
        host.mount("/ops/sdcore", dashboard_app(c.a, operator=operator))
        async with serve(host) as url, httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/ops/sdcore/static/dashboard.css")).status_code == 200
            page = await client.get("/ops/sdcore/", headers={"X-User": "bob"})
            assert 'href="/ops/sdcore/leases"' in page.text
            assert "operator: <strong>bob</strong>" in page.text
            token = csrf_of(page.text)
            r = await client.post("/ops/sdcore/schedule/pause", data={"name": NAME, "csrf": token})
            assert r.status_code == 401, "no operator without the host's header"
            r = await client.post(
                "/ops/sdcore/schedule/pause",
                data={"name": NAME, "csrf": token},
                headers={"X-User": "bob"},
            )
            assert r.status_code == 303
            assert r.headers["location"].startswith("/ops/sdcore/schedule?name=")
            states = {s.name: s for s in await ScheduleAdmin(c.b.schedule_store).list_schedules()}
            assert states[NAME].paused_by == "bob (dashboard)"


async def test_cli_serves_the_dashboard_until_sigterm(pg_dsn: str) -> None:
    port = free_port()
    command = [sys.executable, "-m", "sdcore.cli", "dashboard", "--database-url", pg_dsn]
    short = subprocess.run(
        [*command, "--port", str(port)],
        env={**os.environ, "SDCORE_DASHBOARD_TOKEN": "short"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert short.returncode == 1
    assert "SDCORE_DASHBOARD_TOKEN" in short.stderr
    env = {k: v for k, v in os.environ.items() if k != "SDCORE_DASHBOARD_TOKEN"}
    process = subprocess.Popen(
        [*command, "--port", str(port)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def answers() -> bool:
                try:
                    return (await client.get("/")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(answers, "sdcore dashboard to answer", timeout=30)
            page = await client.get("/")
            # A fresh database: the page says which command creates the tables.
            assert "sdcore db upgrade --schedules" in page.text
            assert "read-only" in page.text
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            out, _ = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0
    assert "read-only" in out
    assert "dashboard stopped" in out


async def test_outbox_retry_makes_a_dead_row_due(pg_dsn: str) -> None:
    async with cluster(pg_dsn) as c, serve(dashboard_app(c.a, token=TOKEN)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            login = csrf_of((await client.get("/login")).text)
            await client.post("/login", data={"name": "ops", "token": TOKEN, "csrf": login})
            token = csrf_of((await client.get("/outbox")).text)
            r = await client.post("/outbox/retry", data={"id": "12abc", "csrf": token})
            assert r.status_code == 400
            r = await client.post("/outbox/retry", data={"id": "999999", "csrf": token})
            assert r.status_code == 409
            r = await client.post("/outbox/retry", data={"id": str(c.dead_id), "csrf": token})
            assert r.status_code == 303
        async with await psycopg.AsyncConnection.connect(c.dsn, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT status, attempts FROM outbox WHERE id = %s", (c.dead_id,)
            )
            assert await cur.fetchone() == ("PENDING", 0)


async def test_start_up_warms_the_calendar_and_survives_a_missing_table(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sdcore.dashboard")
    async with cluster(pg_dsn) as c:
        app = dashboard_app(c.a)
        async with app.router.lifespan_context(app):
            warmed = [r for r in caplog.records if getattr(r, "action", "") == "calendar_warmed"]
            assert warmed
            assert warmed[0].hours >= 24  # type: ignore[attr-defined]
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://dashboard"
            ) as client:
                assert (await client.get("/")).status_code == 200
        caplog.clear()
        async with AsyncConnectionPool(c.dsn, open=False, kwargs={"autocommit": True}) as pool:
            other = dashboard_app(pool, schedules_table="no_such_schedules")
            async with other.router.lifespan_context(other):
                pass
        assert any("calendar warm-up failed" in r.getMessage() for r in caplog.records)
