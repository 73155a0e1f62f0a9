"""``python -m taskflow.replicas --replicas 3``: N TaskFlow replicas on one database, locally.

Starts ``python -m taskflow`` N times on consecutive ports (``--port``, ``--port``+1, …) against
one PostgreSQL (``--database-url``, else ``DATABASE_URL``, else an embedded PostgreSQL in a
temporary folder), waits until each answers ``/health``, prints their URLs, and stops them on
Ctrl-C or SIGTERM. Try ``TASKFLOW_OVERDUE_CRON="*/5 * * * * *"`` to watch ``mark-overdue-tasks``
run on one replica per tick.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from taskflow.settings import Settings, SettingsError

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m taskflow.replicas", description=__doc__)
    parser.add_argument("--replicas", type=int, default=3, help="how many (1-16, default 3)")
    parser.add_argument("--port", type=int, default=8000, help="first port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--database-url", default=None, help="default: $DATABASE_URL or embedded")
    parser.add_argument("--redis-url", default=None, help="default: $REDIS_URL (none: no queues)")
    parser.add_argument("--ready-timeout", type=float, default=60.0, help="seconds per replica")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the replicas until interrupted; return the exit status."""
    args = _parser().parse_args(argv)
    if not 1 <= args.replicas <= 16:
        print("taskflow.replicas: --replicas must be from 1 to 16", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.redis_url is not None:
        env["REDIS_URL"] = args.redis_url
    database = args.database_url or env.get("DATABASE_URL") or None
    try:  # the replicas would refuse to start: say why once, here
        Settings.from_env({**env, "DATABASE_URL": database or "postgresql://localhost/check"})
    except SettingsError as exc:
        print(f"taskflow.replicas: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with contextlib.ExitStack() as stack:
        if database is None:
            from sdcore.demo import embedded_postgres

            print("no DATABASE_URL: starting an embedded PostgreSQL…", flush=True)
            database = stack.enter_context(embedded_postgres())
        env["DATABASE_URL"] = database
        return _run(args, env, stop)


def _run(args: argparse.Namespace, env: dict[str, str], stop: threading.Event) -> int:
    path = [str(_PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for number in range(1, args.replicas + 1):
            port = args.port + number - 1
            child_env = {
                **env,
                "TASKFLOW_REPLICA_NAME": f"replica-{number}",
                "PYTHONPATH": os.pathsep.join(path),
            }
            command = [sys.executable, "-m", "taskflow", "--host", args.host, "--port", str(port)]
            # Own session: Ctrl-C reaches this runner only, which then stops each replica once
            # (a second signal would make uvicorn skip its graceful shutdown).
            processes.append(subprocess.Popen(command, env=child_env, start_new_session=True))  # noqa: S603
        for number, process in enumerate(processes, start=1):
            url = f"http://{args.host}:{args.port + number - 1}"
            if not _wait_ready(url, process, stop, args.ready_timeout):
                if not stop.is_set():
                    print(f"replica-{number} did not start ({url})", file=sys.stderr, flush=True)
                return 1
            print(f"replica-{number}: {url} (pid {process.pid})", flush=True)
        print(f"{len(processes)} replica(s) ready; Ctrl-C stops them", flush=True)
        while not stop.wait(0.5):
            for number, process in enumerate(processes, start=1):
                if process.poll() is not None:
                    print(f"replica-{number} exited ({process.returncode})", file=sys.stderr)
                    return 1
        return 0
    finally:
        _stop_all(processes)


def _wait_ready(
    url: str, process: subprocess.Popen[bytes], stop: threading.Event, timeout: float
) -> bool:
    deadline = time.monotonic() + timeout
    while not stop.is_set() and time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):  # noqa: S310 - our own URL
                return True
        except urllib.error.HTTPError:
            return True  # 503 "degraded" (Redis down…) still means the replica is serving
        except OSError:
            stop.wait(0.2)
    return False


def _stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if processes:
        print("replicas stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
