"""Owners with real OS processes on PostgreSQL: an owner killed -9 leaves its schedule's ticks to
the second owner at once, and no tick runs twice.

Four replica processes, each its own pool, ``Scheduler`` and ``ScheduleControl`` (heartbeat every
500 ms), declare the same three per-second exclusive schedules; each run prints one JSON line
(schedule, run key, replica id, lateness). The test computes each schedule's owners itself from
the replica ids (the rendezvous order of ``sdcore.scheduling._owners``: the ticks of one instant
share their owners), kills the first owner of an instant 0.4 s before it with SIGKILL, and checks
who runs the ticks after that: the second owner, while the
others' views still hold the dead replica (its heartbeat TTL is 1.5 s), and each tick once.

Lateness is printed, not asserted: speed is the benchmark's (``benchmarks/fleet.py``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from sdcore.scheduling._owners import OWNERS, Member, Owners

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMES = ["beat-0", "beat-1", "beat-2"]

REPLICA = r"""
import asyncio, json, os, sys, time
from psycopg_pool import AsyncConnectionPool
from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import PostgresScheduleStore, ScheduleControl, Scheduler

async def main(dsn, seconds):
    kwargs = {"autocommit": True}
    async with AsyncConnectionPool(dsn, min_size=1, max_size=4, kwargs=kwargs) as pool:
        jobs = JobSchedulerService(pool, max_connections=2)
        store = PostgresScheduleStore(pool)
        scheduler = Scheduler(jobs=jobs, lease_ms=2_000)
        control = ScheduleControl(scheduler, store, poll_interval_ms=200, heartbeat_ms=500)
        for name in sys.argv[3].split(","):
            async def beat(tick):
                print(json.dumps({
                    "schedule": tick.schedule, "run_key": tick.run_key,
                    "replica": control.replica.replica_id,
                    "late": time.time() - tick.scheduled_at.timestamp(),
                }), flush=True)
            scheduler.add_interval(name, 1_000, beat)
        async with control, scheduler:
            print(json.dumps({"up": control.replica.replica_id}), flush=True)
            await asyncio.sleep(seconds)

asyncio.run(main(sys.argv[1], float(sys.argv[2])))
"""


def _spawn(dsn: str, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", REPLICA, dsn, str(seconds), ",".join(NAMES)],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _owners(instant: float, replicas: list[str]) -> list[str]:
    """The replicas in the order they own the ticks at ``instant`` (epoch seconds), as each
    computes it with the full view."""
    at = datetime.fromtimestamp(instant, UTC)
    ranks = []
    for me in replicas:
        view = Owners(me, stale_s=60.0)
        view.update(Member(r) for r in replicas)
        ranks.append((view.fire_rank(NAMES[0], at), me))
    return [me for _, me in sorted(ranks)]


async def _schema(dsn: str) -> None:
    from psycopg_pool import AsyncConnectionPool

    from sdcore.job_scheduler import JobSchedulerService
    from sdcore.scheduling import PostgresScheduleStore

    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, kwargs={"autocommit": True}) as p:
        await JobSchedulerService(p).ensure_schema()
        await PostgresScheduleStore(p).ensure_schema()


@pytest.mark.timeout(120)
def test_an_owner_killed_9_leaves_its_ticks_to_the_second_owner_and_none_runs_twice(
    pg_dsn: str,
) -> None:
    import asyncio

    asyncio.run(_schema(pg_dsn))
    processes = [_spawn(pg_dsn, 9.0) for _ in range(4)]
    lines: dict[int, list[dict[str, Any]]] = {i: [] for i in range(4)}
    ids: dict[int, str] = {}
    try:
        for i, process in enumerate(processes):
            assert process.stdout is not None
            first = json.loads(process.stdout.readline())
            ids[i] = first["up"]
        time.sleep(3.0)  # every replica has read every other's heartbeat (each 500 ms)
        # The victim: the first owner of the instant after the next (killed before it).
        target = float(math.ceil(time.time()) + 1)
        order = _owners(target, list(ids.values()))
        victim = next(i for i, r in ids.items() if r == order[0])
        time.sleep(max(0.0, target - 0.4 - time.time()))  # killed 0.4 s before its instant
        processes[victim].send_signal(signal.SIGKILL)
        killed = time.time()
        outputs = {}
        for i, process in enumerate(processes):
            out, err = process.communicate(timeout=60)
            outputs[i] = (process.returncode, out, err)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for i, (code, out, err) in outputs.items():
        if i == victim:
            assert code == -signal.SIGKILL
        else:
            assert code == 0, err[-3000:]
        lines[i] = [json.loads(x) for x in out.splitlines() if x.strip() and "run_key" in x]
    runs = [r for i in lines for r in lines[i]]
    per_tick = Counter((r["schedule"], r["run_key"]) for r in runs)
    assert set(per_tick.values()) == {1}, "a tick ran twice"
    # Every tick ran on one of its instant's owners (the first, unless it was slow or killed),
    # never on the killed replica after the kill (within its heartbeat TTL, 1.5 s, the others'
    # views still hold it).
    replicas = list(ids.values())
    for r in runs:
        at = _instant(r["run_key"])
        if not killed - 2.0 < at < killed + 1.5:
            continue  # start-up (views incomplete) or after the TTL
        owners = _owners(at, replicas)[:OWNERS]
        assert r["replica"] in owners, (r, owners)
        if at > killed:
            assert r["replica"] != order[0], r
    late = [round(r["late"], 3) for r in runs if _instant(r["run_key"]) == target]
    assert len(late) == len(NAMES), "a tick of the killed owner's instant did not run"
    print(f"the killed owner's instant ran on its second owner, late {late} s")  # noqa: T201


def _instant(run_key: str) -> float:
    return datetime.fromisoformat(run_key.replace("Z", "+00:00")).timestamp()
