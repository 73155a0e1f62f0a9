"""Trigger requests are idempotent: a CLI retry after the reply to its COMMIT was lost, and a
double submit of the dashboard's trigger form, each run the schedule once."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest

from sdcore.dashboard import dashboard_app
from sdcore.scheduling import ActionKind, Scheduler, Tick
from tests._pgproxy import PgProxy, on_commit_after
from tests.integration.test_cli_schedule_control import Replica, replica, until

pytestmark = pytest.mark.timeout(180)


def _send_invoices(scheduler: Scheduler, r: Replica) -> None:
    async def send(tick: Tick) -> None:
        r.runs.append((tick.schedule, tick.run_key, None))

    scheduler.add_interval("send-invoices", 3_600_000, send)


def _triggered(r: Replica) -> list[str]:
    """Run keys of triggered runs only: the hourly interval's own tick may fire mid-test."""
    return [k for k in r.keys("send-invoices") if k is not None and k.startswith("trigger:")]


async def _triggers(r: Replica) -> list[Any]:
    return [a for a in await r.admin.actions("send-invoices") if a.action is ActionKind.TRIGGER]


async def test_a_cli_retry_after_a_lost_commit_reply_runs_once(pg_dsn: str) -> None:
    marker = b'INSERT INTO "sdcore_schedules_actions"'
    async with (
        replica(pg_dsn, _send_invoices) as r,
        PgProxy(pg_dsn, on_commit_after(marker)) as proxy,
    ):
        first = await r.cli("schedules", "trigger", "send-invoices", dsn=proxy.dsn)
        assert proxy.tripped
        assert first.code == 1, first
        assert "the action may have been recorded" in first.err
        assert "see `sdcore schedules log send-invoices`" in first.err
        found = re.search(r"--request-id ([0-9a-f]{32})", first.err)
        assert found is not None, first.err
        # The server did commit: the replica runs it.
        await until(lambda: _triggered(r))
        recorded = await _triggers(r)
        assert [a.request_id for a in recorded] == [found.group(1)]
        retry = await r.cli(
            "schedules", "trigger", "send-invoices", "--request-id", found.group(1), "--json"
        )
        assert retry.code == 0, retry
        assert f'"id":{recorded[0].id},' in retry.out.replace(" ", "")
        await asyncio.sleep(1.5)  # a second action would be picked up within a poll
        assert _triggered(r) == [f"trigger:{recorded[0].id}"]
        assert len(await _triggers(r)) == 1
        # Another request (a new id) is another run.
        again = await r.cli("schedules", "trigger", "send-invoices")
        assert again.code == 0, again
        await until(lambda: len(_triggered(r)) == 2)


async def test_a_double_submitted_trigger_form_runs_once(pg_dsn: str) -> None:
    async def operator() -> str:
        return "alice"

    async with replica(pg_dsn, _send_invoices) as r:
        app = dashboard_app(r.control.store.pool, operator=operator)  # type: ignore[attr-defined]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as client:
            page = (await client.get("/schedule", params={"name": "send-invoices"})).text
            form = re.search(r'action="/schedule/trigger".*?</form>', page, re.DOTALL)
            assert form is not None, page
            fields = dict(re.findall(r'name="(\w+)" value="([^"]*)"', form.group(0)))
            assert set(fields) == {"csrf", "name", "request_id"}
            posts = await asyncio.gather(
                client.post("/schedule/trigger", data=fields),
                client.post("/schedule/trigger", data=fields),
            )
            assert [p.status_code for p in posts] == [303, 303]
            await until(lambda: _triggered(r))
            await asyncio.sleep(1.5)
            assert len(_triggered(r)) == 1
            assert len(await _triggers(r)) == 1
            # A new rendering of the page is a new request.
            page = (await client.get("/schedule", params={"name": "send-invoices"})).text
            fresh = re.search(r'name="request_id" value="([^"]+)"', page)
            assert fresh is not None
            assert fresh.group(1) != fields["request_id"]


