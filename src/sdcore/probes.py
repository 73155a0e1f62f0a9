"""Liveness and readiness of a :class:`~sdcore.runtime.Runtime`, for Kubernetes probes.

*Liveness* answers "should this process be restarted?": it is false only for states a restart
cures — the runtime is not started (or stopped), or one of its background loops (the scheduler,
the outbox relay) has ended. It never depends on the database or Redis: an outage of a shared
dependency must not restart every replica at once. An event loop blocked by a handler does not
answer at all, which the probe's own timeout turns into a failure.

*Readiness* answers "should this replica receive traffic / count as healthy now?": liveness,
plus the database answering ``SELECT 1`` within 2 s, plus the relay not being stuck.

The relay is **stuck** when it runs in this process, outbox rows are due, and it has not
completed a round (claim → publish → record, or an empty claim) for
``RelaySettings.stuck_after_s`` (a healthy relay completes one at least every poll interval, 1 s
by default; while the broker is down it backs off up to 30 s, so the default of 60 s reports an
outage longer than a minute).
A relay task that ended is stuck too. Without due rows an idle relay is never stuck.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sdcore._internal.errors import error_text
from sdcore._internal.redact import redact_text

if TYPE_CHECKING:
    from sdcore.runtime import Runtime

__all__ = [
    "DEFAULT_RELAY_STUCK_AFTER_S",
    "ProbeCheck",
    "ProbeResult",
    "liveness",
    "readiness",
    "serve",
]

DEFAULT_RELAY_STUCK_AFTER_S = 60.0
_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeCheck:
    """One check of a probe."""

    ok: bool
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentHealth:
    """One component's state in the health report (:meth:`sdcore.runtime.Runtime.health`)."""

    ok: bool
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """A probe's answer: ``ok`` when every check passed."""

    ok: bool
    checks: dict[str, ProbeCheck] = field(default_factory=dict)

    def as_dict(self, *, details: bool = False) -> dict[str, object]:
        """The JSON body: ``{"status": "ok"|"fail", "checks": {name: {"ok": …}}}``."""
        checks: dict[str, object] = {}
        for name, check in self.checks.items():
            checks[name] = {"ok": check.ok, "detail": check.detail} if details else {"ok": check.ok}
        return {"status": "ok" if self.ok else "fail", "checks": checks}


def _result(checks: dict[str, ProbeCheck]) -> ProbeResult:
    return ProbeResult(ok=all(c.ok for c in checks.values()), checks=checks)


def _live_checks(runtime: Runtime) -> dict[str, ProbeCheck]:
    checks = {
        "runtime": ProbeCheck(
            ok=runtime.started, detail="started" if runtime.started else "not started"
        )
    }
    if runtime.started and runtime.run_scheduler:
        running = runtime.scheduler.running
        checks["scheduler"] = ProbeCheck(
            ok=running, detail="running" if running else "the scheduler has stopped"
        )
    relay = runtime.relay
    if runtime.started and relay is not None:
        running = relay.state.running
        checks["relay"] = ProbeCheck(
            ok=running, detail="running" if running else "the relay loop has ended"
        )
    return checks


async def liveness(runtime: Runtime) -> ProbeResult:
    """Whether ``runtime`` is alive (no I/O: it never waits for a database or Redis)."""
    return _result(_live_checks(runtime))


async def readiness(runtime: Runtime) -> ProbeResult:
    """Whether ``runtime`` is ready: alive, the database answers, and the relay is not stuck."""
    checks = _live_checks(runtime)
    checks.pop("relay", None)  # judged below, with the backlog
    if not runtime.started:
        return _result(checks)
    checks["database"] = await _database(runtime)
    if runtime.relay is not None:
        checks["relay"] = await _relay(runtime)
    return _result(checks)


async def _database(runtime: Runtime) -> ProbeCheck:
    try:
        async with asyncio.timeout(_TIMEOUT_S):
            async with runtime.pool.connection() as conn:
                await conn.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        detail = redact_text(f"{type(exc).__name__}: {error_text(exc)}"[:300])
        return ProbeCheck(ok=False, detail=detail or "unreachable")
    return ProbeCheck(ok=True, detail="reachable")


async def health(runtime: Runtime) -> dict[str, ComponentHealth]:
    """The health report of ``runtime``: database, Redis and relay (each check bounded to 2 s)."""
    database = await _database(runtime)
    report = {"database": ComponentHealth(ok=database.ok, detail=database.detail)}
    if runtime.redis_url is None:
        report["redis"] = ComponentHealth(ok=True, detail="not configured (queues off)")
        return report
    report["redis"] = await _redis(runtime.redis_url)
    state = runtime.relay.state if runtime.relay else None
    if state is None:
        report["relay"] = ComponentHealth(ok=True, detail="not running in this process")
    else:
        detail = f"published {state.published}, failed {state.failed}"
        if state.last_error and not state.broker_available:
            detail += f"; last error: {state.last_error[:200]}"
        report["relay"] = ComponentHealth(
            ok=state.running and state.broker_available, detail=detail
        )
    return report


