"""Alerting without sockets: signatures, payloads, sink requests, keys, options and the observer."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sdcore._internal.telemetry import FAILURE, SUCCESS, RunScope, Telemetry
from sdcore.alerting import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    Alert,
    Alerting,
    AlertKind,
    CheckIn,
    CheckInStatus,
    HealthchecksSink,
    InvalidAlertingConfigError,
    SentryCronsSink,
    WebhookSignatureError,
    WebhookSink,
    sign_webhook,
    verify_webhook,
)
from sdcore.alerting._model import check_in_id, incident_key, parse_key
from sdcore.alerting._observer import AlertObserver, Finished, Started
from sdcore.alerting._scan import MissedScan
from sdcore.scheduling import InvalidScheduleError, Scheduler, Tick
from sdcore.scheduling._control import policy_options
from sdcore.scheduling._policy import build_policy
from sdcore.testing import MemoryJobScheduler

SECRET = "0123456789abcdef-secret"
NOW = 1_765_000_000.0


# --- webhook signatures ------------------------------------------------------------------------


def _signed(body: bytes = b'{"kind":"missed"}', at: float = NOW) -> dict[str, str]:
    request = WebhookSink("https://hooks.example/x", secret=SECRET).request(
        json.loads(body), now=at
    )
    return request.headers


def test_a_signed_webhook_verifies_and_its_signature_covers_timestamp_and_body() -> None:
    sink = WebhookSink("https://hooks.example/x", secret=SECRET, headers={"X-Team": "ops"})
    request = sink.request({"b": 1, "a": "é"}, now=NOW)
    assert request.method == "POST"
    assert request.url == "https://hooks.example/x"
    assert request.body == b'{"a":"\\u00e9","b":1}'  # compact, sorted: stable across retries
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["X-Team"] == "ops"
    assert request.headers[TIMESTAMP_HEADER] == str(int(NOW))
    assert request.headers[SIGNATURE_HEADER] == sign_webhook(SECRET, int(NOW), request.body)
    verify_webhook(SECRET, request.body, request.headers, now=NOW + 10)
    # Header names in any case (proxies lowercase them).
    lower = {k.lower(): v for k, v in request.headers.items()}
    verify_webhook(SECRET.encode(), request.body, lower, now=NOW)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b, h: (b + b" ", h), "mismatch"),
        (lambda b, h: (b, {**h, TIMESTAMP_HEADER: str(int(NOW) + 1)}), "mismatch"),
        (lambda b, h: (b, {k: v for k, v in h.items() if k != SIGNATURE_HEADER}), "missing"),
        (lambda b, h: (b, {**h, TIMESTAMP_HEADER: "12.5"}), "malformed"),
        (lambda b, h: (b, {**h, SIGNATURE_HEADER: "v1=00"}), "mismatch"),
    ],
    ids=["body", "timestamp-replaced", "no-signature", "bad-timestamp", "forged"],
)
def test_a_tampered_webhook_is_rejected(mutate: Any, reason: str) -> None:
    body = b'{"kind":"missed"}'
    tampered_body, tampered = mutate(body, _signed(body))
    with pytest.raises(WebhookSignatureError) as caught:
        verify_webhook(SECRET, tampered_body, tampered, now=NOW)
    assert caught.value.reason == reason


def test_a_replayed_webhook_is_rejected_after_the_tolerance() -> None:
    body = b'{"kind":"missed"}'
    headers = _signed(body)
    verify_webhook(SECRET, body, headers, now=NOW + 299)
    with pytest.raises(WebhookSignatureError, match="expired"):
        verify_webhook(SECRET, body, headers, now=NOW + 301)
    with pytest.raises(WebhookSignatureError, match="expired"):
        verify_webhook(SECRET, body, headers, now=NOW - 400)  # from the future
    with pytest.raises(WebhookSignatureError, match="mismatch"):
        verify_webhook("another-secret-of-16", body, headers, now=NOW)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"url": "ftp://x/y"}, "url"),
        ({"url": ""}, "url"),
        ({"secret": "short"}, "secret"),
        ({"name": "has space"}, "name"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"headers": {"X-A": "a\nb"}}, "headers"),
    ],
    ids=["scheme", "empty-url", "short-secret", "name", "timeout", "bool-timeout", "header"],
)
def test_a_bad_webhook_sink_is_refused_naming_the_option(
    kwargs: dict[str, Any], field: str
) -> None:
    options: dict[str, Any] = {"url": "https://hooks.example/x", "secret": SECRET, **kwargs}
    url = options.pop("url")
    with pytest.raises(InvalidAlertingConfigError) as caught:
        WebhookSink(url, **options)
    assert caught.value.field == field


def test_the_secret_never_shows_in_a_sinks_repr() -> None:
    sink = WebhookSink("https://hooks.example/x", secret=SECRET)
    assert SECRET not in repr(sink)
    sentry = SentryCronsSink("https://publickey123@o1.ingest.sentry.io/42")
    assert "publickey123" not in repr(sentry)


# --- alerts and keys ---------------------------------------------------------------------------


def test_an_alerts_payload_is_json_with_utc_instants() -> None:
    at = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)
    alert = Alert(
        id="abc",
        kind=AlertKind.RESOLVED,
        schedule="nightly",
        run_key="2026-12-06T10:01:00Z",
        scheduled_at=at,
        detected_at=at,
        attempt=1,
        reason="ok again",
        incident_kind=AlertKind.FAILED,
        incident_run_key="2026-12-06T10:00:00Z",
    )
    payload = alert.payload()
    assert json.loads(json.dumps(payload)) == payload
    assert payload["scheduled_at"] == "2026-12-06T10:00:00Z"
    assert payload["incident"] == {"kind": "failed", "run_key": "2026-12-06T10:00:00Z"}
    assert "incident" not in Alert(**{**_fields(alert), "incident_kind": None}).payload()


def _fields(alert: Alert) -> dict[str, Any]:
    return {name: getattr(alert, name) for name in alert.__dataclass_fields__}


@pytest.mark.parametrize("schedule", ["nightly", "a|b", "x|missed|y", "é 1"])
def test_an_incident_key_names_its_schedule_kind_and_run_key(schedule: str) -> None:
    key = incident_key(schedule, AlertKind.MISSED, "2026-01-01T00:00:00Z", "hook.1")
    assert parse_key(schedule, key) == (AlertKind.MISSED, "2026-01-01T00:00:00Z")
    # Another schedule whose name is a prefix of this one never claims the key.
    assert parse_key(schedule[:-1] or "z", key) is None
    assert parse_key(schedule, key.replace("|missed|", "|bogus|")) is None


def test_a_check_in_id_is_a_uuid_per_attempt_the_same_everywhere() -> None:
    one = check_in_id("nightly", "k", 1)
    assert uuid.UUID(one).version == 5
    assert one == check_in_id("nightly", "k", 1)
    assert len({one, check_in_id("nightly", "k", 2), check_in_id("nightly", "j", 1)}) == 3


# --- check-in sinks ----------------------------------------------------------------------------


def _check_in(status: CheckInStatus, **changes: Any) -> CheckIn:
    fields: dict[str, Any] = {
        "schedule": "Nightly Report",
        "run_key": "2026-12-06T01:00:00Z",
        "attempt": 1,
        "status": status,
        "check_in_id": check_in_id("Nightly Report", "2026-12-06T01:00:00Z", 1),
        "duration_s": None if status is CheckInStatus.STARTED else 1.23456,
        "kind": "cron",
        "expression": "0 1 * * *",
        "time_zone": "Europe/Paris",
        "max_runtime_ms": 90_001,
    }
    return CheckIn(**{**fields, **changes})


def test_healthchecks_pings_start_success_and_fail_with_the_run_id() -> None:
    sink = HealthchecksSink(
        {"Nightly Report": "https://hc-ping.com/uuid-1/"}, ping_key_url="https://hc-ping.com/pk"
    )
    cid = check_in_id("Nightly Report", "2026-12-06T01:00:00Z", 1)
    urls = [sink.requests(_check_in(s))[0].url for s in CheckInStatus]
    assert urls == [
        f"https://hc-ping.com/uuid-1/start?rid={cid}",
        f"https://hc-ping.com/uuid-1?rid={cid}",
        f"https://hc-ping.com/uuid-1/fail?rid={cid}",
    ]
    failed = sink.requests(_check_in(CheckInStatus.FAILED))[0]
    assert failed.method == "POST"
    assert b"failed after 1.235 s" in failed.body


def test_healthchecks_slug_urls_and_unwatched_schedules() -> None:
    slugs = HealthchecksSink(ping_key_url="https://hc-ping.com/pk/", create=True)
    url = slugs.requests(_check_in(CheckInStatus.STARTED))[0].url
    assert url.startswith("https://hc-ping.com/pk/Nightly%20Report/start?rid=")
    assert url.endswith("&create=1")
    only = HealthchecksSink({"other": "https://hc.example/p/1"})
    assert only.requests(_check_in(CheckInStatus.STARTED)) == []
    with pytest.raises(InvalidAlertingConfigError, match="urls or ping_key_url"):
        HealthchecksSink()
    with pytest.raises(InvalidAlertingConfigError, match=r"urls\['x'\]"):
        HealthchecksSink({"x": "not a url"})


def test_sentry_check_ins_follow_the_http_api_with_a_monitor_config() -> None:
    sink = SentryCronsSink(
        "https://pk@o7.ingest.sentry.io:8443/prefix/42", environment="prod", checkin_margin_min=2
    )
    started = sink.requests(_check_in(CheckInStatus.STARTED))[0]
    assert started.url == "https://o7.ingest.sentry.io:8443/prefix/api/42/cron/nightly-report/pk/"
    body = json.loads(started.body)
    assert body == {
        "check_in_id": check_in_id("Nightly Report", "2026-12-06T01:00:00Z", 1),
        "status": "in_progress",
        "environment": "prod",
        "monitor_config": {
            "schedule": {"type": "crontab", "value": "0 1 * * *"},
            "checkin_margin": 2,
            "timezone": "Europe/Paris",
            "max_runtime": 2,  # 90,001 ms: rounded up to whole minutes
        },
    }
    ok = json.loads(sink.requests(_check_in(CheckInStatus.SUCCEEDED))[0].body)
    assert (ok["status"], ok["duration"]) == ("ok", 1.235)
    error = json.loads(sink.requests(_check_in(CheckInStatus.FAILED))[0].body)
    assert error["status"] == "error"


@pytest.mark.parametrize(
    ("kind", "expression", "schedule"),
    [
        ("interval", "60000", {"type": "interval", "value": 1, "unit": "minute"}),
        ("interval", "5400000", {"type": "interval", "value": 90, "unit": "minute"}),
        ("interval", "7200000", {"type": "interval", "value": 2, "unit": "hour"}),
        ("interval", "1209600000", {"type": "interval", "value": 2, "unit": "week"}),
        ("interval", "1500", None),
        ("cron", "*/5 * * * * *", None),
        ("timeout", "", None),
    ],
    ids=["minute", "90-minutes", "hours", "weeks", "sub-minute", "cron-seconds", "timeout"],
)
def test_sentrys_monitor_schedule_from_the_schedule(
    kind: str, expression: str, schedule: dict[str, Any] | None
) -> None:
    sink = SentryCronsSink("https://pk@sentry.example/1")
    config = sink.monitor_config(_check_in(CheckInStatus.STARTED, kind=kind, expression=expression))
    assert (None if config is None else config["schedule"]) == schedule
    body = json.loads(
        sink.requests(_check_in(CheckInStatus.STARTED, kind=kind, expression=expression))[0].body
    )
    assert ("monitor_config" in body) == (schedule is not None)


def test_sentry_slugs_and_bad_dsns() -> None:
    sink = SentryCronsSink("https://pk@sentry.example/1", monitor_slugs={"a": "custom-a"})
    assert sink.slug_of("a") == "custom-a"
    assert sink.slug_of("Billing: Nightly/EU") == "billing-nightly-eu"
    assert sink.slug_of("!!!") == "schedule"
    assert len(sink.slug_of("x" * 80)) == 50
    for dsn in ("https://sentry.example/1", "https://pk@sentry.example/project", "pk@host/1"):
        with pytest.raises(InvalidAlertingConfigError, match="dsn"):
            SentryCronsSink(dsn)
    with pytest.raises(InvalidAlertingConfigError, match="monitor_slugs"):
        SentryCronsSink("https://pk@sentry.example/1", monitor_slugs={"a": "Has Caps"})
    with pytest.raises(InvalidAlertingConfigError, match="checkin_margin_min"):
        SentryCronsSink("https://pk@sentry.example/1", checkin_margin_min=0)
    no_upsert = SentryCronsSink("https://pk@sentry.example/1", upsert=False)
    assert "monitor_config" not in json.loads(
        no_upsert.requests(_check_in(CheckInStatus.STARTED))[0].body
    )


# --- the Alerting options ----------------------------------------------------------------------


def test_alerting_refuses_bad_sinks_and_options() -> None:
    hook = WebhookSink("https://hooks.example/x", secret=SECRET)
    with pytest.raises(InvalidAlertingConfigError, match="at least one sink"):
        Alerting([])
    with pytest.raises(InvalidAlertingConfigError, match="unique"):
        Alerting([hook, WebhookSink("https://hooks.example/y", secret=SECRET)])
    with pytest.raises(InvalidAlertingConfigError, match="neither"):
        Alerting([hook, object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="missed_after_ms"):
        Alerting([hook], missed_after_ms=10)
    with pytest.raises(TypeError, match="scan_interval_ms"):
        Alerting([hook], scan_interval_ms=1.5)  # type: ignore[arg-type]
    alerting = Alerting([hook, HealthchecksSink(ping_key_url="https://hc.example/pk")])
    assert list(alerting.webhooks) == ["webhook"]
    assert len(alerting.check_ins) == 1
    assert alerting.outbox.table == "sdcore_alerts"
    assert not alerting.started


# --- max_runtime_ms ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -5, 1.5, "100", True, 2**31])
def test_max_runtime_ms_must_be_a_positive_int(value: object) -> None:
    scheduler = Scheduler()
    with pytest.raises(InvalidScheduleError, match=r"schedule 'x': max_runtime_ms must be an int"):
        scheduler.add_interval("x", 1000, lambda t: None, max_runtime_ms=value)  # type: ignore[arg-type]


def test_max_runtime_ms_reaches_the_info_and_the_recorded_options_only_when_set() -> None:
    scheduler = Scheduler()

    @scheduler.cron("0 1 * * *", name="nightly", max_runtime_ms=60_000)
    def nightly(tick: object) -> None: ...

    info = scheduler.get("nightly")
    assert (info.max_runtime_ms, info.expression, info.retries) == (60_000, "0 1 * * *", 0)
    set_ = build_policy("a", {"max_runtime_ms": 5}, has_jobs=True, default_lease_ms=1000)
    unset = build_policy("a", {}, has_jobs=True, default_lease_ms=1000)
    assert policy_options(set_)["max_runtime_ms"] == 5
    # Without it, the recorded options (and so the definition's fingerprint) are unchanged.
    assert "max_runtime_ms" not in policy_options(unset)


# --- the observer ------------------------------------------------------------------------------


class _Tick:
    def __init__(self, attempt: int = 1) -> None:
        self.run_key = "2026-12-06T01:00:00Z"
        self.scheduled_at = datetime(2026, 12, 6, 1, tzinfo=UTC)
        self.attempt = attempt
        self.lease = None


def test_the_observer_reports_starts_and_ends_with_their_path() -> None:
    posted: list[Started | Finished] = []
    hub = Telemetry([AlertObserver(posted.append)])
    run = hub.tick_scope("nightly")
    assert isinstance(run, RunScope)
    run.path = "sweep"
    hub.tick_started(run, _Tick(attempt=2))
    hub.tick_finished(run, SUCCESS)
    started, finished = posted
    assert isinstance(started, Started)
    assert isinstance(finished, Finished)
    assert (started.path, started.attempt, started.run_key) == ("sweep", 2, "2026-12-06T01:00:00Z")
    assert finished.token == started.token
    assert finished.outcome == SUCCESS
    assert not finished.cancelled


async def test_a_run_ended_by_a_cancellation_is_reported_as_cancelled() -> None:
    posted: list[Started | Finished] = []
    hub = Telemetry([AlertObserver(posted.append)])
    run = hub.tick_scope("nightly")

    async def tick() -> None:
        hub.tick_started(run, _Tick())
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            hub.tick_finished(run, FAILURE)
            raise

    task = asyncio.create_task(tick())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    finished = posted[-1]
    assert isinstance(finished, Finished)
    assert finished.cancelled


async def test_a_stored_schedule_refuses_a_bad_max_runtime_ms() -> None:
    from sdcore.scheduling import ScheduleAdmin
    from sdcore.testing import MemoryScheduleStore

    admin = ScheduleAdmin(MemoryScheduleStore())
    with pytest.raises(InvalidScheduleError, match="max_runtime_ms must be an int from 1"):
        await admin.create(
            "report", handler="report", every_ms=60_000, options={"max_runtime_ms": 0}, actor="t"
        )


class _History:
    """The control plane's run history, as ``Alerting`` reads it (``history`` only)."""

    def __init__(self, runs: list[Any]) -> None:
        self.runs = runs

    async def history(self, name: str, limit: int) -> list[Any]:
        return [run for run in self.runs if run.schedule == name][:limit]


