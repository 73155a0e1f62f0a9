"""``GET /metrics``, ``GET /livez`` and ``GET /readyz`` for the app's :class:`Sdcore`."""

from __future__ import annotations

import inspect
from enum import Enum

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sdcore.fastapi._deps import DetailGate, SdcoreDep


def metrics_router(*, path: str = "/metrics", tags: list[str | Enum] | None = None) -> APIRouter:
    """Return a router with ``GET {path}``: the Prometheus exposition of the app's runtime.

    The runtime needs ``metrics=True`` (``sdcore[metrics]``); without it the route answers 404
    with a hint. Cluster figures are read from the database at scrape time, bounded by the
    metrics' timeout (a slow database serves the last figures instead of hanging the scrape).

    Args:
        path: The route.
        tags: OpenAPI tags.
    """
    router = APIRouter(tags=list(tags or ["monitoring"]))

    @router.get(path, summary="Prometheus metrics", include_in_schema=False)
    async def metrics(sdcore: SdcoreDep) -> Response:
        if sdcore.metrics is None:
            return Response(
                "metrics are off: build the Sdcore with metrics=True\n",
                status_code=404,
                media_type="text/plain",
            )
        from sdcore.metrics import CONTENT_TYPE

        return Response(await sdcore.metrics.scrape(), media_type=CONTENT_TYPE)

    return router


def probes_router(
    *,
    liveness_path: str = "/livez",
    readiness_path: str = "/readyz",
    tags: list[str | Enum] | None = None,
    details: bool | DetailGate = False,
) -> APIRouter:
    """Return a router with the Kubernetes probes of the app's runtime (see ``sdcore.probes``).

    ``GET {liveness_path}``: 200 while the runtime and its loops run, else 503 — no database
    call. ``GET {readiness_path}``: 200 when also the database answers and the relay is not
    stuck, else 503. The body is ``{"status": "ok"|"fail", "checks": {name: {"ok": …}}}``; each
    check's ``detail`` text only when ``details`` says so (as :func:`health_router`).

    Args:
        liveness_path: The liveness route.
        readiness_path: The readiness route.
        tags: OpenAPI tags.
        details: Who may see the detail texts (default: nobody).
    """
    router = APIRouter(tags=list(tags or ["health"]))

    async def show(request: Request) -> bool:
        shown = details if isinstance(details, bool) else details(request)
        if inspect.isawaitable(shown):
            shown = await shown
        return shown is True

    @router.get(liveness_path, summary="Liveness: the runtime and its loops run")
    async def livez(request: Request, sdcore: SdcoreDep) -> JSONResponse:
        result = await sdcore.liveness()
        body = result.as_dict(details=await show(request))
        return JSONResponse(body, status_code=200 if result.ok else 503)

    @router.get(readiness_path, summary="Readiness: database reachable, relay not stuck")
    async def readyz(request: Request, sdcore: SdcoreDep) -> JSONResponse:
        result = await sdcore.readiness()
        body = result.as_dict(details=await show(request))
        return JSONResponse(body, status_code=200 if result.ok else 503)

    return router
