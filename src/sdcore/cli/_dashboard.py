"""``sdcore dashboard``: serve the web dashboard (``sdcore[dashboard]``) until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from psycopg import Error as PsycopgError
from psycopg.conninfo import conninfo_to_dict

from sdcore.cli._format import emit, escape
from sdcore.cli._options import (
    UsageError,
    add_command,
    check_queue_prefix,
    connection_options,
    int_in,
    outbox_table_option,
)
from sdcore.cli._target import CliError, started_runtime, target_of

TOKEN_ENV = "SDCORE_DASHBOARD_TOKEN"  # noqa: S105 - the variable's name, not a secret
DEFAULT_PORT = 8089
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")  # noqa: S104 - compared with --host, not bound
POOL_SIZE = 6  # the job scheduler holds at most half: three for concurrent page loads
Emit = Callable[[str], None]


def _server(base: type[Any]) -> type[Any]:
    class Server(base):  # type: ignore[misc]  # uvicorn.Server, imported lazily
        """uvicorn's server, stopped by SIGTERM/SIGINT through the loop (exit status 0).

        uvicorn re-raises the signal after its graceful shutdown, which would end the CLI with
        status -15 instead of printing its last line and exiting 0 like ``sdcore relay``.
        """

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
            try:
                yield
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)

        def stop(self) -> None:
            self.should_exit = True

    return Server


def register(subparsers: Any) -> None:
    """Add ``sdcore dashboard`` to the top-level subparsers."""
    parser = add_command(
        subparsers,
        "dashboard",
        _dashboard_command,
        help="serve the web dashboard: schedules, runs, leases, outbox, queues",
        description=(
            "Serve the dashboard over HTTP until SIGTERM. Read-only unless "
            f"${TOKEN_ENV} holds an operator token (at least 16 characters): operators sign in "
            "with it to pause, resume, trigger, backfill and retry outbox rows."
        ),
    )
    connection_options(parser)
    parser.add_argument(
        "--database-url-file",
        metavar="PATH",
        help="read the database URL from this file (e.g. a mounted secret) instead",
    )
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="show BullMQ queues of this Redis (default: $REDIS_URL)",
    )
    parser.add_argument(
        "--redis-url-file", metavar="PATH", help="read the Redis URL from this file instead"
    )
    parser.add_argument(
        "--queue-prefix",
        type=_queue_prefix,
        default="bull",
        help="BullMQ key prefix (default: bull)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=int_in(1, 65_535),
        default=DEFAULT_PORT,
        help=f"port (default: {DEFAULT_PORT})",
    )
    outbox_table_option(parser)
    parser.add_argument(
        "--refresh",
        type=int_in(0, 3_600),
        default=10,
        metavar="SECONDS",
        help="browsers refresh the tables this often; 0: never (default: 10)",
    )
    parser.add_argument(
        "--read-only", action="store_true", help=f"ignore ${TOKEN_ENV}: no actions at all"
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        type=_host_name,
        default=[],
        metavar="NAME",
        help=(
            "also answer requests for this host name (repeatable; '*': any). Default: "
            "127.0.0.1, localhost, ::1 and --host; any other Host header gets 400"
        ),
    )
    parser.add_argument(
        "--forwarded-allow-ips",
        metavar="IPS",
        help=(
            "trust X-Forwarded-Proto/-For from these proxy addresses (comma-separated, '*': "
            "any): behind a TLS proxy the session cookie is then Secure"
        ),
    )


def _host_name(text: str) -> str:
    """An ``--allowed-host`` value: a host name or address, optionally with a port, or ``*``."""
    name = text.strip()
    if not name or len(name) > 255 or any(c.isspace() or c in "/@\x00" for c in name):
        raise argparse.ArgumentTypeError(
            f"invalid host name {text[:60]!r}: expected e.g. dash.example.com, 10.0.0.7 or '*'"
        )
    return name


def _queue_prefix(text: str) -> str:
    """A ``--queue-prefix`` value: BullMQ's key prefix, non-empty and without NUL."""
    if not text or "\x00" in text:
        raise argparse.ArgumentTypeError(f"invalid prefix {text[:60]!r}: expected e.g. bull")
    return text


