"""The dashboard's pure parts: signed sessions, CSRF tokens, the tick calendar, formatting."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine
from psycopg_pool import AsyncConnectionPool

import sdcore.dashboard
from sdcore.dashboard import DashboardError, dashboard_app
from sdcore.dashboard._auth import Signer, check_actor, check_token, token_matches
from sdcore.dashboard._calendar import BUCKET, Calendar
from sdcore.dashboard._data import Bucket
from sdcore.dashboard._format import age, timeline
from sdcore.runtime import Runtime
from sdcore.scheduling import Scheduler

TOKEN = "unit-test-operator-token-000"


def _unopened_pool() -> AsyncConnectionPool[Any]:
    return AsyncConnectionPool("postgresql://nowhere.invalid/x", open=False)


def test_public_surface() -> None:
    assert sdcore.dashboard.__all__ == ["DashboardError", "Operator", "dashboard_app"]


def test_a_session_cookie_round_trips_and_a_tampered_one_is_refused() -> None:
    signer = Signer.for_token(TOKEN)
    session = signer.new_session("alice")
    value = signer.dump(session)
    assert signer.load(value) == session
    body, mac = value.split(".")
    assert signer.load(body + "." + mac[:-1] + ("A" if mac[-1] != "A" else "B")) is None
    forged = signer.dump(signer.new_session("mallory")).split(".")[0]
    assert signer.load(forged + "." + mac) is None
    assert Signer.for_token(TOKEN + "x").load(value) is None, "another token, another key"
    assert Signer.for_token(TOKEN).load(value) == session, "the same token on another replica"
    for junk in (None, "", "a.b.c", "x" * 5000, "..", "not-base64!.abc"):
        assert signer.load(junk) is None


def test_an_expired_session_is_refused() -> None:
    signer = Signer.for_token(TOKEN)
    value = signer.dump(signer.new_session("alice"))
    with time_machine.travel(time.time() + 13 * 3600, tick=False):
        assert signer.load(value) is None


def test_csrf_tokens_belong_to_one_session() -> None:
    signer = Signer.for_token(TOKEN)
    one, two = signer.new_session(None), signer.new_session(None)
    assert one.sid != two.sid
    assert signer.check_csrf(one, signer.csrf(one))
    assert not signer.check_csrf(one, signer.csrf(two))
    assert not signer.check_csrf(one, None)
    assert not signer.check_csrf(None, signer.csrf(one))


def test_tokens_and_names_are_checked() -> None:
    assert token_matches(TOKEN, TOKEN)
    assert not token_matches(TOKEN, TOKEN[:-1])
    assert not token_matches(None, "")
    assert not token_matches(TOKEN, None)
    assert check_token(None) is None
    for bad in ("short", " " * 20, 12345):
        with pytest.raises(DashboardError, match="at least 16"):
            check_token(bad)
    with pytest.raises(DashboardError, match="16 bytes"):
        Signer(b"short")
    refused: list[dict[str, Any]] = [
        {"refresh_s": -1},
        {"refresh_s": True},
        {"queue_prefix": ""},
        {"secret": "s" * 20},
        # No BullMQ queue can live under an untagged prefix on a cluster.
        {"redis_url": "redis+cluster://127.0.0.1:7000", "queue_prefix": "bull"},
        {"redis_url": "redis+cluster://127.0.0.1:7000"},
    ]
    for options in refused:
        with pytest.raises(DashboardError):
            dashboard_app(_unopened_pool(), **options)
    assert check_actor("  alice   smith ") == "alice smith"
    assert check_actor("") is None
    assert check_actor("x" * 101) is None


def test_the_queue_prefix_is_the_runtimes_by_default() -> None:
    # On a cluster the Runtime holds a tagged prefix; the dashboard must read the queues there,
    # not under "bull" (which it would now refuse on a cluster URL).
    runtime = Runtime(
        "postgresql://u@127.0.0.1:1/db",
        redis_url="redis+cluster://127.0.0.1:7000",
        queue_prefix="{app}",
        ensure_schema=False,
    )
    dashboard_app(runtime)
    with pytest.raises(DashboardError, match=r"queue_prefix: .*hash tag.*got 'bull'"):
        dashboard_app(runtime, queue_prefix="bull")


@pytest.mark.parametrize("every_ms", [1, 7, 1_000, 60_000, 3_600_000, 7 * 60_000 + 13])
def test_interval_counts_match_the_grid(every_ms: int) -> None:
    calendar = Calendar()
    start = datetime(2026, 3, 29, 0, 0, tzinfo=UTC)
    windows = ((0, 3_600_000), (1, 3_599_999), (123_456, 2_000_001), (5, 5), (7, 420_020))
    for index, (low_ms, high_ms) in enumerate(windows):
        low = start + timedelta(milliseconds=low_ms)
        high = start + timedelta(milliseconds=high_ms)
        epoch_low = int((low - datetime(1970, 1, 1, tzinfo=UTC)) / timedelta(milliseconds=1))
        epoch_high = int((high - datetime(1970, 1, 1, tzinfo=UTC)) / timedelta(milliseconds=1))
        # The reference: every millisecond of the window tested, for the short ones; for the
        # hour-long ones (millions of milliseconds), the multiples of the interval stepped over.
        if high_ms - low_ms <= 420_020:
            expected = sum(1 for ms in range(epoch_low, epoch_high) if ms % every_ms == 0)
        else:
            expected = len(range(epoch_low + (-epoch_low % every_ms), epoch_high, every_ms))
        got = calendar.expected("interval", str(every_ms), "UTC", start, low, high)
        assert got == expected, (windows[index], got, expected)


@pytest.mark.parametrize(
    ("expression", "zone"),
    [
        ("*/1 * * * *", "UTC"),
        ("30 2 * * *", "Europe/Paris"),  # 02:30 does not exist on 2026-03-29 in Paris
        ("*/20 * * * * *", "UTC"),
        ("0 * * * *", "America/New_York"),
    ],
)
def test_cron_counts_match_the_scheduler(expression: str, zone: str) -> None:
    calendar = Calendar()
    reference = Scheduler()
    reference.add_cron("ref", expression, lambda tick: None, time_zone=zone, exclusive=False)
    day = datetime(2026, 3, 29, 0, 0, tzinfo=UTC)
    for hour in range(24):
        start = day + timedelta(hours=hour)
        for low, high in (
            (start, start + timedelta(hours=1)),
            (start + timedelta(minutes=17, seconds=3), start + timedelta(minutes=41)),
        ):
            expected = len(reference.expected_ticks("ref", low, high))
            assert calendar.expected("cron", expression, zone, start, low, high) == expected
    assert calendar.expected("cron", "not a cron", "UTC", day, day, day + timedelta(hours=1)) == 0
    assert calendar.next_fire("cron", "not a cron", "UTC") is None


async def test_warm_fills_every_hour_once_and_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import sdcore.dashboard._calendar as calendar_module

    calendar = Calendar()
    day = datetime(2026, 3, 29, 0, 0, tzinfo=UTC)
    starts = [day + timedelta(hours=h) for h in range(24)]
    pairs = [("*/1 * * * *", "UTC"), ("30 2 * * *", "Europe/Paris"), ("nonsense", "UTC")]
    assert await calendar.warm(pairs, starts) == 72
    assert await calendar.warm(pairs, starts) == 0  # cached: nothing computed again

    def no_walk(*args: object) -> list[datetime]:
        raise AssertionError("a warmed hour walked the calendar again")

    monkeypatch.setattr(calendar._scheduler, "expected_ticks", no_walk)
    quarter = day + timedelta(minutes=15)
    assert calendar.expected("cron", "*/1 * * * *", "UTC", day, day, day + BUCKET) == 60
    assert calendar.expected("cron", "*/1 * * * *", "UTC", day, quarter, day + BUCKET) == 45
    monkeypatch.undo()
    monkeypatch.setattr(calendar_module, "WARM_PAIRS", 2)
    many = [(f"{m} * * * *", "UTC") for m in range(5)]
    assert await Calendar().warm(many, starts[:3]) == 6


def test_next_fire_is_after_now() -> None:
    calendar = Calendar()
    now = datetime.now(UTC)
    fire = calendar.next_fire("cron", "*/5 * * * * *", "UTC")
    assert fire is not None
    assert now < fire <= now + timedelta(seconds=5)
    interval = calendar.next_fire("interval", "60000", "UTC")
    assert interval is not None
    assert interval.second == 0
    assert interval.microsecond == 0
    assert calendar.next_fire("timeout", "100", "UTC") is None


def test_a_bucket_counts_failed_ticks_as_missed() -> None:
    start = datetime(2026, 12, 1, 8, tzinfo=UTC)
    bucket = Bucket(start=start, expected=60, ok=55, running=1, failed=2, label="08:00")
    assert bucket.missed == 4
    strip = timeline([bucket] * 24)
    assert strip.count("<rect") == 24
    assert 'class="miss"' in strip
    assert "08:00 UTC: 60 expected, 55 succeeded, 1 running, 2 failed, 4 missed" in strip
    assert "—" in timeline([])


def test_ages_are_short() -> None:
    assert age(timedelta(milliseconds=850)) == "850 ms"
    assert age(timedelta(seconds=12)) == "12 s"
    assert age(timedelta(minutes=4)) == "4 min"
    assert age(timedelta(hours=3)) == "3 h"
    assert age(timedelta(days=2)) == "2 d"
    assert age(None) == "—"
