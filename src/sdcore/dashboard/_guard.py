"""``Guard``: the dashboard's outermost ASGI layer, in front of every route (mounted or not).

In order, before the application sees the request:

1. a ``Host`` outside the allowed names gets a 400 (DNS rebinding: a page on another site whose
   name resolves to the dashboard's address must not read it);
2. a query string that carries a NUL gets a 400 (PostgreSQL refuses NUL in text, and an
   unchecked one would reach a statement);
3. a ``Content-Length`` above the limit gets a 413 at once, body unread; any other body is read
   here, at most ``max_body`` bytes of it (chunked bodies too: 413 as soon as the count passes
   the limit), and replayed to the application. No route can therefore buffer more, whatever
   its checks, and an anonymous client costs at most ``max_body`` bytes of memory.

Every response then gets the security headers, the guard's own answers and 500s included: an
exception that escapes a route is logged once and answered here with a plain page, so the
server's own 500 (which has none of the headers) is never sent.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = (
    (b"content-security-policy", CSP.encode("ascii")),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=(), interest-cohort=()"),
)
PAGE_HEADERS = ((b"cache-control", b"no-store"), (b"vary", b"Cookie, X-Sdcore-Fragment"))


def host_name(value: str) -> str:
    """The name of a ``Host`` header, without its port and brackets, lower-cased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rpartition(":")[0] if value.count(":") == 1 else value


class Guard:
    """Host allow-list, body limit, NUL-free query strings and security headers (see above).

    Args:
        app: The dashboard application.
        max_body: The largest request body accepted, in bytes.
        allowed_hosts: Host names served (``"*"``: any); ``None`` checks nothing.
        log: Where a route's unexpected exception is logged.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body: int,
        allowed_hosts: Collection[str] | None,
        log: logging.Logger,
    ) -> None:
        self.app = app
        self.max_body = max_body
        hosts = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts}
        self.allowed = None if hosts is None or "*" in hosts else frozenset(hosts)
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        root = str(scope.get("root_path", ""))
        path = str(scope.get("path", ""))
        static = path.startswith(f"{root}/static") or path.startswith("/static")

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                names = {bytes(name).lower() for name, _ in message.get("headers", [])}
                extra = SECURITY_HEADERS if static else SECURITY_HEADERS + PAGE_HEADERS
                message["headers"] = [
                    *message.get("headers", []),
                    *((n, v) for n, v in extra if n not in names),
                ]
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            await _page(sending, *refusal)
            return
        try:
            replay = await self._body(scope, receive)
            if replay is None:
                await _page(sending, 413, f"The request body is larger than {self.max_body} bytes.")
                return
            await self.app(scope, replay, sending)
        except Exception:
            if started:
                raise
            self.log.exception(
                "dashboard: %s %s failed",
                scope.get("method"),
                path[:200],
                extra={"action": "dashboard_error"},
            )
            await _page(sending, 500, "The dashboard failed to answer: see its log.")

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        headers = _headers(scope)
        if self.allowed is not None and host_name(headers.get("host", "")) not in self.allowed:
            return 400, (
                "This host name is not served: add it to the dashboard's allowed hosts "
                "(--allowed-host NAME, or allowed_hosts=[...])."
            )
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        if "%00" in query or "\x00" in query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any("\x00" in key or "\x00" in value for key, value in pairs):
                return 400, "A NUL character is not allowed in the query string."
        return None

    async def _body(self, scope: Scope, receive: Receive) -> Receive | None:
        """A ``receive`` that replays the body read here, or ``None`` when it is too large."""
        headers = _headers(scope)
        declared = headers.get("content-length", "")
        if declared and (not declared.isascii() or not declared.isdigit()):
            return None
        if declared and (len(declared) > 12 or int(declared) > self.max_body):
            return None
        if declared in ("", "0") and "transfer-encoding" not in headers:
            return receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                pending: list[Message] = [message]
                break
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break

        async def replay() -> Message:
            return pending.pop(0) if pending else await receive()

        return replay


def _headers(scope: Scope) -> dict[str, str]:
    return {
        bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1")
        for name, value in scope.get("headers", [])
    }


async def _page(send: Send, status: int, message: str) -> None:
    body = (
        "<!doctype html><html lang=en><meta charset=utf-8><title>Refused</title>"
        f"<h1>Not done</h1><p role=alert>{html.escape(message)}</p></html>\n"
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/html; charset=utf-8"),
                (b"content-length", str(len(body)).encode("ascii")),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


__all__ = ["Guard", "host_name"]
