"""The dashboard in a real browser (Debian's chromium driven by Playwright) over real HTTP.

``SDCORE_SCREENSHOTS=1`` writes the screenshots of ``docs/images/dashboard-*.png``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sdcore.dashboard import dashboard_app
from sdcore.scheduling import ScheduleAdmin
from tests.integration._dashboard import (
    HOSTILE,
    REDIS_URL,
    TOKEN,
    Cluster,
    chromium,
    cluster,
    eventually,
    serve,
)

# Runs with the acceptance tests, with nothing beside it: a per-second schedule must show no missed
# tick, which a busy neighbour process can cause.
pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.alone,
    pytest.mark.slow,
    pytest.mark.timeout(240),
]

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
DESKTOP: Any = {"width": 1280, "height": 860}
PHONE: Any = {"width": 390, "height": 844}


@asynccontextmanager
async def browser(*, javascript: bool = True, phone: bool = False) -> AsyncIterator[Any]:
    """A page of a fresh headless chromium context."""
    from playwright.async_api import async_playwright

    path = chromium()
    async with async_playwright() as driver:
        engine = await driver.chromium.launch(
            executable_path=path, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            context = await engine.new_context(
                viewport=PHONE if phone else DESKTOP,
                is_mobile=phone,
                has_touch=phone,
                device_scale_factor=2 if phone else 1,
                java_script_enabled=javascript,
            )
            page = await context.new_page()
            page.set_default_timeout(15_000)
            dialogs: list[str] = []
            page.on("dialog", lambda dialog: dialogs.append(dialog.message))
            yield page
            assert dialogs == [], f"a script ran: {dialogs}"
        finally:
            await engine.close()


async def shot(page: Any, name: str) -> None:
    if os.environ.get("SDCORE_SCREENSHOTS") == "1":
        IMAGES.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(IMAGES / f"dashboard-{name}.png"), full_page=True)


def app_for(c: Cluster, **options: Any) -> Any:
    return dashboard_app(
        c.a, token=TOKEN, redis_url=REDIS_URL, queue_prefix=c.prefix, refresh_s=0, **options
    )


async def test_every_page_shows_the_cluster(pg_dsn: str) -> None:
    chromium()
    async with cluster(pg_dsn) as c, serve(app_for(c)) as url, browser() as page:
        await page.goto(url + "/")
        main = page.locator("main")
        assert await page.locator("h1").inner_text() == "Schedules"
        text = await main.inner_text()
        for name in ("heartbeat-every-second", "flaky-export", "hourly-report", "slow-rebuild"):
            assert name in text
        # Hostile data is shown as text, never as markup.
        assert HOSTILE in text
        assert await page.locator("main img").count() == 0
        assert await page.locator("header .badge").inner_text() == "read-only"
        assert await page.locator("main button", has_text="Pause").count() == 0
        hourly = page.locator("tr", has_text="hourly-report")
        assert await hourly.locator(".miss-count").inner_text() == "3"
        assert await hourly.locator("svg.timeline rect.miss").count() == 3
        heartbeat = page.locator("tr", has_text="heartbeat-every-second")
        assert await heartbeat.locator(".miss-count").count() == 0
        flaky = page.locator("tr", has_text="flaky-export")

        async def last_runs_shown() -> bool:
            # A tick may be in flight when the page renders (its last run is then RUNNING).
            failed, ok = await flaky.inner_text(), await heartbeat.inner_text()
            if "FAIL" in failed and "SUCCESS" in ok:
                return True
            await page.reload()
            return False

        await eventually(last_runs_shown, "the last runs' outcomes")
        assert "<b>bold</b>" in await flaky.inner_text()
        await shot(page, "schedules")

        await page.get_by_role("link", name="flaky-export").click()
        assert await page.locator("h1").inner_text() == "flaky-export"
        runs = await page.locator("table").first.inner_text()
        assert "FAIL" in runs
        assert "export failed: <b>bold</b>" in runs
        await shot(page, "schedule")

        await page.get_by_role("link", name="Leases").click()
        row = page.locator("tr", has_text="slow-rebuild")
        assert f"{socket.gethostname()}:{os.getpid()}" in await row.inner_text()
        assert "ago" in await row.inner_text()
        await shot(page, "leases")

        await page.get_by_role("link", name="Outbox").click()
        text = await main.inner_text()
        assert "1 dead" in text
        dead = page.locator("tr", has_text="DEAD")
        assert "emails / <i>poison</i>" in await dead.inner_text()
        assert "injected: <i>poison</i> is poison" in await dead.inner_text()
        assert "PENDING" in await page.locator("tr", has_text="digest").inner_text()
        await shot(page, "outbox")

        await page.get_by_role("link", name="Queues").click()
        queue = page.locator("tr", has_text="thumbnails")
        assert (await queue.locator("td").nth(1).inner_text()).strip() == "1"

        async with browser(phone=True) as phone:
            for path, name in (("/", "phone"), ("/outbox", "phone-outbox")):
                await phone.goto(url + path)
                width = await phone.evaluate("document.documentElement.scrollWidth")
                assert width <= PHONE["width"], f"{path} scrolls sideways on a phone ({width} px)"
                assert await phone.locator("main td").first.is_visible()
                await shot(phone, name)


async def test_operator_pauses_without_javascript_and_replica_b_sees_it(pg_dsn: str) -> None:
    chromium()
    name = "heartbeat-every-second"
    async with cluster(pg_dsn) as c, serve(app_for(c)) as url, browser(javascript=False) as page:
        await page.goto(url + "/login")
        await page.get_by_label("Your name").fill("alice")
        await page.get_by_label("Operator token").fill(TOKEN)
        await page.get_by_role("button", name="Sign in").click()
        assert "Signed in" in await page.locator(".notice").inner_text()
        assert "alice" in await page.locator("header .who").inner_text()

        await page.goto(url + "/")
        await page.locator("tr", has_text=name).get_by_role("link", name=name).click()
        await page.get_by_label("Reason").fill("db maintenance <tonight>")
        await page.get_by_role("button", name="Pause").click()
        assert "Paused" in await page.locator(".notice").inner_text()
        assert "paused" in await page.locator("dl.facts").inner_text()

        async def b_paused() -> bool:
            return c.b.control.paused(name)

        await eventually(b_paused, "replica B to hold the schedule as paused")
        # Read back through the operator API on replica B's own pool.
        states = {s.name: s for s in await ScheduleAdmin(c.b.schedule_store).list_schedules()}
        assert states[name].paused
        assert states[name].paused_by == "alice (dashboard)"
        assert states[name].paused_reason == "db maintenance <tonight>"
        log = await page.locator("table").nth(1).inner_text()
        assert "alice (dashboard)" in log
        assert "db maintenance <tonight>" in log
        await shot(page, "operator")

        await page.get_by_role("button", name="Resume").click()
        assert "Resumed" in await page.locator(".notice").inner_text()

        async def b_resumed() -> bool:
            return not c.b.control.paused(name)

        await eventually(b_resumed, "replica B to resume the schedule")

        await page.get_by_role("button", name="Trigger now").click()
        assert "Triggered" in await page.locator(".notice").inner_text()

        async def triggered() -> bool:
            await page.reload()
            return bool(await page.locator("td[data-label='Source']", has_text="trigger").count())

        await eventually(triggered, "the triggered run in the history", timeout=20)

        await page.goto(url + "/outbox?status=DEAD")
        await page.get_by_role("button", name="Retry now").click()
        assert "pending again" in await page.locator(".notice").inner_text()
        async with await psycopg.AsyncConnection.connect(c.dsn, autocommit=True) as conn:
            cur = await conn.execute("SELECT status FROM outbox WHERE id = %s", (c.dead_id,))
            row = await cur.fetchone()
        # Nothing relays in this cluster (relay=False): the row stays PENDING.
        assert row is not None
        assert row[0] == "PENDING"


async def test_tables_refresh_in_place_with_javascript(pg_dsn: str) -> None:
    chromium()
    async with cluster(pg_dsn) as c, serve(_refreshing(c)) as url, browser() as page:
        response = await page.goto(url + "/")
        # As served (the page itself may refresh before a look at it on a busy machine).
        assert response is not None
        assert "data-refreshed" not in await response.text()
        main = page.locator("main")

        async def refreshed() -> bool:
            return await main.get_attribute("data-refreshed") is not None

        await eventually(refreshed, "the table to refresh", timeout=15)
        # The fragment replaced the content, not the page: the header is still there once.
        assert await page.locator("header").count() == 1
        assert await page.locator("main h1").inner_text() == "Schedules"


def _refreshing(c: Cluster) -> Any:
    return dashboard_app(c.a, token=TOKEN, refresh_s=1)
