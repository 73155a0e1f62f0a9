"""Alerting: a missed, failed or overrunning tick pages someone, once per incident.

``Alerting([...sinks])`` on a :class:`~sdcore.runtime.Runtime` (``alerting=``) watches every
schedule through the telemetry seam and a periodic scan of the lease table, decides each alert
once for the whole cluster, and sends it: to webhooks through an outbox of its own (signed,
retried with backoff, surviving a crash), and as check-ins to Sentry Crons and Healthchecks.io.
Needs ``sdcore[alerting]`` (httpx). See docs/how-to/monitoring.md.
"""

try:
    import httpx  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("sdcore.alerting needs httpx: pip install 'sdcore[alerting]'") from exc

from sdcore.alerting._alerting import Alerting
from sdcore.alerting._model import (
    Alert,
    AlertingError,
    AlertKind,
    InvalidAlertingConfigError,
    WebhookSignatureError,
)
from sdcore.alerting._sinks import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    CheckIn,
    CheckInSink,
    CheckInStatus,
    HealthchecksSink,
    HttpRequest,
    SentryCronsSink,
    WebhookSink,
    sign_webhook,
    verify_webhook,
)

__all__ = [
    "DELIVERY_HEADER",
    "EVENT_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Alert",
    "AlertKind",
    "Alerting",
    "AlertingError",
    "CheckIn",
    "CheckInSink",
    "CheckInStatus",
    "HealthchecksSink",
    "HttpRequest",
    "InvalidAlertingConfigError",
    "SentryCronsSink",
    "WebhookSignatureError",
    "WebhookSink",
    "sign_webhook",
    "verify_webhook",
]
