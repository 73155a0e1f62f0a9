"""``sdcore dashboard``: serve the web dashboard (``sdcore[dashboard]``) until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from sdcore.cli._format import emit, escape
from sdcore.cli._options import add_command, connection_options, int_in, outbox_table_option
from sdcore.cli._target import CliError, started_runtime, target_of

TOKEN_ENV = "SDCORE_DASHBOARD_TOKEN"  # noqa: S105 - the variable's name, not a secret
DEFAULT_PORT = 8089
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
    parser.add_argument("--redis-url", metavar="URL", help="show BullMQ queues of this Redis")
    parser.add_argument("--queue-prefix", default="bull", help="BullMQ key prefix (default: bull)")
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


def _dashboard_command(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    run_dashboard(args, environ, emit)


def run_dashboard(args: argparse.Namespace, environ: Mapping[str, str], emit: Emit) -> None:
    """Serve the dashboard until SIGTERM / SIGINT, on the pool of a (scheduler-less) Runtime.

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

    target = target_of(args, environ)
    token = None if args.read_only else (environ.get(TOKEN_ENV) or None)
    redis_url = args.redis_url or None

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
