"""The sdcore dashboard in a Django ASGI project, behind Django's authentication.

:func:`dashboard_asgi` wraps the project's ASGI application: requests under ``path`` go to
:func:`sdcore.dashboard.dashboard_app`, every other one to Django. Before the dashboard sees a
request, its Django session is read (the session engine and ``aget_user`` of the project): an
anonymous, inactive or non-staff visitor is redirected to the login page, and a staff user with
every sdcore action permission is the dashboard's operator (pause, resume, trigger, backfill,
outbox retry, recorded under the Django username); other staff users see it read-only. The host
is checked against ``ALLOWED_HOSTS`` as Django checks its own requests.

The dashboard's connections come from an ``sdcore.Runtime`` of its own that runs nothing (no
scheduler, relay or control loop), started on the first dashboard request in the server's event
loop and stopped at the server's lifespan shutdown.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

from sdcore.postgres import PoolSettings
from sdcore.runtime import Runtime

__all__ = ["ACTION_PERMISSIONS", "dashboard_asgi"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ACTION_PERMISSIONS = (
    "sdcore.pause_schedule",
    "sdcore.resume_schedule",
    "sdcore.trigger_schedule",
    "sdcore.backfill_schedule",
    "sdcore.retry_outbox",
)
"""A staff user holding all of these is the dashboard's operator (its actions are all or none)."""
OPERATOR_KEY = "sdcore.django.operator"
DASHBOARD_POOL = PoolSettings(min_size=1, max_size=4, application_name="sdcore-django-dashboard")


def dashboard_asgi(
    application: ASGIApp,
    *,
    path: str = "/sdcore",
    login_url: str | None = None,
    refresh_s: int = 10,
    title: str = "sdcore",
) -> ASGIApp:
    """Return ``application`` with the sdcore dashboard mounted at ``path`` for staff users.

    In ``asgi.py``::

        application = dashboard_asgi(get_asgi_application())

    Args:
        application: The project's ASGI application (``get_asgi_application()``).
        path: Where the dashboard answers (``/sdcore``: ``/sdcore/``, ``/sdcore/outbox`` …).
        login_url: Where visitors sign in (``?next=`` is added); default: the admin's login
            page, else ``settings.LOGIN_URL``.
        refresh_s: The dashboard's table refresh (see ``dashboard_app``).
        title: The dashboard's page title.

    Raises:
        ValueError: ``path`` is not an absolute path below the root (``"/x"``).
        ImportError: The dashboard's extra is missing (``pip install 'sdcore[dashboard]'``).
    """
    if (
        not isinstance(path, str)
        or not path.startswith("/")
        or path.rstrip("/") == ""
        or any(c in path for c in "?#\\ ")
    ):
        raise ValueError(
            f"path must be an absolute path below the root such as '/sdcore', got {path!r}"
        )
    importlib.import_module("sdcore.dashboard")  # without the extra: an error naming it
    from starlette.applications import Starlette
    from starlette.routing import Mount

    guard = _StaffOnly(path.rstrip("/"), login_url, refresh_s, title)
    app: ASGIApp = Starlette(
        routes=[Mount(guard.path, app=guard), Mount("/", app=application)],
        lifespan=guard.lifespan,
    )
    return app


