"""The plan the cluster walk's replicas (tests/acceptance/_walk_app.py) and its test share: the
code schedules, their leases and retries, and each run's fate."""

from __future__ import annotations

import hashlib
import os

SEED = int(os.environ.get("SDCORE_WALK_SEED", "1"))
LEASE_MS = 3_000
# The code schedules: name -> (every_ms, retries); the test reads this too.
CODE = {"beat": (1_000, 0), "flaky": (1_000, 2)}
RETRY_BACKOFF_MS = 300
STORED_HANDLER = "work"


class PlannedFailure(RuntimeError):
    """The failure :func:`fate` asked for."""


def fate(seed: int, schedule: str, run_key: str, attempt: int) -> tuple[str, float]:
    """``("fail" | "ok", seconds of work)`` for one run: 15 % fail, 10 % are slow (1.4 s)."""
    digest = hashlib.sha256(f"{seed}|{schedule}|{run_key}|{attempt}".encode()).digest()
    roll = digest[0] % 20
    if roll < 3:
        return "fail", 0.05
    if roll < 5:
        return "ok", 1.4
    return "ok", 0.1
