"""Where alerts and check-ins go: a signed webhook, Sentry Crons and Healthchecks.io ping URLs.

Each sink only *builds* HTTP requests (:class:`HttpRequest`), so what it sends is checked without
a socket; :class:`~sdcore.alerting.Alerting` sends them. Two families:

- incident sinks (:class:`WebhookSink`) receive :class:`~sdcore.alerting.Alert` objects through
  the alerts outbox: written once per incident, delivered at least once, retried with backoff;
- check-in sinks (:class:`SentryCronsSink`, :class:`HealthchecksSink`) are told about every
  attempt of every tick (start, success, failure) straight from the replica that runs it. A
  check-in is about *now*: replayed late it would lie, and the monitor on the other side raises
  its own alarm when a check-in does not come (a missed or timed-out run).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from sdcore.alerting._model import InvalidAlertingConfigError, WebhookSignatureError

__all__ = [
    "DELIVERY_HEADER",
    "EVENT_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "CheckIn",
    "CheckInSink",
    "CheckInStatus",
    "HealthchecksSink",
    "HttpRequest",
    "SentryCronsSink",
    "WebhookSink",
    "sign_webhook",
    "verify_webhook",
]

SIGNATURE_HEADER = "X-Sdcore-Signature"
DELIVERY_HEADER = "X-Sdcore-Delivery"
EVENT_HEADER = "X-Sdcore-Event"
TIMESTAMP_HEADER = "X-Sdcore-Timestamp"
_SINK_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_SENTRY_SLUG = re.compile(r"[^a-z0-9_-]+")
_MINUTE_MS = 60_000
# Sentry's interval units, largest first, in ms (a month or a year has no fixed length).
_SENTRY_UNITS = (("week", 7 * 24 * 3_600_000), ("day", 24 * 3_600_000), ("hour", 3_600_000))


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpRequest:
    """One HTTP request a sink wants sent."""

    method: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def _url(option: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidAlertingConfigError(option, f"must be a non-empty str, got {value!r:.80}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidAlertingConfigError(option, f"must be an http(s) URL, got {value!r:.80}")
    return value


def _sink_name(value: object) -> str:
    if not isinstance(value, str) or not _SINK_NAME.fullmatch(value):
        raise InvalidAlertingConfigError(
            "name", f"use 1-100 characters from [A-Za-z0-9_.-], got {value!r:.80}"
        )
    return value


def _timeout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 300:
        raise InvalidAlertingConfigError(
            "timeout_s", f"must be a number above 0 and at most 300, got {value!r:.40}"
        )
    return float(value)


# --- the webhook -----------------------------------------------------------------------------


def sign_webhook(secret: str | bytes, timestamp: int, body: bytes) -> str:
    """Return the ``X-Sdcore-Signature`` value of ``body`` sent at ``timestamp``.

    ``v1=`` + the hex HMAC-SHA256, keyed with ``secret``, of ``f"{timestamp}."`` followed by the
    body's bytes. The timestamp is signed with the body: a signature over the body alone would
    let whoever captured one delivery replay it later under a fresh timestamp header.
    """
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    mac = hmac.new(key, str(timestamp).encode("ascii") + b"." + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def verify_webhook(
    secret: str | bytes,
    body: bytes,
    headers: Mapping[str, str],
    *,
    tolerance_s: float = 300.0,
    now: float | None = None,
) -> None:
    """Check a received webhook: its signature, and that it was sent within ``tolerance_s``.

    For receivers (a Python service that takes sdcore's alerts). Header names are matched
    without regard to case.

    Args:
        secret: The shared secret the :class:`WebhookSink` was built with.
        body: The request body, exactly as received.
        headers: The request headers.
        tolerance_s: How old (or how far in the future) the timestamp may be.
        now: The receiver's clock (Unix seconds; default ``time.time()``).

    Raises:
        WebhookSignatureError: A header is missing or malformed, the timestamp is outside the
            tolerance (a replay), or the signature does not match.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    stamp = lower.get(TIMESTAMP_HEADER.lower())
    given = lower.get(SIGNATURE_HEADER.lower())
    if stamp is None or given is None:
        raise WebhookSignatureError("missing", f"{TIMESTAMP_HEADER} and {SIGNATURE_HEADER} needed")
    if not stamp.isascii() or not stamp.isdigit():
        raise WebhookSignatureError("malformed", f"{TIMESTAMP_HEADER} is not Unix seconds")
    clock = time.time() if now is None else now
    if abs(clock - int(stamp)) > tolerance_s:
        raise WebhookSignatureError("expired", f"sent {int(clock - int(stamp))} s from now")
    if not hmac.compare_digest(sign_webhook(secret, int(stamp), body), given.strip()):
        raise WebhookSignatureError("mismatch", "the signature does not match the body")


class WebhookSink:
    """POST each alert as JSON to ``url``, signed with ``secret`` (through the alerts outbox).

    Headers: ``Content-Type: application/json``, ``X-Sdcore-Timestamp`` (Unix seconds, fresh on
    each attempt), ``X-Sdcore-Signature`` (:func:`sign_webhook`), plus ``headers``. Any answer
    other than 2xx is a failed attempt, retried by the alerts relay with exponential backoff.

    Args:
        url: Where to POST.
        secret: The shared HMAC secret (at least 16 characters).
        name: The sink's name (its outbox queue; unique per :class:`Alerting`).
        timeout_s: Per request.
        headers: Extra headers (an ``Authorization`` a gateway wants, say).

    Raises:
        InvalidAlertingConfigError: A bad URL, secret, name, timeout or header.
    """

    def __init__(
        self,
        url: str,
        *,
        secret: str | bytes,
        name: str = "webhook",
        timeout_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = _url("url", url)
        if not isinstance(secret, str | bytes) or len(secret) < 16:
            raise InvalidAlertingConfigError(
                "secret", "must be a str or bytes of at least 16 characters"
            )
        self._secret = secret
        self.name = _sink_name(name)
        self.timeout_s = _timeout(timeout_s)
        extra = dict(headers or {})
        for key, value in extra.items():
            if not isinstance(key, str) or not isinstance(value, str) or "\n" in key + value:
                raise InvalidAlertingConfigError("headers", f"bad header {key!r:.40}")
        self.headers = extra

    def __repr__(self) -> str:
        return f"WebhookSink(name={self.name!r}, url={self.url!r})"  # never the secret

    def request(
        self,
        payload: Mapping[str, Any],
        *,
        now: float | None = None,
        delivery: str | None = None,
        event: str | None = None,
    ) -> HttpRequest:
        """The signed POST of one alert's payload (timestamp: ``now``, default the clock;
        ``delivery``: the outbox row's job id, the same on every retry; ``event``: its name)."""
        body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode("utf-8")
        stamp = int(time.time() if now is None else now)
        headers = {
            **self.headers,
            "Content-Type": "application/json",
            TIMESTAMP_HEADER: str(stamp),
            SIGNATURE_HEADER: sign_webhook(self._secret, stamp, body),
        }
        if delivery is not None:
            headers[DELIVERY_HEADER] = delivery
        if event is not None:
            headers[EVENT_HEADER] = event
        return HttpRequest(method="POST", url=self.url, headers=headers, body=body)


# --- check-ins -------------------------------------------------------------------------------


class CheckInStatus(enum.StrEnum):
    """Where an attempt of a tick is."""

    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckIn:
    """One attempt of one tick, as check-in sinks see it.

    Attributes:
        schedule: The schedule's name.
        run_key: The tick's run key.
        attempt: The attempt number.
        status: Started, succeeded or failed.
        check_in_id: A UUID naming the attempt (the same at its start and its end).
        duration_s: For an end: how long the handler ran.
        kind: ``cron``, ``interval``, ``timeout`` or ``initial``.
        expression: The cron expression, or the interval in ms as text.
        time_zone: The schedule's IANA zone.
        max_runtime_ms: The schedule's ``max_runtime_ms`` (``None``: no limit).
    """

    schedule: str
    run_key: str | None
    attempt: int
    status: CheckInStatus
    check_in_id: str
    duration_s: float | None
    kind: str
    expression: str
    time_zone: str
    max_runtime_ms: int | None = None


class CheckInSink(Protocol):
    """A monitor told about every attempt (implement it to add another service)."""

    name: str
    timeout_s: float

    def requests(self, check_in: CheckIn) -> list[HttpRequest]:
        """The requests that report ``check_in`` (empty: this sink does not watch it)."""
        ...


class HealthchecksSink:
    """Ping Healthchecks.io-style URLs: ``/start`` when an attempt starts, the URL itself on
    success, ``/fail`` on failure (with ``rid`` set to the attempt's check-in id, so that
    overlapping runs are told apart).

    Give each schedule's ping URL in ``urls``, or a ``ping_key_url``
    (``https://hc-ping.com/<ping-key>``) to which the schedule's name is appended as the slug
    (``create=True`` asks Healthchecks to create a missing check). A schedule with neither is
    not pinged.

    Args:
        urls: Ping URL by schedule name.
        ping_key_url: The base of slug URLs.
        create: Add ``create=1`` to slug URLs.
        name: The sink's name (for logs).
        timeout_s: Per request.

    Raises:
        InvalidAlertingConfigError: A bad URL, name or timeout, or neither ``urls`` nor
            ``ping_key_url``.
    """

    def __init__(
        self,
        urls: Mapping[str, str] | None = None,
        *,
        ping_key_url: str | None = None,
        create: bool = False,
        name: str = "healthchecks",
        timeout_s: float = 10.0,
    ) -> None:
        self.urls = {k: _url(f"urls[{k!r}]", v).rstrip("/") for k, v in (urls or {}).items()}
        self.ping_key_url = (
            None if ping_key_url is None else _url("ping_key_url", ping_key_url).rstrip("/")
        )
        if not self.urls and self.ping_key_url is None:
            raise InvalidAlertingConfigError("urls", "give urls or ping_key_url")
        self.create = bool(create)
        self.name = _sink_name(name)
        self.timeout_s = _timeout(timeout_s)

    def __repr__(self) -> str:
        return f"HealthchecksSink(name={self.name!r}, schedules={sorted(self.urls)!r})"

    def url_of(self, schedule: str) -> str | None:
        """The ping URL of ``schedule`` (``None``: not pinged)."""
        url = self.urls.get(schedule)
        if url is not None:
            return url
        if self.ping_key_url is None:
            return None
        return f"{self.ping_key_url}/{quote(schedule, safe='')}"

    def requests(self, check_in: CheckIn) -> list[HttpRequest]:
        """One ping for ``check_in`` (none for a schedule without a URL)."""
        base = self.url_of(check_in.schedule)
        if base is None:
            return []
        suffix = {CheckInStatus.STARTED: "/start", CheckInStatus.FAILED: "/fail"}.get(
            check_in.status, ""
        )
        query = f"rid={check_in.check_in_id}"
        if self.create and check_in.schedule not in self.urls:
            query += "&create=1"
        text = f"{check_in.schedule} {check_in.run_key} attempt {check_in.attempt}: "
        text += check_in.status.value
        if check_in.duration_s is not None:
            text += f" after {check_in.duration_s:.3f} s"
        return [
            HttpRequest(
                method="POST",
                url=f"{base}{suffix}?{query}",
                headers={"Content-Type": "text/plain; charset=utf-8"},
                body=text.encode("utf-8"),
            )
        ]


class SentryCronsSink:
    """Send Sentry Crons check-ins over HTTP (no sentry-sdk): ``in_progress`` when an attempt
    starts, ``ok`` or ``error`` (with its duration) when it ends.

    Each check-in carries a ``monitor_config`` built from the schedule (Sentry creates or
    updates the monitor from it): a crontab schedule for cron (5 fields; a cron with seconds
    has none), an interval in minutes, hours, days or weeks for intervals that are whole
    minutes (shorter ones have none: create their monitor in Sentry), the schedule's time zone,
    and ``max_runtime`` from ``max_runtime_ms`` (whole minutes, rounded up).

    Args:
        dsn: The project's DSN (``https://<public_key>@<host>/<project_id>``).
        environment: The check-ins' environment (``None``: Sentry's default).
        monitor_slugs: Monitor slug by schedule name (default: the name, lowercased, runs of
            other characters than ``[a-z0-9_-]`` made ``-``, at most 50 characters).
        checkin_margin_min: Minutes Sentry waits for a late check-in before "missed".
        upsert: Send ``monitor_config`` (``False``: monitors are managed in Sentry).
        name: The sink's name (for logs).
        timeout_s: Per request.

    Raises:
        InvalidAlertingConfigError: A bad DSN, slug, margin, name or timeout.
    """

    def __init__(
        self,
        dsn: str,
        *,
        environment: str | None = None,
        monitor_slugs: Mapping[str, str] | None = None,
        checkin_margin_min: int = 1,
        upsert: bool = True,
        name: str = "sentry",
        timeout_s: float = 10.0,
    ) -> None:
        parts = urlsplit(_url("dsn", dsn))
        project = parts.path.rstrip("/").rpartition("/")
        if not parts.username or not project[2].isdigit():
            raise InvalidAlertingConfigError(
                "dsn", "expected https://<public_key>@<host>/<project_id>"
            )
        netloc = parts.hostname or ""
        if parts.port is not None:
            netloc += f":{parts.port}"
        self._base = f"{parts.scheme}://{netloc}{project[0]}/api/{project[2]}/cron/"
        self._key = parts.username
        self.environment = environment
        slugs = dict(monitor_slugs or {})
        for schedule, slug in slugs.items():
            if not isinstance(slug, str) or not re.fullmatch(r"[a-z0-9_-]{1,50}", slug):
                raise InvalidAlertingConfigError(
                    f"monitor_slugs[{schedule!r}]", "use 1-50 characters from [a-z0-9_-]"
                )
        self.monitor_slugs = slugs
        if isinstance(checkin_margin_min, bool) or not isinstance(checkin_margin_min, int):
            raise InvalidAlertingConfigError("checkin_margin_min", "must be an int")
        if not 1 <= checkin_margin_min <= 40_320:
            raise InvalidAlertingConfigError("checkin_margin_min", "must be from 1 to 40320")
        self.checkin_margin_min = checkin_margin_min
        self.upsert = bool(upsert)
        self.name = _sink_name(name)
        self.timeout_s = _timeout(timeout_s)

    def __repr__(self) -> str:
        return f"SentryCronsSink(name={self.name!r}, base={self._base!r})"  # never the key

    def slug_of(self, schedule: str) -> str:
        """The monitor slug of ``schedule``."""
        given = self.monitor_slugs.get(schedule)
        if given is not None:
            return given
        return _SENTRY_SLUG.sub("-", schedule.lower()).strip("-")[:50] or "schedule"

    def monitor_config(self, check_in: CheckIn) -> dict[str, Any] | None:
        """The ``monitor_config`` of the schedule (``None``: Sentry cannot express it)."""
        schedule: dict[str, Any]
        if check_in.kind == "cron":
            if len(check_in.expression.split()) != 5:
                return None  # seconds or macros Sentry's crontab does not take
            schedule = {"type": "crontab", "value": check_in.expression}
        elif check_in.kind == "interval":
            every = int(check_in.expression)
            if every % _MINUTE_MS:
                return None
            schedule = {"type": "interval", "value": every // _MINUTE_MS, "unit": "minute"}
            for unit, size in _SENTRY_UNITS:
                if every % size == 0:
                    schedule = {"type": "interval", "value": every // size, "unit": unit}
                    break
        else:
            return None
        config: dict[str, Any] = {
            "schedule": schedule,
            "checkin_margin": self.checkin_margin_min,
            "timezone": check_in.time_zone,
        }
        if check_in.max_runtime_ms is not None:
            config["max_runtime"] = max(1, math.ceil(check_in.max_runtime_ms / _MINUTE_MS))
        return config

    def requests(self, check_in: CheckIn) -> list[HttpRequest]:
        """The check-in of ``check_in``, as Sentry's HTTP check-in API takes it."""
        status = {
            CheckInStatus.STARTED: "in_progress",
            CheckInStatus.SUCCEEDED: "ok",
            CheckInStatus.FAILED: "error",
        }[check_in.status]
        body: dict[str, Any] = {"check_in_id": check_in.check_in_id, "status": status}
        if check_in.duration_s is not None:
            body["duration"] = round(check_in.duration_s, 3)
        if self.environment is not None:
            body["environment"] = self.environment
        config = self.monitor_config(check_in) if self.upsert else None
        if config is not None:
            body["monitor_config"] = config
        url = f"{self._base}{self.slug_of(check_in.schedule)}/{self._key}/"
        return [
            HttpRequest(
                method="POST",
                url=url,
                headers={"Content-Type": "application/json"},
                body=json.dumps(body, separators=(",", ":")).encode("utf-8"),
            )
        ]
