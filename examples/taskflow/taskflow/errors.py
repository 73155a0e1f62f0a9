"""Errors as ``application/problem+json`` (RFC 9457), for every 4xx and 5xx TaskFlow returns.

Domain code raises :class:`ProblemError` subclasses; :func:`install_error_handlers` maps them,
FastAPI's validation errors and Starlette's HTTP errors (unknown route, wrong method) to one
shape: ``{"type", "title", "status", "detail", "instance"}`` plus ``errors`` for 422.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException as StarletteHTTPException

PROBLEM_JSON = "application/problem+json"
_log = logging.getLogger(__name__)


class ProblemError(Exception):
    """An error with an HTTP status, rendered as problem+json.

    Args:
        detail: Human-readable explanation of this occurrence.
    """

    status: ClassVar[HTTPStatus] = HTTPStatus.INTERNAL_SERVER_ERROR
    headers: ClassVar[Mapping[str, str]] = {}

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class UnauthorizedError(ProblemError):
    """No token, or a token that is not valid (401)."""

    status = HTTPStatus.UNAUTHORIZED
    headers: ClassVar[Mapping[str, str]] = {"WWW-Authenticate": "Bearer"}


class ForbiddenError(ProblemError, PermissionError):
    """The caller is known but may not do this (403).

    TaskFlow's task routes answer 404 instead for a task the caller may not see (a 403 would
    confirm that the id exists); use this where existence is not a secret.
    """

    status = HTTPStatus.FORBIDDEN


class NotFoundError(ProblemError, LookupError):
    """Unknown resource, or one the caller may not see (404; existence is not revealed)."""

    status = HTTPStatus.NOT_FOUND


class InvalidRequestError(ProblemError, ValueError):
    """A well-formed request that breaks a domain rule (422)."""

    status = HTTPStatus.UNPROCESSABLE_ENTITY


def problem(
    status: int,
    detail: str | None,
    *,
    instance: str | None = None,
    headers: Mapping[str, str] | None = None,
    errors: Sequence[Mapping[str, Any]] | None = None,
) -> JSONResponse:
    """Build a problem+json response.

    Args:
        status: HTTP status code.
        detail: What went wrong this time (``None`` to omit).
        instance: The request path.
        headers: Extra headers (``WWW-Authenticate`` for 401).
        errors: Field errors of a 422.

    Returns:
        The response, with ``type`` ``about:blank`` and the status phrase as ``title``.
    """
    body: dict[str, Any] = {"type": "about:blank", "title": HTTPStatus(status).phrase}
    body["status"] = status
    if detail is not None:
        body["detail"] = detail
    if instance is not None:
        body["instance"] = instance
    if errors is not None:
        body["errors"] = list(errors)
    return JSONResponse(
        body, status_code=status, headers=dict(headers or {}), media_type=PROBLEM_JSON
    )


async def _on_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ProblemError)
    return problem(exc.status, exc.detail, instance=request.url.path, headers=exc.headers)


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": list(error.get("loc", ())), "msg": error.get("msg", ""), "type": error.get("type")}
        for error in jsonable_encoder(exc.errors())
    ]
    return problem(
        HTTPStatus.UNPROCESSABLE_ENTITY,
        "The request is not valid.",
        instance=request.url.path,
        errors=errors,
    )


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    headers = getattr(exc, "headers", None)
    detail = exc.detail if isinstance(exc.detail, str) else None
    return problem(exc.status_code, detail, instance=request.url.path, headers=headers)


async def _on_data_error(request: Request, exc: Exception) -> JSONResponse:
    # The models refuse what PostgreSQL cannot store; this is the backstop for anything they
    # miss. Logged without the statement or its parameters (user data).
    _log.warning(
        "database refused a value on %s %s: %s",
        request.method,
        request.url.path,
        type(getattr(exc, "orig", exc)).__name__,
        extra={"action": "data_error", "path": request.url.path},
    )
    return problem(
        HTTPStatus.UNPROCESSABLE_ENTITY,
        "A value cannot be stored (too long, or a character the database refuses).",
        instance=request.url.path,
    )


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Logged here with the path; Starlette re-raises it afterwards for the server to see.
    _log.error(
        "unhandled error on %s %s: %s",
        request.method,
        request.url.path,
        type(exc).__name__,
        extra={"action": "unhandled_error", "path": request.url.path},
    )
    return problem(HTTPStatus.INTERNAL_SERVER_ERROR, None, instance=request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Render every error of ``app`` as problem+json."""
    app.add_exception_handler(ProblemError, _on_problem)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(DataError, _on_data_error)
    app.add_exception_handler(Exception, _on_unexpected)
