"""``sdcore demo``: N replicas of one per-second schedule, one SIGKILLed, and a verdict."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Mapping
from typing import Any

from sdcore.cli._format import emit
from sdcore.cli._options import add_command, connection_options, int_in
from sdcore.cli._target import CliError


class DemoFailedError(CliError):
    """The demo's verdict found a doubled or missed tick."""


def register(subparsers: Any) -> None:
    """Add ``sdcore demo``."""
    demo = add_command(
        subparsers,
        "demo",
        _demo,
        help="run N replicas of one per-second schedule, kill one, and judge: each tick once?",
    )
    connection_options(demo)
    demo.add_argument(
        "--replicas", type=int_in(2, 16), default=3, metavar="N", help="replica processes (2..16)"
    )
    demo.add_argument(
        "--duration",
        type=int_in(10, 600),
        default=30,
        metavar="SECONDS",
        help="seconds of ticks to watch (10..600, default 30)",
    )
    demo.add_argument("--no-kill", action="store_true", help="do not SIGKILL a replica half-way")


def _demo(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    try:
        from sdcore.demo import DemoOptions, EmbeddedUnavailableError, run_demo
    except ImportError as exc:
        raise CliError(f"the demo needs its extra: pip install 'sdcore[demo]' ({exc})") from None
    if threading.current_thread() is threading.main_thread():
        # The banner promises Ctrl-C; a shell that starts jobs in the background (`nohup … &`,
        # CI wrappers) hands SIGINT over ignored, and Python then installs no KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    url = args.database_url or environ.get("DATABASE_URL") or None
    options = DemoOptions(
        replicas=args.replicas, duration_s=args.duration, database_url=url, kill=not args.no_kill
    )
    try:
        status = run_demo(options, emit)
    except (EmbeddedUnavailableError, RuntimeError, OSError) as exc:
        raise CliError(str(exc)) from None
    if status:
        raise DemoFailedError("the demo saw a tick run twice or not at all (see the verdict)")