async def _redis(url: str) -> ComponentHealth:
    from sdcore._internal.redis_client import open_redis

    client = open_redis(
        url, decode_responses=False, socket_timeout_s=_TIMEOUT_S, connect_timeout_s=_TIMEOUT_S
    )
    try:
        async with asyncio.timeout(_TIMEOUT_S):
            await client.ping()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return ComponentHealth(ok=False, detail=redact_text(f"{type(exc).__name__}: {exc}"))
    finally:
        await client.aclose()
    return ComponentHealth(ok=True, detail="reachable")


async def _relay(runtime: Runtime) -> ProbeCheck:
    relay = runtime.relay
    assert relay is not None  # noqa: S101 - checked by the caller
    state = relay.state
    if not state.running:
        return ProbeCheck(ok=False, detail="the relay loop has ended")
    since = state.last_round_at if state.last_round_at is not None else runtime.started_at
    idle = time.monotonic() - since if since is not None else 0.0
    limit = runtime.relay_stuck_after_s
    if idle < limit:
        return ProbeCheck(ok=True, detail=f"last round {idle:.1f} s ago")
    try:
        async with asyncio.timeout(_TIMEOUT_S):
            stats = await relay.stats()
    except Exception as exc:  # noqa: BLE001 - the database check reports the outage
        detail = redact_text(error_text(exc)[:200])
        return ProbeCheck(ok=False, detail=f"no round for {idle:.0f} s; backlog unknown: {detail}")
    if stats.due == 0:
        return ProbeCheck(ok=True, detail=f"idle for {idle:.0f} s, nothing due")
    error = f"; last error: {state.last_error[:200]}" if state.last_error else ""
    return ProbeCheck(
        ok=False,
        detail=f"stuck: {stats.due} row(s) due and no round completed for {idle:.0f} s{error}",
    )


# --- a tiny HTTP server for processes without a web framework (``sdcore run --metrics-port``) --

_log = logging.getLogger("sdcore.probes")
_MAX_HEADERS = 100  # a probe or scrape sends a handful; more gets a 431
_REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


async def serve(runtime: Runtime, *, host: str = "127.0.0.1", port: int) -> asyncio.Server:
    """Serve ``GET /livez``, ``/readyz`` and ``/metrics`` of ``runtime`` on ``host:port``.

    HTTP/1.0-style, one request per connection, on the runtime's event loop: what a Kubernetes
    probe and a Prometheus scrape need, nothing more. ``/metrics`` answers 404 unless the
    runtime has metrics. Close the returned server to stop (``server.close()``).

    It binds the loopback address unless ``host`` says otherwise: the endpoints have no
    authentication, so reaching them from the kubelet or Prometheus (``host="0.0.0.0"``) is
    a deliberate choice. A request line or header over 64 KiB, or more than 100 header lines,
    gets a 431, logged at DEBUG only.

    Raises:
        OSError: The port cannot be bound.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                try:
                    request = await reader.readline()
                    lines = 0
                    while (await reader.readline()).strip():
                        lines += 1  # headers: nothing in them matters here, but their number
                        if lines > _MAX_HEADERS:  # bounds the loop's work for one client
                            raise ValueError("too many header lines")
                except ValueError:  # a line over the reader's limit, or too many: the client's
                    _log.debug("probe server: request line or headers too long")
                    status, kind, body = 431, "text/plain", b"request line or headers too long\n"
                else:
                    status, kind, body = await _answer(runtime, request)
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("ascii") + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        except Exception:  # noqa: BLE001 - one bad request never stops the server
            _log.exception("probe server: request failed", extra={"action": "probe_failed"})
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


async def _answer(runtime: Runtime, request: bytes) -> tuple[int, str, bytes]:
    parts = request.decode("latin-1").split()
    if len(parts) < 2:
        return 405, "text/plain", b"bad request\n"
    method, path = parts[0], parts[1].split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return 405, "text/plain", b"GET only\n"
    if path in ("/livez", "/readyz"):
        result = await (liveness(runtime) if path == "/livez" else readiness(runtime))
        body = json.dumps(result.as_dict(), separators=(",", ":")).encode()
        return 200 if result.ok else 503, "application/json", body
    if path == "/metrics":
        if runtime.metrics is None:
            return 404, "text/plain", b"metrics are off\n"
        from sdcore.metrics import CONTENT_TYPE

        return 200, CONTENT_TYPE, await runtime.metrics.scrape()
    return 404, "text/plain", b"not found: /livez, /readyz, /metrics\n"
