"""Gunicorn settings for the Flask example: every worker runs the sdcore runtime.

The app module is imported once in the master (``preload_app``: the runtime is built there, with
no thread and no connection), each worker starts it after the fork and stops it on its way out.
"""

from __future__ import annotations

import os
from typing import Any

bind = os.environ.get("BIND", "127.0.0.1:8000")
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
preload_app = True
# Longer than the runtime's grace period (SDCORE_GRACE_MS, 10 s by default): a worker's stop
# must end before the master's SIGKILL.
graceful_timeout = int(os.environ.get("GRACEFUL_TIMEOUT", "30"))


def on_starting(server: Any) -> None:
    """In the master, once: the example's own tables."""
    from app import create_tables

    create_tables()


def post_fork(server: Any, worker: Any) -> None:
    """In each worker, just after the fork: start its runtime (threads and pools of its own)."""
    from app import runtime

    runtime.start()


def worker_exit(server: Any, worker: Any) -> None:
    """In each worker, on its way out (SIGTERM, SIGQUIT, max_requests): stop the runtime within
    its grace period (interpreter exit would too; this is the explicit, logged place)."""
    from app import runtime

    runtime.stop()
