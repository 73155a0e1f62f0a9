"""``dashboard_app``: the dashboard as a FastAPI application, to serve or to mount.

No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations at run
time, and they name dependencies local to :func:`dashboard_app`.
"""

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import jinja2
import psycopg
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.redis_url import RedisUrlError, UntaggedPrefixError, check_queue_target
from sdcore._internal.supervisor import Supervisor
from sdcore._internal.validation import Refusal, int_between, non_empty_str, shown
from sdcore.dashboard import _format
from sdcore.dashboard._auth import (
    COOKIE,
    DashboardError,
    LoginThrottle,
    Revocations,
    Session,
    Signer,
    check_actor,
    check_token,
    token_matches,
)
from sdcore.dashboard._data import (
    MISSING_STATES,
    MISSING_TABLE,
    DashboardData,
    QueueNames,
    QueueView,
)
from sdcore.dashboard._format import Refused, instant, page_number
from sdcore.dashboard._guard import Guard
from sdcore.job_scheduler import JobScheduler, JobSchedulerDatabaseError
from sdcore.outbox import Outbox, OutboxDatabaseError
from sdcore.runtime import Runtime
from sdcore.scheduling import (
    ControlWriteUncertainError,
    InvalidScheduleError,
    PostgresScheduleStore,
    ScheduleAdmin,
)
from sdcore.scheduling import ScheduleControlError as ControlError

MAX_FORM_BYTES = 16_384
WARM_WAIT_S = 2.0
"""How long the app's start-up waits for the calendar warm-up before it serves anyway."""
NOTICES = {
    "paused": "Paused: no replica starts its ticks until it is resumed.",
    "resumed": "Resumed: replicas apply their catch-up policy to the pause.",
    "triggered": "Triggered: one replica runs it now.",
    "backfill": "Backfill requested: one replica runs the window's ticks, oldest first.",
    "already": (
        "This form was already submitted: its action was recorded then (see the log below); "
        "nothing new was recorded. Submit the form of a freshly loaded page for a new request."
    ),
    "retried": "The outbox row is pending again and due now.",
    "login": "Signed in: actions are recorded with your name.",
    "logout": "Signed out: the dashboard is read-only.",
}
Operator = Callable[..., Awaitable[str | None]] | Callable[..., str | None]


@dataclass(slots=True, kw_only=True)
class Visit:
    """One request's session and operator."""

    session: Session
    fresh: bool
    actor: str | None
    csrf: str
    base: str


def _check_cluster_prefix(redis_url: str | None, prefix: str) -> None:
    """On a ``redis+cluster://`` URL, refuse a prefix without a hash tag (no queue could live
    under it); any other URL is left to the queues page, which shows what Redis says."""
    if redis_url is None:
        return
    try:
        check_queue_target(redis_url, prefix)
    except RedisUrlError:
        return
    except UntaggedPrefixError as exc:
        raise DashboardError(f"queue_prefix: {exc}") from None


def _refused(refusal: Refusal) -> DashboardError:
    return DashboardError(refusal.message)


