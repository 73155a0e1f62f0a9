"""Where a plain (non-``async``) function given to the lease runs.

``run_exclusive`` runs a plain function in a worker thread: the event loop's default executor,
unless the task that calls it set :data:`PLAIN_CALLS` — ``sdcore.sync`` sets it to an executor
that hands the function back to the blocking caller's own thread, so that the function sees that
thread's locals (a Flask app context, Django's per-thread connection) while the heartbeat and the
deadline run on the loop.
"""

from __future__ import annotations

from concurrent.futures import Executor
from contextvars import ContextVar

__all__ = ["PLAIN_CALLS"]

PLAIN_CALLS: ContextVar[Executor | None] = ContextVar("sdcore_plain_calls", default=None)