async def test_the_dashboard_says_a_lost_commit_reply_may_have_recorded_it(pg_dsn: str) -> None:
    from psycopg_pool import AsyncConnectionPool

    async def operator() -> str:
        return "alice"

    marker = b'INSERT INTO "sdcore_schedules_actions"'
    async with (
        replica(pg_dsn, _send_invoices) as r,
        PgProxy(pg_dsn, on_commit_after(marker)) as proxy,
        AsyncConnectionPool(
            proxy.dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False
        ) as pool,
    ):
        await pool.wait()
        transport = httpx.ASGITransport(app=dashboard_app(pool, operator=operator))
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as client:
            page = (await client.get("/schedule", params={"name": "send-invoices"})).text
            form = re.search(r'action="/schedule/trigger".*?</form>', page, re.DOTALL)
            assert form is not None, page
            fields = dict(re.findall(r'name="(\w+)" value="([^"]*)"', form.group(0)))
            lost = await client.post("/schedule/trigger", data=fields)
            assert proxy.tripped
            assert lost.status_code == 503, lost.text
            assert "may have been recorded" in lost.text
            assert "Submitting the same form again records it at most once" in lost.text
            again = await client.post("/schedule/trigger", data=fields)
            assert again.status_code == 303, again.text
            await until(lambda: _triggered(r))
            await asyncio.sleep(1.5)
            assert len(_triggered(r)) == 1
            assert len(await _triggers(r)) == 1


async def test_a_request_id_used_again_says_nothing_new_runs(pg_dsn: str) -> None:
    # A script that reuses a fixed --request-id (or a browser's stale form) gets the first action
    # back: the CLI, its JSON and the dashboard must say that nothing new was recorded, not that
    # a replica runs it now.
    async def operator() -> str:
        return "alice"

    async with replica(pg_dsn, _send_invoices) as r:
        first = await r.cli("schedules", "trigger", "send-invoices", "--request-id", "nightly-1")
        assert first.code == 0, first
        assert "one replica runs it" in first.out
        (action,) = await _triggers(r)
        assert not action.replayed

        async def finished() -> bool:
            return (await r.admin.action(action.id)).outcome == "SUCCESS"

        await until(finished)
        again = await r.cli("schedules", "trigger", "send-invoices", "--request-id", "nightly-1")
        assert again.code == 0, again
        assert "one replica runs it" not in again.out, again.out
        assert f"request id 'nightly-1' already recorded action {action.id}" in again.out
        assert "finished SUCCESS" in again.out
        assert "nothing new was recorded" in again.out
        as_json = await r.cli(
            "schedules", "trigger", "send-invoices", "--request-id", "nightly-1", "--json"
        )
        assert '"replayed":true' in as_json.out.replace(" ", ""), as_json.out
        first_json = await r.cli("schedules", "log", "send-invoices", "--json")
        assert '"replayed":false' in first_json.out.replace(" ", ""), first_json.out
        await asyncio.sleep(1.0)
        assert _triggered(r) == [f"trigger:{action.id}"]

        app = dashboard_app(r.control.store.pool, operator=operator)  # type: ignore[attr-defined]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as client:
            page = (await client.get("/schedule", params={"name": "send-invoices"})).text
            form = re.search(r'action="/schedule/trigger".*?</form>', page, re.DOTALL)
            assert form is not None, page
            fields = dict(re.findall(r'name="(\w+)" value="([^"]*)"', form.group(0)))
            posted = await client.post("/schedule/trigger", data=fields, follow_redirects=True)
            assert "Triggered: one replica runs it now." in posted.text
            # The same form once more (the browser's Back button, then the button again).
            stale = await client.post("/schedule/trigger", data=fields, follow_redirects=True)
            assert "Triggered: one replica runs it now." not in stale.text
            assert "already submitted" in stale.text
        assert len(await _triggers(r)) == 2
