"""``sdcore run MODULE:ATTR``: run an application's Runtime (or Scheduler) as a worker process.

Like ``celery -A app worker`` or ``procrastinate worker``: the application declares its schedules,
processors and outbox on a :class:`~sdcore.runtime.Runtime` at import time, and this command runs
the parts that belong in a long-lived process until SIGTERM or SIGINT, then stops them gracefully
(running ticks and jobs get the Runtime's grace period).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdcore.cli import _metrics
from sdcore.cli._app_import import ProgramStartedError, import_app_module, program_started_message
from sdcore.cli._format import emit, escape, one_line
from sdcore.cli._options import add_command, logging_options
from sdcore.cli._target import CliError
from sdcore.postgres import redact_text

MAX_FACTORY_DEPTH = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """What ``sdcore run`` runs, and how it reports readiness."""

    spec: str
    scheduler: bool = True
    relay: bool = True
    processors: bool = True
    ready_file: Path | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


def load(spec: str) -> object:
    """Import ``module:attr`` (``attr`` may be dotted) and return the object.

    The current directory is put first on ``sys.path``, as ``python -m`` and ``uvicorn`` do, so
    ``sdcore run app:runtime`` finds ``./app.py``.

    Raises:
        CliError: A malformed spec, a module that does not import, or a missing attribute.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"{escape(spec)!s}: expected MODULE:ATTR, e.g. myapp.worker:runtime")
    try:
        target: object = import_app_module(module_name)
    except ProgramStartedError as exc:
        raise CliError(program_started_message(module_name, exc)) from None
    except ImportError as exc:
        raise CliError(f"cannot import {escape(module_name)}: {one_line(str(exc))}") from None
    except Exception as exc:  # noqa: BLE001 - the application's import-time error, one line
        detail = one_line(redact_text(f"{type(exc).__name__}: {exc}"))
        raise CliError(f"importing {escape(module_name)} failed: {detail}") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise CliError(f"{escape(module_name)} has no attribute {escape(attr)}") from None
    return target


async def _resolve(obj: object, spec: str) -> Any:
    from sdcore.runtime import Runtime
    from sdcore.scheduling import Scheduler

    called = False
    for _ in range(MAX_FACTORY_DEPTH):
        state = getattr(obj, "state", None)
        installed = getattr(state, "sdcore", None) if state is not None else None
        if isinstance(installed, Runtime):
            return installed
        if isinstance(obj, Runtime | Scheduler):
            return obj
        if not callable(obj):
            break
        called = True
        try:
            obj = obj()
            if inspect.isawaitable(obj):
                obj = await obj
        except Exception as exc:  # noqa: BLE001 - the application's factory failed
            detail = one_line(redact_text(f"{type(exc).__name__}: {exc}"))
            raise CliError(f"{escape(spec)}() failed: {detail}") from None
    what = "returned None" if obj is None and called else f"is a {type(obj).__name__}"
    raise CliError(
        f"{escape(spec)}{'()' * called} {what}: name a sdcore Runtime, a Scheduler, an app "
        "that sdcore.fastapi.install() was called on, or a factory returning one"
    )


def describe(target: Any, options: RunOptions) -> str:
    """The one-line readiness report."""
    from sdcore.runtime import Runtime

    probes = ""
    if options.metrics_port is not None:
        host = options.metrics_host
        shown_host = f"[{host}]" if ":" in host else host
        probes = f"; /livez /readyz /metrics on http://{shown_host}:{options.metrics_port}"
    if not isinstance(target, Runtime):
        return f"ready: {escape(options.spec)} (scheduler){probes}; SIGTERM stops"
    parts = [f"scheduler {'on' if target.run_scheduler else 'off'}"]
    if target.queues_enabled:
        parts.append(f"relay {'on' if target.run_relay else 'off'}")
        shown = len(target.processors) if target.run_processors else 0
        parts.append(f"processors {shown}")
    else:
        parts.append("queues off (no redis_url)")
    return f"ready: {escape(options.spec)} ({', '.join(parts)}){probes}; SIGTERM stops"


def run_app(options: RunOptions, emit: Callable[[str], None]) -> None:
    """Run the application's Runtime or Scheduler until SIGTERM/SIGINT.

    Raises:
        CliError: The spec does not resolve, or the Runtime does not start (one line, redacted).
    """
    obj = load(options.spec)
    asyncio.run(_run(obj, options, emit))


async def _run(obj: object, options: RunOptions, emit: Callable[[str], None]) -> None:
    from sdcore.runtime import Runtime

    target = await _resolve(obj, options.spec)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if isinstance(target, Runtime):
        # The command line can turn a component off, never on: what the Runtime was built
        # without (``scheduling=None``, ``relay=None``) stays off.
        target.run_scheduler = target.run_scheduler and options.scheduler
        target.run_relay = target.run_relay and options.relay
        target.run_processors = target.run_processors and options.processors
    _metrics.prepare(target, options.metrics_port)
    try:
        await target.__aenter__()
    except Exception as exc:  # noqa: BLE001 - start-up failure as one line
        detail = one_line(redact_text(f"{type(exc).__name__}: {exc}"))
        raise CliError(f"{escape(options.spec)} did not start: {detail}") from None
    try:
        async with _metrics.serving(target, options.metrics_port, options.metrics_host):
            if options.ready_file is not None:
                options.ready_file.write_text(f"{os.getpid()}\n", encoding="utf-8")
            emit(describe(target, options))
            await stop.wait()
            emit("stopping: running ticks and jobs get the grace period…")
    finally:
        if options.ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                options.ready_file.unlink()
        await target.__aexit__(None, None, None)
    emit("stopped")


def register(subparsers: Any) -> None:
    """Add ``sdcore run MODULE:ATTR``."""
    run = add_command(
        subparsers,
        "run",
        _run_command,
        help="run an application's Runtime (schedules, relay, processors) until SIGTERM",
        description=(
            "Import MODULE:ATTR — a sdcore Runtime, a Scheduler, an app with sdcore installed, or "
            "a factory returning one — and run it as a long-lived worker process. SIGTERM or "
            "SIGINT stops it gracefully."
        ),
    )
    run.add_argument("app", metavar="MODULE:ATTR", help="e.g. myapp.worker:runtime")
    logging_options(run)
    run.add_argument("--no-scheduler", action="store_true", help="do not run the schedules")
    run.add_argument("--no-relay", action="store_true", help="do not run the outbox relay")
    run.add_argument("--no-processors", action="store_true", help="do not run the queue processors")
    _metrics.add_run_arguments(run)  # --metrics-port, --metrics-host
    run.add_argument(
        "--ready-file",
        metavar="PATH",
        help="write the pid here once started, remove it at exit (for an exec readiness probe)",
    )


def _run_command(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    options = RunOptions(
        spec=args.app,
        scheduler=not args.no_scheduler,
        relay=not args.no_relay,
        processors=not args.no_processors,
        ready_file=Path(args.ready_file) if args.ready_file else None,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    run_app(options, emit)