def dashboard_app(
    source: Runtime | AsyncConnectionPool[Any],
    *,
    token: str | None = None,
    operator: Operator | None = None,
    secret: bytes | None = None,
    redis_url: str | None = None,
    queue_prefix: str | None = None,
    lease_table: str = JobScheduler.TABLE_NAME,
    schema: str | None = None,
    schedules_table: str = "sdcore_schedules",
    outbox: Outbox | None = None,
    refresh_s: int = 10,
    title: str = "sdcore",
    allowed_hosts: Collection[str] | None = None,
) -> FastAPI:
    """Build the dashboard: schedules, runs, leases, outbox and queues; actions for operators.

    Serve it (``sdcore dashboard``, uvicorn) or mount it: ``app.mount("/sdcore",
    dashboard_app(runtime, operator=current_admin))``. Pages are read-only unless an operator
    is known: ``token`` (the login form's shared secret) or ``operator``, a FastAPI dependency of
    the host application that returns the operator's name (``None``: not an operator).

    Args:
        source: A :class:`~sdcore.Runtime` (its pool, tables and Redis), or an open pool.
        token: Operator token (at least 16 characters), compared in constant time.
        operator: The host application's dependency naming the operator.
        secret: Key that signs session cookies (at least 16 bytes). Default: derived from
            ``token``; with ``operator`` alone, random per process (give one when several
            replicas serve the dashboard behind one address). With ``token`` too, the key is
            derived from both, so rotating either ends every session.
        redis_url: Show BullMQ queues from this Redis (default: the runtime's).
        queue_prefix: BullMQ key prefix (default: the runtime's, else ``"bull"``); with a
            ``redis+cluster://`` URL it must hold a hash tag, e.g. ``"{bull}"``.
        lease_table: The lease table (pool only).
        schema: Schema of the lease and schedules tables (pool only).
        schedules_table: The schedules table (pool only).
        outbox: The outbox table (pool only; default ``Outbox()``).
        refresh_s: Tables refresh in the browser every this many seconds (0: never).
        title: Shown in the page title.
        allowed_hosts: Host names (``Host`` header, port ignored) the dashboard answers; any
            other gets a 400, which stops DNS rebinding. ``None``: any host (a host
            application's own ``TrustedHostMiddleware`` applies); ``"*"`` in the list: any.

    Raises:
        DashboardError: A short or predictable token, a short secret, or a bad
            ``refresh_s``, ``queue_prefix`` (on a Redis Cluster, one without a hash tag) or
            ``allowed_hosts``.
    """
    token = check_token(token)
    int_between("refresh_s", refresh_s, 0, 3600, error=_refused)
    if queue_prefix is None:
        queue_prefix = source._prefix if isinstance(source, Runtime) else "bull"
    if "\x00" in non_empty_str("queue_prefix", queue_prefix, error=_refused):
        raise DashboardError(f"queue_prefix must be a str without NUL, got {shown(queue_prefix)}")
    if secret is not None and not isinstance(secret, bytes):
        raise DashboardError("secret must be bytes (at least 16)")
    if isinstance(allowed_hosts, str) or (
        allowed_hosts is not None
        and not all(isinstance(h, str) and h.strip() for h in allowed_hosts)
    ):
        raise DashboardError("allowed_hosts must be a list of host names, e.g. ['localhost']")
    if isinstance(source, Runtime):
        pool, store = source.pool, source.schedule_store
        outbox = source.outbox
        redis_url = redis_url or source.redis_url
    else:
        pool = source
        store = PostgresScheduleStore(
            pool, table=schedules_table, schema=schema, lease_table=lease_table
        )
    _check_cluster_prefix(redis_url, queue_prefix)
    data = DashboardData(pool, store=store, lease_table=lease_table, schema=schema, outbox=outbox)
    admin = ScheduleAdmin(store)
    if token is not None:
        signer = Signer.for_token(token, secret)
    elif secret is not None:
        signer = Signer(secret)
    else:
        signer = Signer(secrets.token_bytes(32))
    log = logging.getLogger("sdcore.dashboard")
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("sdcore.dashboard", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(_format.FILTERS)
    # A fresh id per rendered trigger or backfill form: submitting that form twice (a double
    # click, a resent POST) records one action, while each new rendering asks anew.
    env.globals["request_id"] = lambda: secrets.token_urlsafe(16)
    app = FastAPI(
        title=f"{title} dashboard",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=_warm_up(data, env, log),
    )
    app.mount("/static", StaticFiles(packages=[("sdcore.dashboard", "static")]), name="static")
    app.add_middleware(Guard, max_body=MAX_FORM_BYTES, allowed_hosts=allowed_hosts, log=log)
    revoked = Revocations()
    throttle = LoginThrottle()
    queue_view = QueueView(QueueNames())

    async def no_operator() -> str | None:
        return None

    host_operator: Callable[..., Awaitable[str | None]] = no_operator
    if operator is not None:
        host = operator

        async def from_host(who: Annotated[object, Depends(host)]) -> str | None:
            return who if isinstance(who, str) and who.strip() else None

        host_operator = from_host

    async def visit(
        request: Request, host_actor: Annotated[str | None, Depends(host_operator)]
    ) -> Visit:
        session = signer.load(request.cookies.get(COOKIE))
        if session is not None and session in revoked:
            session = None
        fresh = session is None
        if session is None:
            session = signer.new_session(None)
        actor = host_actor or (session.actor if token is not None else None)
        base = str(request.scope.get("root_path", "")).rstrip("/")
        return Visit(
            session=session, fresh=fresh, actor=actor, csrf=signer.csrf(session), base=base
        )

    Seen = Annotated[Visit, Depends(visit)]

    def cookie(response: Response, request: Request, seen: Visit, session: Session) -> None:
        response.set_cookie(
            COOKIE,
            signer.dump(session),
            max_age=session.expires - int(datetime.now(UTC).timestamp()),
            path=seen.base or "/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    def render(
        request: Request, seen: Visit, name: str, code: int = 200, **values: Any
    ) -> HTMLResponse:
        notice = NOTICES.get(request.query_params.get("notice", ""))
        context = {
            "base": seen.base,
            "title": title,
            "actor": seen.actor,
            "csrf": seen.csrf,
            "can_act": seen.actor is not None,
            "login_enabled": token is not None,
            "refresh_s": refresh_s,
            "notice": notice,
            "now": datetime.now(UTC),
            "queues_enabled": redis_url is not None,
            "page": name.removesuffix(".html"),
            **values,
        }
        template = env.get_template(name)
        if request.headers.get("X-Sdcore-Fragment") == "1":
            body = "".join(template.blocks["content"](template.new_context(context)))
        else:
            body = template.render(context)
        response = HTMLResponse(body, status_code=code)
        if seen.fresh:
            cookie(response, request, seen, seen.session)
        return response

    async def form(request: Request, seen: Visit, *, operator_only: bool = True) -> dict[str, str]:
        """The POSTed form, after the operator, Origin and CSRF checks."""
        if operator_only and seen.actor is None:
            if token is None and operator is None:
                raise Refused(403, "This dashboard is read-only: it has no operator credentials.")
            raise Refused(401, "Sign in as an operator first: the dashboard is read-only.")
        origin = request.headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
            raise Refused(403, "Cross-origin request refused.")
        if request.headers.get("sec-fetch-site") == "cross-site":
            raise Refused(403, "Cross-site request refused.")
        body = await request.body()  # at most MAX_FORM_BYTES: the Guard refused larger ones
        if len(body) > MAX_FORM_BYTES:
            raise Refused(413, "Form too large.")
        fields = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        if any("\x00" in value for value in fields.values()):
            raise Refused(400, "A NUL character is not allowed in a form.")
        if seen.fresh or not signer.check_csrf(seen.session, fields.get("csrf")):
            raise Refused(403, "Missing or wrong CSRF token: reload the page and try again.")
        return fields

    def back(seen: Visit, path: str, **query: str) -> RedirectResponse:
        where = f"{seen.base}{path}" + (f"?{urlencode(query)}" if query else "")
        return RedirectResponse(where, status_code=303)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> HTMLResponse:
        seen = await visit(request, None)
        return render(request, seen, "error.html", code=exc.status, message=exc.message)

    # --- pages -------------------------------------------------------------------------------

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        # No icon of its own: an empty answer, so browsers log no 404 on every first visit.
        return Response(status_code=204, headers={"Cache-Control": "public, max-age=86400"})

    # HEAD too: uptime checkers probe the front page with it.
    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def schedules(request: Request, seen: Seen, q: str = "", state: str = "") -> Response:
        page = page_number(request.query_params.get("page", "1"))
        paused = {"paused": True, "active": False}.get(state)
        try:
            found = await data.schedules(query=q[:200] or None, paused=paused, page=page)
        except MISSING_TABLE:
            return render(request, seen, "missing.html", what="schedules", flag="--schedules")
        return render(request, seen, "schedules.html", found=found, q=q[:200], state=state)

    @app.get("/schedule", response_class=HTMLResponse)
    async def schedule(request: Request, seen: Seen, name: str = "") -> Response:
        try:
            row = await data.schedule(name)
        except MISSING_TABLE:
            return render(request, seen, "missing.html", what="schedules", flag="--schedules")
        if row is None:
            raise Refused(404, f"No schedule named {name!r}.")
        runs = await data.runs(name)
        actions = await admin.actions(name, limit=20)
        return render(request, seen, "schedule.html", row=row, runs=runs, actions=actions)

    @app.get("/leases", response_class=HTMLResponse)
    async def leases(request: Request, seen: Seen) -> Response:
        try:
            rows = await data.running_leases()
        except MISSING_TABLE:
            return render(request, seen, "missing.html", what="lease", flag="")
        except JobSchedulerDatabaseError as exc:  # the lease admin wraps the driver's error
            if exc.sqlstate not in MISSING_STATES:
                raise
            return render(request, seen, "missing.html", what="lease", flag="")
        return render(request, seen, "leases.html", rows=rows)

    @app.get("/outbox", response_class=HTMLResponse)
    async def outbox_page(request: Request, seen: Seen, status: str = "") -> Response:
        statuses = [status] if status in ("PENDING", "DEAD") else ["PENDING", "DEAD"]
        try:
            stats = await data.outbox_stats()
            rows = await data.outbox_rows(statuses)
        except OutboxDatabaseError as exc:
            if exc.sqlstate not in MISSING_STATES:
                raise
            return render(request, seen, "missing.html", what="outbox", flag="--outbox")
        return render(request, seen, "outbox.html", stats=stats, rows=rows, status=status)

    @app.get("/queues", response_class=HTMLResponse)
    async def queues(request: Request, seen: Seen) -> Response:
        if redis_url is None:
            return render(request, seen, "queues.html", rows=None, error=None)
        try:
            rows = await queue_view.get(redis_url, queue_prefix)
        except Exception as exc:  # noqa: BLE001 - Redis down is shown, not a 500
            detail = _format.one_line(exc)
            log.warning(
                "dashboard: the queues cannot be read: %s", detail, extra={"action": "queues"}
            )
            # The error names internal hosts and ports: operators see it, visitors do not.
            error = detail if seen.actor is not None else "Redis cannot be reached (see the log)."
            return render(request, seen, "queues.html", rows=None, error=error)
        return render(
            request, seen, "queues.html", rows=rows, error=None, partial=queue_view.names.partial
        )

    @app.get("/login", response_class=HTMLResponse)
    async def login_page(request: Request, seen: Seen) -> Response:
        return render(request, seen, "login.html", failed=False)

    # --- actions -----------------------------------------------------------------------------

    @app.post("/login", response_model=None)
    async def login(request: Request, seen: Seen) -> Response:
        fields = await form(request, seen, operator_only=False)
        if token is None:
            raise Refused(403, "Token sign-in is off for this dashboard.")
        client = request.client.host if request.client is not None else "unknown"
        wait_s = throttle.retry_after(client)
        if wait_s is not None:
            refusal = render(
                request,
                seen,
                "error.html",
                code=429,
                message=f"Too many wrong sign-ins: try again in {wait_s} s.",
            )
            refusal.headers["Retry-After"] = str(wait_s)
            return refusal
        actor = check_actor(fields.get("name", ""))
        if actor is None or not token_matches(token, fields.get("token")):
            failures = throttle.failed(client)
            log.warning(
                "dashboard: a sign-in from %s was refused (%d within 5 min)",
                client,
                failures,
                extra={"action": "dashboard_login", "client": client, "failures": failures},
            )
            return render(request, seen, "login.html", code=401, failed=True)
        log.info(
            "dashboard: %s signed in", actor, extra={"action": "dashboard_login", "actor": actor}
        )
        if seen.session.actor is not None:
            revoked.revoke(seen.session)  # signing out later only revokes the new session
        response = back(seen, "/", notice="login")
        cookie(response, request, seen, signer.new_session(actor))
        return response

    @app.post("/logout", response_model=None)
    async def logout(request: Request, seen: Seen) -> Response:
        await form(request, seen, operator_only=False)
        if seen.session.actor is not None:
            revoked.revoke(seen.session)
        response = back(seen, "/", notice="logout")
        cookie(response, request, seen, signer.new_session(None))
        return response

    @app.post("/schedule/{verb}", response_model=None)
    async def act(request: Request, seen: Seen, verb: str) -> Response:
        fields = await form(request, seen)
        name = fields.get("name", "")
        reason = fields.get("reason", "").strip() or None
        request_id = fields.get("request_id") or None
        actor = f"{seen.actor} (dashboard)"
        try:
            if verb == "pause":
                done = await admin.pause(name, actor=actor, reason=reason)
            elif verb == "resume":
                done = await admin.resume(name, actor=actor, reason=reason)
            elif verb == "trigger":
                done = await admin.trigger(name, actor=actor, reason=reason, request_id=request_id)
            elif verb == "backfill":
                start, end = instant(fields, "from"), instant(fields, "to")
                concurrency = page_number(fields.get("concurrency", "1") or "1")
                done = await admin.backfill(
                    name,
                    start,
                    end,
                    actor=actor,
                    reason=reason,
                    concurrency=concurrency,
                    request_id=request_id,
                )
            else:
                raise Refused(404, f"Unknown action {verb!r}.")
        except (ControlError, InvalidScheduleError) as exc:
            raise Refused(409, str(exc)) from None
        except ControlWriteUncertainError as exc:
            again = " Submitting the same form again records it at most once." * bool(request_id)
            raise Refused(503, str(exc) + "." + again) from None
        log.info(
            "dashboard: %s: %s %r (action %s)",
            seen.actor,
            verb,
            name,
            done.id,
            extra={"action": f"dashboard_{verb}", "actor": seen.actor, "schedule": name},
        )
        notice = {"pause": "paused", "resume": "resumed", "trigger": "triggered"}.get(verb, verb)
        if done.replayed:
            notice = "already"
        return back(seen, "/schedule", name=name, notice=notice)

    @app.post("/outbox/retry", response_model=None)
    async def retry(request: Request, seen: Seen) -> Response:
        fields = await form(request, seen)
        text = fields.get("id", "")
        if not text.isascii() or not text.isdigit() or not 0 < int(text) < 2**63:
            raise Refused(400, "The outbox row id must be a positive integer.")
        try:
            retried = await data.retry_outbox(int(text))
        except OutboxDatabaseError as exc:
            raise Refused(503, f"The database refused the retry: {_format.one_line(exc)}") from None
        if not retried:
            raise Refused(409, f"No DEAD or PENDING outbox row with id {text}.")
        log.info(
            "dashboard: %s retried outbox row %s",
            seen.actor,
            text,
            extra={"action": "dashboard_outbox_retry", "actor": seen.actor, "outbox_id": text},
        )
        return back(seen, "/outbox", notice="retried")

    return app


def _warm_up(
    data: DashboardData, env: jinja2.Environment, log: logging.Logger
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: compile the templates, warm the timelines' calendar and read the
    list's first page once (fresh connections and code paths), in a supervised background task.

    Start-up waits for it up to :data:`WARM_WAIT_S` (servers accept requests only after
    start-up), then it goes on in the background; shutdown cancels it. A failure (no schedules
    table yet) is logged: the pages compute what they need when asked.
    """

    async def warm() -> None:
        started = asyncio.get_running_loop().time()
        for template in env.list_templates():
            env.get_template(template)
        try:
            hours = await data.warm_calendar()
            await data.schedules()  # the list's statements and code paths, once
        except psycopg.Error as exc:
            log.warning("calendar warm-up failed: %s", str(exc).strip()[:200])
            return
        log.info(
            "calendar warm-up: %d hours in %.0f ms",
            hours,
            (asyncio.get_running_loop().time() - started) * 1000,
            extra={"action": "calendar_warmed", "hours": hours},
        )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        supervisor = Supervisor("sdcore-dashboard", logger=log)
        await supervisor.start()
        try:
            task = supervisor.spawn("calendar", warm, restart=False, cancel_on_close=True)
            await asyncio.wait({task}, timeout=WARM_WAIT_S)
            yield
        finally:
            await supervisor.aclose(grace_s=0)

    return lifespan


__all__ = ["Operator", "dashboard_app"]