def _run(attempt: int, status: str, error: str | None = None) -> Any:
    from sdcore.scheduling import RunRecord

    at = datetime(2026, 12, 6, 1, tzinfo=UTC)
    return RunRecord(
        schedule="nightly",
        run_key="2026-12-06T01:00:00Z",
        source="tick",
        scheduled_at=at,
        started_at=at,
        finished_at=None if status == "RUNNING" else at,
        status=status,
        attempt=attempt,
        fencing_token=attempt,
        host="h",
        pid=1,
        error=error,
    )


def _started(attempt: int, path: str = "fire") -> Started:
    return Started(
        token=1,
        schedule="nightly",
        run_key="2026-12-06T01:00:00Z",
        scheduled_at=datetime(2026, 12, 6, 1, tzinfo=UTC),
        attempt=attempt,
        path=path,
        at=0.0,
    )


@pytest.mark.parametrize(
    ("path", "attempt", "retries", "history", "missed"),
    [
        ("fire", 1, 0, [], False),
        ("catch_up", 1, 0, [], True),
        ("sweep", 2, 3, [], True),
        ("fire", 2, 0, [], True),  # past the budget: only a takeover runs it
        ("fire", 2, 2, [_run(1, "FAIL", "RuntimeError: boom")], False),  # a retry
        ("fire", 2, 2, [_run(1, "FAIL", "abandoned: the tick was taken over (fencing 2)")], True),
        ("fire", 3, 2, [_run(2, "RUNNING"), _run(1, "FAIL", "boom")], True),
        ("fire", 2, 2, None, False),  # no history: within the budget, taken for a retry
        ("trigger", 1, 0, [], False),
    ],
    ids=[
        "on-time",
        "catch-up",
        "sweep",
        "past-budget",
        "retry",
        "abandoned",
        "still-running",
        "no-history",
        "trigger",
    ],
)
async def test_a_late_start_is_told_from_a_retry(
    path: str, attempt: int, retries: int, history: list[Any] | None, missed: bool
) -> None:
    scheduler = Scheduler()
    scheduler.add_cron("nightly", "0 1 * * *", lambda t: None, exclusive=False)
    alerting = Alerting([WebhookSink("https://hooks.example/x", secret=SECRET)])
    alerting._scheduler = scheduler
    alerting._history = None if history is None else _History(history)  # type: ignore[assignment]
    info = scheduler.get("nightly")
    info = type(info)(
        **{**{f: getattr(info, f) for f in info.__dataclass_fields__}, "retries": retries}
    )
    reason = await alerting._late(_started(attempt, path), info)
    assert (reason is not None) == missed, reason