class _StaffOnly:
    """The dashboard, reached only by Django's staff users."""

    def __init__(self, path: str, login_url: str | None, refresh_s: int, title: str) -> None:
        self.path = path
        self.login_url = login_url
        self.refresh_s = refresh_s
        self.title = title
        self.runtime: Runtime | None = None
        self.dashboard: ASGIApp | None = None
        self._lock: asyncio.Lock | None = None

    @asynccontextmanager
    async def lifespan(self, _: object) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if self.runtime is not None:
                await self.runtime.stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.responses import PlainTextResponse, RedirectResponse

        if scope["type"] == "websocket":  # the dashboard has none: refused (403) unread
            await send({"type": "websocket.close", "code": 1008})
            return
        host, cookies = "", []
        for key, value in scope["headers"]:
            if key == b"host":
                host = value.decode("latin-1")
            elif key == b"cookie":  # HTTP/2 may send the cookies in several fields
                cookies.append(value.decode("latin-1"))
        if not _host_allowed(host):
            await PlainTextResponse("Bad Request (host not allowed)", 400)(scope, receive, send)
            return
        user = await _user("; ".join(cookies))
        if user is None or not (user.is_active and user.is_staff):
            path, root = scope["path"], scope.get("root_path", "")
            # Starlette's Mount keeps the full path (recent versions) or strips the mount's.
            target = path if path.startswith(root) else f"{root}{path}"
            if scope.get("query_string"):
                target += "?" + scope["query_string"].decode("latin-1")
            where = f"{self._login()}?next={quote(target)}"
            await RedirectResponse(where, 302)(scope, receive, send)
            return
        from asgiref.sync import sync_to_async

        acts = await sync_to_async(user.has_perms)(ACTION_PERMISSIONS)
        scope = {**scope, OPERATOR_KEY: user.get_username() if acts else None}
        await (await self._dashboard())(scope, receive, send)

    def _login(self) -> str:
        if self.login_url is not None:
            return self.login_url
        from django.conf import settings
        from django.shortcuts import resolve_url
        from django.urls import NoReverseMatch, reverse

        try:
            found: str = reverse("admin:login")
        except NoReverseMatch:
            found = resolve_url(settings.LOGIN_URL)
        return found

    async def _dashboard(self) -> ASGIApp:
        if self.dashboard is not None:
            return self.dashboard
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.dashboard is None:
                self.dashboard = await self._build()
        return self.dashboard

    async def _build(self) -> ASGIApp:
        from django.conf import settings
        from starlette.requests import Request

        from sdcore.dashboard import dashboard_app
        from sdcore.django._control import idle_runtime
        from sdcore.django._settings import SdcoreSettings

        redis_url = SdcoreSettings.from_django().redis_url  # the queues page
        runtime = Runtime(
            **idle_runtime(DASHBOARD_POOL, "sdcore.django.dashboard", redis_url=redis_url)
        )
        await runtime.start()
        self.runtime = runtime

        def operator(request: Request) -> str | None:
            found: str | None = request.scope.get(OPERATOR_KEY)
            return found

        # FastAPI reads the parameter's type to inject the request; this module's annotations
        # are strings, and Request is no global name here.
        operator.__annotations__ = {"request": Request, "return": str | None}

        # Every process of the project derives the same key: a session cookie (and its CSRF
        # token) signed by one web process is valid on the others.
        secret = hashlib.sha256(b"sdcore.django.dashboard:" + settings.SECRET_KEY.encode()).digest()
        app: ASGIApp = dashboard_app(
            runtime, operator=operator, secret=secret, refresh_s=self.refresh_s, title=self.title
        )
        return app


def _host_allowed(host: str) -> bool:
    """Django's own host check (``ALLOWED_HOSTS``, with its ``DEBUG`` defaults)."""
    from django.conf import settings
    from django.http.request import split_domain_port, validate_host

    allowed = list(settings.ALLOWED_HOSTS)
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    domain, _ = split_domain_port(host)
    return bool(domain) and bool(validate_host(domain, allowed))


class _SessionOnly:
    """What ``django.contrib.auth.aget_user`` reads of a request: its session."""

    def __init__(self, session: Any) -> None:
        self.session = session


async def _user(cookie_header: str) -> Any:
    """The Django user of the request's session cookie, or ``None`` without a session."""
    from django.conf import settings
    from django.contrib.auth import aget_user
    from django.http import parse_cookie

    key = parse_cookie(cookie_header).get(settings.SESSION_COOKIE_NAME)
    if not key:
        return None
    store = importlib.import_module(settings.SESSION_ENGINE).SessionStore(key)
    return await aget_user(_SessionOnly(store))
