"""Owners with real OS processes on PostgreSQL: an owner killed -9 leaves its schedule's ticks to
the second owner at once, and no tick runs twice.

Four replica processes, each its own pool, ``Scheduler`` and ``ScheduleControl`` (heartbeat every
500 ms), declare the same three per-second exclusive schedules; each run prints one JSON line
(schedule, run key, replica id, lateness). The test computes each schedule's owners itself from
the replica ids (the rendezvous order of ``sdcore.scheduling._owners``), kills the first owner of
``beat-0`` with SIGKILL, and checks who runs the ticks after that: the second owner, while the
others' views still hold the dead replica (its heartbeat TTL is 1.5 s), and each tick once.

Lateness is printed, not asserted: speed is the benchmark's (``benchmarks/fleet.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sdcore.scheduling._owners import Member, Owners

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


def _owners(name: str, replicas: list[str]) -> list[str]:
    """``name``'s replicas in rank order, as each replica computes it with the full view."""
    ranks = []
    for me in replicas:
        view = Owners(me, stale_s=60.0)
        view.update(Member(r) for r in replicas)
        ranks.append((view.rank(name), me))
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
        order = _owners("beat-0", list(ids.values()))
        victim = next(i for i, r in ids.items() if r == order[0])
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
    # The ticks of beat-0 in the TTL after the kill ran on its second owner, a delay late.
    after = sorted(
        (r["run_key"], r["replica"], r["late"])
        for r in runs
        if r["schedule"] == "beat-0" and killed + 0.2 < _instant(r["run_key"]) < killed + 1.5
    )
    assert after, "no tick of beat-0 ran after the kill"
    assert {replica for _, replica, _ in after} == {order[1]}
    print(f"beat-0 after its first owner was killed: late {[round(x[2], 3) for x in after]} s")  # noqa: T201
    # Once every view was complete, and before the kill, each schedule ran on its first owner.
    for name in NAMES:
        first = _owners(name, list(ids.values()))[0]
        before = [
            r
            for r in runs
            if r["schedule"] == name and killed - 2.0 < _instant(r["run_key"]) < killed - 0.5
        ]
        assert before
        assert {r["replica"] for r in before} <= {first}


def _instant(run_key: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(run_key.replace("Z", "+00:00")).timestamp()
