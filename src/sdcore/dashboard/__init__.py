"""A web dashboard of the cluster: schedules, runs, leases, outbox, queues (``sdcore[dashboard]``).

``sdcore dashboard --database-url …`` serves it; ``app.mount("/sdcore", dashboard_app(runtime))``
mounts it in a FastAPI application. Pages are server-rendered HTML (Jinja2, everything escaped,
a strict Content-Security-Policy) that work without JavaScript; actions (pause, resume, trigger,
backfill, outbox retry) need an operator and a CSRF token. See ``docs/how-to/dashboard.md``.
"""

try:
    import fastapi  # noqa: F401
    import jinja2  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "sdcore.dashboard needs jinja2 and fastapi: pip install 'sdcore[dashboard]'"
    ) from exc

from sdcore.dashboard._app import Operator, dashboard_app
from sdcore.dashboard._auth import DashboardError

__all__ = ["DashboardError", "Operator", "dashboard_app"]
