"""FastAPI dependencies and the health endpoint."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from sdcore.events import EventBus
from sdcore.fastapi._runtime import Sdcore
from sdcore.job_scheduler import JobSchedulerService
from sdcore.outbox import Outbox
from sdcore.scheduling import Scheduler


def get_sdcore(request: Request) -> Sdcore:
    """Return the app's :class:`Sdcore` (set by :func:`install`).

    Raises:
        RuntimeError: ``install(app, sdcore)`` was not called.
    """
    sdcore = getattr(request.app.state, "sdcore", None)
    if not isinstance(sdcore, Sdcore):
        raise RuntimeError("sdcore is not installed on this app: call sdcore.fastapi.install()")
    return sdcore


SdcoreDep = Annotated[Sdcore, Depends(get_sdcore)]


def get_jobs(sdcore: SdcoreDep) -> JobSchedulerService:
    """The job scheduler."""
    return sdcore.jobs


def get_events(sdcore: SdcoreDep) -> EventBus:
    """The event bus."""
    return sdcore.events


def get_outbox(sdcore: SdcoreDep) -> Outbox:
    """The outbox."""
    return sdcore.outbox


def get_scheduler(sdcore: SdcoreDep) -> Scheduler:
    """The scheduler (registry: look up, stop, start, add schedules)."""
    return sdcore.scheduler


JobsDep = Annotated[JobSchedulerService, Depends(get_jobs)]
EventsDep = Annotated[EventBus, Depends(get_events)]
OutboxDep = Annotated[Outbox, Depends(get_outbox)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]


DetailGate = Callable[[Request], bool | Awaitable[bool]]


def health_router(
    *,
    path: str = "/health",
    tags: list[str | Enum] | None = None,
    details: bool | DetailGate = False,
) -> APIRouter:
    """Return a router with ``GET {path}``: database, Redis and relay state.

    200 with ``{"status": "ok", ...}`` when every component is fine, 503 with
    ``{"status": "degraded", ...}`` otherwise — each component as ``{"ok": bool}``. The
    components' ``detail`` texts (hosts, ports, error messages) are added only when ``details``
    says so: ``True`` for everyone (an internal-only port), or a function of the request (sync or
    async) that returns ``True`` for an authenticated operator. Passwords never appear.

    Args:
        path: The route.
        tags: OpenAPI tags.
        details: Who may see the detail texts (default: nobody).
    """
    router = APIRouter(tags=list(tags or ["health"]))

    @router.get(path, summary="Database, Redis and outbox relay state")
    async def health(request: Request, sdcore: SdcoreDep) -> JSONResponse:
        report = await sdcore.health()
        ok = all(component.ok for component in report.values())
        show = details if isinstance(details, bool) else details(request)
        if inspect.isawaitable(show):
            show = await show
        body: dict[str, Any] = {"status": "ok" if ok else "degraded"}
        for name, component in report.items():
            shown: dict[str, Any] = {"ok": component.ok}
            if show is True:
                shown["detail"] = component.detail
            body[name] = shown
        return JSONResponse(body, status_code=200 if ok else 503)

    return router


def install(app: Any, sdcore: Sdcore) -> None:
    """Attach ``sdcore`` to ``app`` so the dependencies find it (``app.state.sdcore``)."""
    app.state.sdcore = sdcore
