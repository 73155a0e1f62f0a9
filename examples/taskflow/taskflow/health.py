"""``GET /health``: the status for everyone, the details for operators only.

Anonymous callers (load balancers, probes) get ``{"status": "ok"}`` (200) or
``{"status": "degraded"}`` (503) and nothing else: the details name internal hosts, ports and
exception messages. A Bearer token whose user is in ``TASKFLOW_OPERATOR_IDS`` also gets each
component's state; any other valid token gets the short answer; an invalid token gets a 401.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from taskflow.auth import decode_token
from taskflow.errors import UnauthorizedError

router = APIRouter(tags=["health"])


def _is_operator(request: Request) -> bool:
    authorization = request.headers.get("authorization", "")
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise UnauthorizedError("A Bearer token is required.")
    settings = request.app.state.taskflow.settings
    user = decode_token(
        token.strip(),
        settings.jwt_secret,
        issuer=settings.jwt_issuer,
        audience=settings.jwt_audience,
        max_age_s=settings.jwt_max_age_s,
    )
    return user.id in settings.operator_ids


@router.get("/health", summary="Service status (details for operators)")
async def health(request: Request) -> JSONResponse:
    """Answer 200 when the database, Redis and the relay are fine, 503 otherwise."""
    operator = _is_operator(request)
    report = await request.app.state.taskflow.sd.health()
    ok = all(component.ok for component in report.values())
    body: dict[str, Any] = {"status": "ok" if ok else "degraded"}
    if operator:
        body.update({name: {"ok": c.ok, "detail": c.detail} for name, c in report.items()})
    headers = {"Cache-Control": "no-store"}
    return JSONResponse(body, status_code=200 if ok else 503, headers=headers)
