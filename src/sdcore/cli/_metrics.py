"""``sdcore run … --metrics-port PORT``: probes and Prometheus metrics of the running Runtime.

The port serves ``GET /livez``, ``GET /readyz`` and ``GET /metrics`` (see :mod:`sdcore.probes`)
for as long as the runtime runs. Metrics are turned on for the application's Runtime when it
was built without them and ``prometheus-client`` is installed (``sdcore[metrics]``); without
it the probes are still served and ``/metrics`` answers 404.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--metrics-port`` and ``--metrics-host`` to ``sdcore run``."""

    def port(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a port number: {text!r:.40}") from None
        if not 1 <= number <= 65535:
            raise argparse.ArgumentTypeError(f"port must be from 1 to 65535, got {number}")
        return number

    group = parser.add_argument_group("monitoring")
    group.add_argument(
        "--metrics-port",
        type=port,
        metavar="PORT",
        help="serve /livez, /readyz and /metrics (Prometheus) on this port while running",
    )
    group.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help=(
            "address to bind the monitoring port to (default: 127.0.0.1; 0.0.0.0 for the "
            "kubelet's probes and Prometheus from other hosts)"
        ),
    )


def prepare(target: Any, port: int | None) -> None:
    """Before start: turn the Runtime's metrics on when they are off and can be."""
    from sdcore.runtime import Runtime

    if port is None:
        return
    if importlib.util.find_spec("prometheus_client") is not None:
        import prometheus_client

        # This process is the CLI's: its scrape carries no `*_created` series (one per counter
        # and histogram child, which dashboards never read). A library leaves that to its host.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    if not isinstance(target, Runtime):
        return
    if target.metrics is None and importlib.util.find_spec("prometheus_client") is not None:
        target.instrument(metrics=True)


@asynccontextmanager
async def serving(target: Any, port: int | None, host: str) -> AsyncIterator[None]:
    """Serve the monitoring endpoints of a started Runtime while the block runs."""
    from sdcore.cli._target import CliError
    from sdcore.probes import serve
    from sdcore.runtime import Runtime

    if port is None:
        yield
        return
    if not isinstance(target, Runtime):
        raise CliError("--metrics-port needs a Runtime (a bare Scheduler has no probes)")
    try:
        server = await serve(target, host=host, port=port)
    except OSError as exc:
        raise CliError(f"cannot serve monitoring on {host}:{port}: {exc.strerror}") from None
    try:
        yield
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), timeout=5)
