"""Alerting against real PostgreSQL and a real HTTP server on a loopback port.

The decisions (one alert per incident, one ``resolved`` per alert) are raced on separate pools;
the runtime tests run real ticks whose alerts go through the alerts outbox and relay to the
webhook, and whose check-ins reach the Sentry and Healthchecks endpoints, all served by
:mod:`tests._http_sink`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.alerting import (
    Alerting,
    AlertKind,
    HealthchecksSink,
    SentryCronsSink,
    WebhookSink,
    verify_webhook,
)
from sdcore.alerting._incidents import IncidentLog, Problem
from sdcore.runtime import Runtime
from sdcore.scheduling import Tick
from tests._http_sink import HttpRecorder, http_recorder
from tests._servers import free_port

SECRET = "integration-secret-0123"


def _problem(kind: AlertKind, run_key: str, schedule: str = "nightly") -> Problem:
    return Problem(
        kind=kind, schedule=schedule, run_key=run_key, scheduled_at=None, attempt=1, reason="t"
    )


async def test_racing_replicas_decide_one_alert_per_incident_and_one_resolved(
    pg_dsn: str,
) -> None:
    alerting = Alerting(
        [
            WebhookSink("http://127.0.0.1:9/x", secret=SECRET, name="a"),
            WebhookSink("http://127.0.0.1:9/y", secret=SECRET, name="b"),
        ]
    )
    pools = [AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False) for _ in range(3)]
    for pool in pools:
        await pool.open()
    try:
        await alerting.outbox.ensure_schema(pools[0])
        log = logging.getLogger("test.alerting")
        logs = [IncidentLog(pool, alerting.outbox, ["a", "b"], log) for pool in pools]

        async def race(call: Callable[[IncidentLog], Awaitable[Any]]) -> int:
            results = await asyncio.gather(*(call(one) for one in logs))
            return sum(result is not None for result in results)

        missed = _problem(AlertKind.MISSED, "k1")
        assert await race(lambda one: one.open(missed)) == 1
        # Another problem of the schedule while the incident is open: part of it.
        assert await race(lambda one: one.open(_problem(AlertKind.FAILED, "k2"))) == 0
        # Another schedule has incidents of its own (its name extends this one's).
        assert await race(lambda one: one.open(_problem(AlertKind.MISSED, "k1", "nightly2"))) == 1
        assert await race(lambda one: one.resolve("nightly", "k3", None, 1)) == 1
        assert await race(lambda one: one.resolve("nightly", "k4", None, 1)) == 0
        # The same incident again (a late replica, a rescan): alerted once already.
        assert await race(lambda one: one.open(missed)) == 0
        assert await race(lambda one: one.open(_problem(AlertKind.FAILED, "k5"))) == 1
        async with pools[0].connection() as conn:
            rows = await (
                await conn.execute("SELECT queue, name, payload FROM sdcore_alerts ORDER BY id")
            ).fetchall()
    finally:
        for pool in pools:
            await pool.close()
    kinds = Counter((queue, name) for queue, name, _ in rows)
    assert kinds == Counter(
        {
            ("a", "missed"): 2,
            ("b", "missed"): 2,
            ("a", "resolved"): 1,
            ("b", "resolved"): 1,
            ("a", "failed"): 1,
            ("b", "failed"): 1,
        }
    )
    resolved = next(payload for _, name, payload in rows if name == "resolved")
    assert resolved["incident"] == {"kind": "missed", "run_key": "k1"}
    assert resolved["run_key"] == "k3"


@asynccontextmanager
async def _running(
    dsn: str, alerting: Alerting, declare: Callable[[Runtime], None]
) -> AsyncIterator[Runtime]:
    runtime = Runtime(dsn, alerting=alerting, control=None, grace_period_ms=2_000)
    declare(runtime)
    async with runtime:
        yield runtime


async def _until(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _hooks(recorder: HttpRecorder) -> list[dict[str, Any]]:
    found = []
    for request in recorder.ok("/hook"):
        verify_webhook(SECRET, request.body, request.headers)
        found.append(request.json())
    return found


def _alerting(recorder: HttpRecorder, **options: Any) -> Alerting:
    return Alerting(
        [WebhookSink(f"{recorder.url}/hook", secret=SECRET)],
        poll_interval_ms=50,
        retry_base_ms=100,
        **options,
    )


async def test_a_failed_tick_alerts_through_a_flaky_webhook_and_a_success_resolves(
    pg_dsn: str,
) -> None:
    calls = Counter[str]()

    def declare(runtime: Runtime) -> None:
        @runtime.scheduler.interval(500, name="flaky")
        async def flaky(tick: Tick) -> None:
            calls["runs"] += 1
            if calls["runs"] <= 2:
                raise RuntimeError("boom")

    with http_recorder() as recorder:
        recorder.fail_next.extend([500, 503])  # the receiver is down for two deliveries
        async with _running(pg_dsn, _alerting(recorder, scan_interval_ms=None), declare):
            await _until(lambda: Counter(a["kind"] for a in _hooks(recorder))["resolved"] == 1)
            await asyncio.sleep(0.5)  # room for a duplicate
        hooks = _hooks(recorder)
        attempts = [r for r in recorder.received if r.path == "/hook"]
    assert [a["kind"] for a in hooks] == ["failed", "resolved"]
    failed, resolved = hooks
    assert failed["attempt"] == 1
    assert failed["schedule"] == "flaky"
    assert resolved["incident"] == {"kind": "failed", "run_key": failed["run_key"]}
    # Two refused deliveries, then the same alert (same id and body) delivered.
    assert [r.status for r in attempts[:3]] == [500, 503, 200]
    assert len({r.json()["id"] for r in attempts[:3]}) == 1
    with psycopg.connect(pg_dsn) as conn:
        statuses = conn.execute("SELECT status, attempts FROM sdcore_alerts ORDER BY id").fetchall()
    assert statuses == [("PUBLISHED", 3), ("PUBLISHED", 1)]


@pytest.mark.parametrize("plain", [False, True], ids=["async-handler", "plain-def-handler"])
async def test_an_overrun_alerts_while_the_run_goes_on_and_its_end_resolves(
    pg_dsn: str, plain: bool
) -> None:
    ran = Counter[str]()

    def declare(runtime: Runtime) -> None:
        if plain:  # started in a worker thread: its start reaches alerting from there

            @runtime.scheduler.interval(5_000, name="slow", max_runtime_ms=200)
            def slow_plain(tick: Tick) -> None:
                ran["started"] += 1
                time.sleep(1.0)
                ran["ended"] += 1

            return

        @runtime.scheduler.interval(5_000, name="slow", max_runtime_ms=200)
        async def slow(tick: Tick) -> None:
            ran["started"] += 1
            await asyncio.sleep(1.0)
            ran["ended"] += 1

    with http_recorder() as recorder:
        async with _running(pg_dsn, _alerting(recorder, scan_interval_ms=None), declare):
            await _until(lambda: [a["kind"] for a in _hooks(recorder)] == ["overrun"])
            assert ran["ended"] == 0  # alerted mid-run
            await _until(lambda: len(_hooks(recorder)) == 2)
        overrun, resolved = _hooks(recorder)
    assert "200 ms" in overrun["reason"]
    assert resolved["kind"] == "resolved"
    assert resolved["incident"] == {"kind": "overrun", "run_key": overrun["run_key"]}


async def test_check_ins_reach_sentry_and_healthchecks_for_every_attempt(pg_dsn: str) -> None:
    runs = Counter[str]()

    def declare(runtime: Runtime) -> None:
        @runtime.scheduler.interval(500, name="beat")
        async def beat(tick: Tick) -> None:
            runs["n"] += 1
            if runs["n"] == 1:
                raise RuntimeError("first fails")

    with http_recorder() as recorder:
        host = recorder.url.removeprefix("http://")
        alerting = Alerting(
            [
                SentryCronsSink(f"http://pub@{host}/7", environment="test"),
                HealthchecksSink({"beat": f"{recorder.url}/hc/beat-uuid"}),
            ],
            scan_interval_ms=None,
        )
        async with _running(pg_dsn, alerting, declare):
            await _until(lambda: len(recorder.ok("/hc/beat-uuid?")) >= 1)
            await _until(lambda: len(recorder.ok("/api/7/cron/beat/pub/")) >= 4)
        sentry = [r.json() for r in recorder.ok("/api/7/cron/beat/pub/")]
        pings = [r.path.split("?")[0] for r in recorder.ok("/hc/")]
    by_id: dict[str, list[str]] = {}
    for body in sentry:
        by_id.setdefault(body["check_in_id"], []).append(body["status"])
        assert body["environment"] == "test"
    assert sorted(sorted(s) for s in by_id.values())[:2] == [
        ["error", "in_progress"],
        ["in_progress", "ok"],
    ]
    assert pings[:4] == [
        "/hc/beat-uuid/start",
        "/hc/beat-uuid/fail",
        "/hc/beat-uuid/start",
        "/hc/beat-uuid",
    ] or sorted(pings[:4]) == sorted(
        ["/hc/beat-uuid/start", "/hc/beat-uuid/fail", "/hc/beat-uuid/start", "/hc/beat-uuid"]
    )


async def test_the_scan_alerts_a_tick_nobody_ran_without_catch_up(pg_dsn: str) -> None:
    ran: list[str] = []

    def declare(runtime: Runtime) -> None:
        @runtime.scheduler.interval(1_000, name="gap")
        async def gap(tick: Tick) -> None:
            assert tick.run_key is not None
            ran.append(tick.run_key)

    with http_recorder() as recorder:
        options = {"missed_after_ms": 1_000, "scan_interval_ms": 200}
        async with _running(pg_dsn, _alerting(recorder, **options), declare):
            await _until(lambda: len(ran) >= 1)
        await asyncio.sleep(2.5)  # every replica down: ticks nobody runs
        before = set(ran)
        async with _running(pg_dsn, _alerting(recorder, **options), declare):
            await _until(lambda: [a["kind"] for a in _hooks(recorder)] == ["missed", "resolved"])
            await asyncio.sleep(0.6)  # later scans: nothing more
        hooks = _hooks(recorder)
    assert [a["kind"] for a in hooks] == ["missed", "resolved"]
    missed = hooks[0]
    assert missed["run_key"] not in ran  # nobody ran it
    assert missed["run_key"] > max(before)
    assert missed["attempt"] == 0
    assert hooks[1]["incident"] == {"kind": "missed", "run_key": missed["run_key"]}


async def test_an_outage_caught_up_tick_by_tick_is_one_incident(pg_dsn: str) -> None:
    ran: list[str] = []

    def declare(runtime: Runtime) -> None:
        @runtime.scheduler.interval(500, name="gap", catch_up="all")
        async def gap(tick: Tick) -> None:
            assert tick.run_key is not None
            ran.append(tick.run_key)
            await asyncio.sleep(0.2)  # the caught-up ticks run one after the other

    with http_recorder() as recorder:
        options = {"missed_after_ms": 1_000, "scan_interval_ms": 200}
        async with _running(pg_dsn, _alerting(recorder, **options), declare):
            await _until(lambda: len(ran) >= 1)
        last_before = max(map(_instant, ran))
        await asyncio.sleep(2.0)  # every replica down: three or four ticks nobody runs
        restart = datetime.now(UTC)
        async with _running(pg_dsn, _alerting(recorder, **options), declare):
            await _until(lambda: [a["kind"] for a in _hooks(recorder)] == ["missed", "resolved"])
            await asyncio.sleep(1.5)  # later scans: nothing more
        hooks = _hooks(recorder)
    # Compared as instants: a run key of a sub-second interval carries milliseconds.
    late = [key for key in ran if last_before < _instant(key) < restart]
    assert len(late) >= 3, ran  # caught up one after the other
    assert [a["kind"] for a in hooks] == ["missed", "resolved"]
    missed, resolved = hooks
    assert missed["run_key"] == late[0]
    assert _instant(resolved["run_key"]) >= restart  # the first on time, after the late ones


def _instant(run_key: str) -> datetime:
    return datetime.fromisoformat(run_key.replace("Z", "+00:00"))


@pytest.mark.parametrize("outage_s", [0.0])
async def test_no_alert_while_everything_runs(pg_dsn: str, outage_s: float) -> None:
    def declare(runtime: Runtime) -> None:
        @runtime.scheduler.interval(300, name="fine", max_runtime_ms=5_000)
        async def fine(tick: Tick) -> None:
            await asyncio.sleep(outage_s)

    with http_recorder() as recorder:
        options = {"missed_after_ms": 1_000, "scan_interval_ms": 100}
        async with _running(pg_dsn, _alerting(recorder, **options), declare):
            # The scan judges a tick 3 s after its instant (missed_after plus the last owner's
            # turn): 5 s leave it two seconds of ticks to judge.
            await asyncio.sleep(5.0)
        assert _hooks(recorder) == []


async def test_an_alert_decided_by_a_replica_that_dies_is_delivered_by_another(
    pg_dsn: str,
) -> None:
    with http_recorder() as recorder:
        # The deciding replica runs no relay (as if killed right after its decision committed).
        decider = _alerting(recorder)
        pool = AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False)
        await pool.open()
        try:
            await decider.outbox.ensure_schema(pool)
            log = IncidentLog(pool, decider.outbox, ["webhook"], logging.getLogger("t"))
            assert await log.open(_problem(AlertKind.FAILED, "k1")) is not None
            assert recorder.received == []
            other = _alerting(recorder, scan_interval_ms=None)
            runtime = Runtime(pg_dsn, alerting=other, control=None, scheduling=None)
            async with runtime:
                await _until(lambda: len(_hooks(recorder)) == 1)
        finally:
            await pool.close()
        (alert,) = _hooks(recorder)
    assert (alert["kind"], alert["run_key"]) == ("failed", "k1")


def test_a_runtime_refuses_an_alerting_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="alerting must be an Alerting"):
        Runtime("postgresql://127.0.0.1:1/x", alerting="webhook")  # type: ignore[arg-type]


async def test_a_webhook_down_for_a_while_gets_the_alert_once_it_is_back(pg_dsn: str) -> None:
    port = free_port()
    alerting = Alerting(
        [WebhookSink(f"http://127.0.0.1:{port}/hook", secret=SECRET)],
        poll_interval_ms=50,
        retry_base_ms=50,
        max_attempts=2,
        scan_interval_ms=None,
    )
    runtime = Runtime(pg_dsn, alerting=alerting, control=None, scheduling=None)
    async with runtime:
        log = IncidentLog(runtime.pool, alerting.outbox, ["webhook"], logging.getLogger("t"))
        assert await log.open(_problem(AlertKind.MISSED, "k1")) is not None
        await asyncio.sleep(1.5)  # nobody listens: the relay backs off, counting no attempt
        async with runtime.pool.connection() as conn:
            row = await (
                await conn.execute("SELECT status, attempts FROM sdcore_alerts")
            ).fetchone()
        assert row == ("PENDING", 0)
        with http_recorder(port) as recorder:
            await _until(lambda: len(_hooks(recorder)) == 1, timeout_s=40)
            (alert,) = _hooks(recorder)
    assert (alert["kind"], alert["run_key"]) == ("missed", "k1")
