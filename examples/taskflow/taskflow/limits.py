"""``BodyLimit``: an ASGI middleware that bounds request bodies before anything reads them.

FastAPI reads and parses the whole JSON body before it resolves the ``CurrentUser`` dependency,
so without this an anonymous caller could make the server buffer and decode any size (a
decoded body takes several times its size in memory). Here, in order:

1. a ``Content-Length`` above the limit gets a 413 at once, body unread;
2. a request to ``/v1/…`` that has a body but no valid Bearer token gets its 401 at once, body
   unread (a request without a body costs nothing to route: it keeps its 404/405/401);
3. the body is read here, at most ``max_bytes`` of it (chunked bodies too: 413 as soon as the
   count passes the limit), and replayed to the application.

A reverse proxy should enforce a limit too (nginx ``client_max_body_size``).

Every response also gets ``X-Content-Type-Options: nosniff``, and ``/v1`` responses (per-user
data) ``Cache-Control: no-store``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

from taskflow.auth import decode_token
from taskflow.errors import UnauthorizedError, problem
from taskflow.settings import Settings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """Answer 413 for bodies over ``settings.max_bytes``, and 401 for anonymous ``/v1`` calls.

    Args:
        app: The application to protect.
        settings: Where the limit and the token settings come from.
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self._bounded(scope, receive, _with_headers(send, private=_is_api(scope["path"])))

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.settings.max_body_bytes
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        declared = headers.get("content-length", "")
        if declared and (not declared.isdigit() or int(declared) > limit):
            await self._too_large(scope, receive, send)
            return
        has_body = (declared not in ("", "0")) or "transfer-encoding" in headers
        if has_body and _is_api(scope["path"]):
            failure = self._anonymous(headers.get("authorization", ""))
            if failure is not None:
                response = problem(
                    failure.status,
                    failure.detail,
                    instance=scope["path"],
                    headers=failure.headers,
                )
                await response(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _anonymous(self, authorization: str) -> UnauthorizedError | None:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return UnauthorizedError("A Bearer token is required.")
        try:
            decode_token(
                token.strip(),
                self.settings.jwt_secret,
                issuer=self.settings.jwt_issuer,
                audience=self.settings.jwt_audience,
                max_age_s=self.settings.jwt_max_age_s,
            )
        except UnauthorizedError as exc:
            return exc
        return None

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"The request body is larger than {self.settings.max_body_bytes} bytes.",
            instance=scope["path"],
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


def _is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _with_headers(send: Send, *, private: bool) -> Send:
    extra = [(b"x-content-type-options", b"nosniff")]
    if private:
        extra.append((b"cache-control", b"no-store"))

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", [])}
            message["headers"] = [
                *message.get("headers", []),
                *((name, value) for name, value in extra if name not in names),
            ]
        await send(message)

    return sending
