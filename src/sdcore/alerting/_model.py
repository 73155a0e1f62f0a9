"""Alert values, their keys and errors: what the sinks are told, and how one incident is named."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sdcore._internal.errors import FieldError
from sdcore.exceptions import SdcoreError

__all__ = [
    "Alert",
    "AlertKind",
    "AlertingError",
    "InvalidAlertingConfigError",
    "WebhookSignatureError",
    "check_in_id",
    "incident_key",
    "incident_prefix",
]

# Names a check-in identifier (Sentry's check_in_id, Healthchecks' rid) of one attempt of one tick:
# the same on the replica that starts the attempt and on the one that reports its end.
_CHECK_IN_NAMESPACE = uuid.UUID("1c1b5d3e-3d0c-4f55-9a53-8d3f7d0c5a61")


class AlertingError(SdcoreError):
    """Base class of the alerting errors."""


class InvalidAlertingConfigError(FieldError, AlertingError, ValueError):
    """A sink or an :class:`~sdcore.alerting.Alerting` option is not usable (raised at build)."""


class WebhookSignatureError(AlertingError, ValueError):
    """A webhook's signature or timestamp does not verify (:func:`verify_webhook`).

    Attributes:
        reason: What is wrong (``missing``, ``malformed``, ``expired``, ``mismatch``).
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"webhook signature rejected ({reason}): {detail}")


class AlertKind(enum.StrEnum):
    """What an alert says about a schedule.

    ``MISSED``: a tick did not run at its instant (never started, or its replica died mid-run and
    the sweep started it again). ``FAILED``: a tick's last attempt raised. ``OVERRUN``: a run is
    still going past the schedule's ``max_runtime_ms``. ``RESOLVED``: a tick succeeded after one
    of those, closing the incident.
    """

    MISSED = "missed"
    FAILED = "failed"
    OVERRUN = "overrun"
    RESOLVED = "resolved"


@dataclass(frozen=True, slots=True, kw_only=True)
class Alert:
    """One alert, as a webhook receives it (:meth:`payload` is the JSON body).

    Attributes:
        id: Stable across retries and replicas (receivers deduplicate on it).
        kind: What happened.
        schedule: The schedule's name.
        run_key: The tick the alert is about (for ``resolved``: the tick that succeeded).
        scheduled_at: That tick's scheduled instant (UTC), when known.
        detected_at: When a replica noticed it (UTC).
        attempt: The attempt number concerned (0 when none started).
        reason: A human sentence.
        incident_kind: For ``resolved``: the kind of the incident it closes.
        incident_run_key: For ``resolved``: the run key of the incident it closes.
    """

    id: str
    kind: AlertKind
    schedule: str
    run_key: str | None
    scheduled_at: datetime | None
    detected_at: datetime
    attempt: int
    reason: str
    incident_kind: AlertKind | None = None
    incident_run_key: str | None = None

    def payload(self) -> dict[str, Any]:
        """The JSON object sent to webhooks (and stored in the outbox row)."""
        body: dict[str, Any] = {
            "id": self.id,
            "kind": self.kind.value,
            "schedule": self.schedule,
            "run_key": self.run_key,
            "scheduled_at": None if self.scheduled_at is None else _iso(self.scheduled_at),
            "detected_at": _iso(self.detected_at),
            "attempt": self.attempt,
            "reason": self.reason,
        }
        if self.incident_kind is not None:
            body["incident"] = {"kind": self.incident_kind.value, "run_key": self.incident_run_key}
        return body


def _iso(value: datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


def incident_prefix(schedule: str) -> str:
    """The start of every alert key of ``schedule`` (length-prefixed: names may hold ``|``)."""
    return f"sdcore-alert|{len(schedule)}:{schedule}|"


def incident_key(schedule: str, kind: AlertKind, run_key: str, sink: str) -> str:
    """The outbox idempotency key of one alert to one sink.

    Every replica that notices the same incident derives the same key, so the outbox writes it
    once. Sink names are queue names (``[A-Za-z0-9_.-]``), so the last ``|`` ends the run key.
    """
    return f"{incident_prefix(schedule)}{kind.value}|{run_key}|{sink}"


def parse_key(schedule: str, key: str) -> tuple[AlertKind, str] | None:
    """The kind and run key an alert key of ``schedule`` names (``None``: not one of its keys).

    For a ``resolved`` key, the run key of the incident it closes.
    """
    prefix = incident_prefix(schedule)
    if not key.startswith(prefix):
        return None
    kind_text, _, rest = key[len(prefix) :].partition("|")
    run_key, _, _ = rest.rpartition("|")
    try:
        kind = AlertKind(kind_text)
    except ValueError:
        return None
    return kind, run_key


def check_in_id(schedule: str, run_key: str | None, attempt: int) -> str:
    """The check-in id (a UUID) of one attempt of one tick, the same on every replica."""
    return str(uuid.uuid5(_CHECK_IN_NAMESPACE, f"{schedule}\x00{run_key}\x00{attempt}"))
