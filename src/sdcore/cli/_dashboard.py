"""``sdcore dashboard``: serve the web dashboard (``sdcore[dashboard]``) until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from sdcore.cli._db import CliError, resolve_dsn
from sdcore.cli._format import escape
from sdcore.cli._parser import _identifier, _int_in

TOKEN_ENV = "SDCORE_DASHBOARD_TOKEN"  # noqa: S105 - the variable's name, not a secret
DEFAULT_PORT = 8089
OPEN_TIMEOUT_S = 10
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


def register(
    commands: Any, connection_options: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Add ``sdcore dashboard`` to the top-level subparsers."""
    parser = commands.add_parser(
        "dashboard",
        help="serve the web dashboard: schedules, runs, leases, outbox, queues",
        description=(
            "Serve the dashboard over HTTP until SIGTERM. Read-only unless "
            f"${TOKEN_ENV} holds an operator token (at least 16 characters): operators sign in "
            "with it to pause, resume, trigger, backfill and retry outbox rows."
        ),
    )
    connection_options(parser)
    parser.add_argument("--redis-url", metavar="URL", help="show BullMQ queues of this Redis")
    parser.add_argument("--queue-prefix", default="bull", help="BullMQ key prefix (default: bull)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=_int_in(1, 65_535),
        default=DEFAULT_PORT,
        help=f"port (default: {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--outbox-table",
        type=_identifier("outbox table"),
        default="outbox",
        metavar="NAME",
        help="outbox table name (default: outbox; in --schema)",
    )
    parser.add_argument(
        "--refresh",
        type=_int_in(0, 3_600),
        default=10,
        metavar="SECONDS",
        help="browsers refresh the tables this often; 0: never (default: 10)",
    )
    parser.add_argument(
        "--read-only", action="store_true", help=f"ignore ${TOKEN_ENV}: no actions at all"
    )


def run_dashboard(args: argparse.Namespace, environ: Mapping[str, str], emit: Emit) -> None:
    """Serve the dashboard until SIGTERM / SIGINT.

    Raises:
        CliError: The extra is missing, the token is too short, or the database is unreachable.
    """
    try:
        import uvicorn

        from sdcore.dashboard import DashboardError, dashboard_app
    except ImportError as exc:
        raise CliError(
            f"the dashboard needs its extra: pip install 'sdcore[dashboard]' ({exc})"
        ) from None
    from sdcore.outbox import Outbox
    from sdcore.postgres import DatabaseConnectError, PoolSettings, create_pool, open_pool

    dsn = resolve_dsn(args.database_url, environ)
    token = None if args.read_only else (environ.get(TOKEN_ENV) or None)
    redis_url = args.redis_url or None

    async def serve() -> None:
        settings = PoolSettings(
            min_size=1,
            max_size=4,
            application_name="sdcore-dashboard",
            open_timeout_ms=OPEN_TIMEOUT_S * 1000,
        )
        pool = create_pool(dsn, settings)
        try:
            await open_pool(pool)
        except DatabaseConnectError as exc:
            raise CliError(f"cannot connect to the database: {exc.reason}") from None
        async with pool:
            try:
                app = dashboard_app(
                    pool,
                    token=token,
                    redis_url=redis_url,
                    queue_prefix=args.queue_prefix,
                    lease_table=args.table,
                    schema=args.schema,
                    outbox=Outbox(table=args.outbox_table, schema=args.schema),
                    refresh_s=args.refresh,
                )
            except DashboardError as exc:
                raise CliError(f"{TOKEN_ENV}: {exc}") from None
            mode = "operators sign in with the token" if token else "read-only"
            emit(f"dashboard on http://{escape(args.host)}:{args.port}/ ({mode}); SIGTERM stops")
            config = uvicorn.Config(
                app, host=args.host, port=args.port, log_level="warning", proxy_headers=False
            )
            await _server(uvicorn.Server)(config).serve()
        emit("dashboard stopped")

    asyncio.run(serve())