def _dashboard_command(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    run_dashboard(args, environ, emit)


def run_dashboard(args: argparse.Namespace, environ: Mapping[str, str], emit: Emit) -> None:
    """Serve the dashboard until SIGTERM / SIGINT, on the pool of a (scheduler-less) Runtime.

    Raises:
        CliError: The extra is missing, the token is too short or predictable, or the database
            is unreachable.
        UsageError: No database URL, or a ``--database-url-file`` / ``--redis-url-file`` that
            cannot be read.
    """
    try:
        import uvicorn

        from sdcore.dashboard import DashboardError, dashboard_app
    except ImportError as exc:
        raise CliError(
            f"the dashboard needs its extra: pip install 'sdcore[dashboard]' ({exc})"
        ) from None
    from sdcore.outbox import Outbox

    _warn_secrets_in_argv(args)
    database_file = _read_url_file(args.database_url_file, "--database-url-file")
    if database_file is not None and not args.database_url:
        environ = {**environ, "DATABASE_URL": database_file}
    target = target_of(args, environ)
    token = None if args.read_only else (environ.get(TOKEN_ENV) or None)
    redis_url = (
        args.redis_url
        or _read_url_file(args.redis_url_file, "--redis-url-file")
        or environ.get("REDIS_URL")
        or None
    )
    if redis_url is not None:
        check_queue_prefix("--queue-prefix", redis_url, args.queue_prefix)
    hosts = [*LOOPBACK_HOSTS, *args.allowed_host]
    if args.host not in WILDCARD_HOSTS:
        hosts.append(args.host)

    async def serve() -> None:
        async with started_runtime(
            target, pool_max_size=POOL_SIZE, application_name="sdcore-dashboard"
        ) as runtime:
            try:
                app = dashboard_app(
                    runtime.pool,
                    token=token,
                    redis_url=redis_url,
                    queue_prefix=args.queue_prefix,
                    lease_table=args.table,
                    schema=args.schema,
                    outbox=Outbox(table=args.outbox_table, schema=args.schema),
                    refresh_s=args.refresh,
                    allowed_hosts=hosts,
                )
            except DashboardError as exc:
                raise CliError(f"{TOKEN_ENV}: {exc}") from None
            mode = "operators sign in with the token" if token else "read-only"
            emit(f"dashboard on http://{escape(args.host)}:{args.port}/ ({mode}); SIGTERM stops")
            proxied = args.forwarded_allow_ips is not None
            config = uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level="warning",
                proxy_headers=proxied,
                forwarded_allow_ips=args.forwarded_allow_ips if proxied else None,
                server_header=False,
            )
            await _server(uvicorn.Server)(config).serve()
        emit("dashboard stopped")

    asyncio.run(serve())


def _read_url_file(path: str | None, option: str) -> str | None:
    """The URL in ``path`` (its first line, stripped), or ``None`` without the option.

    Raises:
        UsageError: The file cannot be read or is empty (the message never quotes it).
    """
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"{option}: cannot read {path!r}: {reason}") from None
    lines = text.strip().splitlines()
    if not lines or not lines[0].strip():
        raise UsageError(f"{option}: {path!r} is empty")
    return lines[0].strip()


def _redis_url_has_password(url: str) -> bool:
    """Whether a Redis URL carries a password: in its userinfo or as ``?password=`` (redis-py
    reads both, for ``redis://``, ``rediss://`` and ``unix://``)."""
    try:
        parts = urlsplit(url)
        if parts.password:
            return True
        query = parse_qs(parts.query, keep_blank_values=True)
    except ValueError:
        return False
    secrets = {"password", "sentinel_password"}
    return any(name.strip().lower() in secrets and any(values) for name, values in query.items())


def _warn_secrets_in_argv(args: argparse.Namespace) -> None:
    """Warn (stderr) when ``--database-url`` or ``--redis-url`` carries a password: every local
    user can read a command line (``ps``), not the environment or a file."""
    leaks = []
    if args.database_url:
        try:
            if conninfo_to_dict(args.database_url).get("password"):
                leaks.append("--database-url")
        except PsycopgError:
            pass  # reported by the target's own check
    if args.redis_url and _redis_url_has_password(args.redis_url):
        leaks.append("--redis-url")
    for option in leaks:
        name = "DATABASE_URL" if option == "--database-url" else "REDIS_URL"
        print(
            f"sdcore: warning: {option} holds a password, which other users of this machine "
            f"can read in the process list: set {name} or use {option}-file instead",
            file=sys.stderr,
        )