class _SeenAt(MemoryJobScheduler):
    """A lease table whose schedule was first seen at ``first`` and holds no row since."""

    def __init__(self, first: datetime) -> None:
        super().__init__()
        self.first = first

    async def first_seen(self, code: str) -> datetime | None:
        return self.first


async def test_the_scan_leaves_a_tick_to_its_later_owners_before_missed_after_counts() -> None:
    """The third owner of a tick asks up to 2 s after its instant (the first two dead): a tick
    with no row is judged only ``missed_after`` past that, never before it could start."""
    instant = datetime(2026, 12, 7, 8, 0, tzinfo=UTC)
    jobs = _SeenAt(instant - timedelta(seconds=5))
    scheduler = Scheduler(jobs=jobs)

    async def beat(tick: Tick) -> None:
        return None

    scheduler.add_interval("beat", 60_000, beat)
    scan = MissedScan(
        timedelta(seconds=1), timedelta(hours=1), instant - timedelta(hours=1), logging.getLogger()
    )
    at = instant + timedelta(seconds=2.5)  # 1 s past the instant, and the third owner's turn
    assert await scan.missed(scheduler, jobs, at) == []
    (problem,) = await scan.missed(scheduler, jobs, instant + timedelta(seconds=3.5))
    assert (problem.schedule, problem.scheduled_at) == ("beat", instant)
    assert "3000 ms after its instant" in problem.reason
