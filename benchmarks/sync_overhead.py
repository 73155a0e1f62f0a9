"""What blocking code pays for the lease: ``sdcore.sync`` ``run_exclusive`` cycles next to async.

A *cycle* is one ``run_exclusive`` of a fresh run key whose function returns at once: the
acquire, the call, and the ``SUCCESS`` finalize, each statement its own durable transaction.

It is measured on the configuration users run: two replicas of one service on one database,
each a runtime with the control plane on and the same ``--schedules`` per-second exclusive
schedules (whose ticks go on throughout, split between the two):

- an ``sdcore.Runtime`` on the event loop of the main thread;
- an ``sdcore.sync.Runtime`` (its own portal thread, plain handlers in its handler threads).

Three workloads run cycles on ``runtime.jobs`` with N concurrent callers:

``async``
    N asyncio tasks on the async runtime's loop, each running
    ``await runtime.jobs.run_exclusive(options, fn)`` with an ``async def fn``: what an asyncio
    application pays.
``async-thread``
    The same, with a plain ``def fn`` (the async core runs it in the loop's default executor):
    the two thread hops per cycle an asyncio application pays for a blocking function; shown
    for context, the target is against ``async``.
``sync``
    N threads sharing the sync runtime's ``runtime.jobs``, each running
    ``runtime.jobs.run_exclusive(options, fn)`` with a plain ``def fn``, called in that
    thread: the blocking facade's cost on top of the same async core (the hop to the portal's
    loop and back, and the function handed back to the calling thread). The async runtime's
    loop keeps running meanwhile (the sync callers are started from it, in threads).

Each runtime has a pool of its own of N + 3 connections. The workloads alternate in slices of
``--cycles`` cycles per caller (async, sync, async-thread, then the reverse, …) for ``--rounds``
rounds, so load from elsewhere on a shared machine hits them alike; each round's ratio is sync ÷
async throughput, and the script prints the median and the range over rounds. The target is
sync ≥ 0.8× async. It exits 0 whatever the figures (a benchmark, not a test).

Usage::

    python benchmarks/sync_overhead.py [--database-url URL] [--cycles C] [--rounds R]
                                       [--clients 1,4] [--schedules S]

A scratch database is created on the server and dropped at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import base_parser, scratch_database

from sdcore import Runtime, job_scheduler, sync
from sdcore.job_scheduler import JobExecutionLease
from sdcore.postgres import PoolSettings
from sdcore.scheduling import Tick

TARGET = 0.8
# (async, sync, async-thread) cycles per second, one tuple per round.
Rounds = list[tuple[float, float, float]]
_keys = itertools.count()


def _options(kind: str) -> dict[str, object]:
    return {"code": f"bench-{kind}", "run_key": str(next(_keys)), "lease_ms": 30_000}


async def _async_slice(
    service: job_scheduler.JobSchedulerService, clients: int, cycles: int, *, plain: bool = False
) -> float:
    async def awaited(lease: JobExecutionLease) -> int:
        return lease.fencing_token

    def threaded(lease: JobExecutionLease) -> int:
        return lease.fencing_token

    fn: Callable[[JobExecutionLease], Any] = threaded if plain else awaited

    async def caller() -> None:
        for _ in range(cycles):
            outcome = await service.run_exclusive(_options("async"), fn)
            assert outcome.acquired

    start = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(clients):
            group.create_task(caller())
    return clients * cycles / (time.perf_counter() - start)


def _sync_slice(jobs: sync.JobSchedulerService, clients: int, cycles: int) -> float:
    def fn(lease: JobExecutionLease) -> int:
        return lease.fencing_token

    def caller() -> None:
        for _ in range(cycles):
            outcome = jobs.run_exclusive(_options("sync"), fn)
            assert outcome.acquired

    threads = [threading.Thread(target=caller) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return clients * cycles / (time.perf_counter() - start)


def _declare(scheduler: Any, count: int, handler: Callable[[Tick], Any]) -> None:
    for n in range(count):
        scheduler.add_cron(f"bench-tick-{n}", "* * * * * *", handler, exclusive=True)


async def _measure(dsn: str, clients: int, cycles: int, rounds: int, schedules: int) -> Rounds:
    pool = PoolSettings(max_size=clients + 3)
    ticks = [0]

    async def async_tick(tick: Tick) -> None:
        ticks[0] += 1

    def sync_tick(tick: Tick) -> None:
        ticks[0] += 1

    aio = Runtime(dsn, pool=pool, grace_period_ms=2_000)
    _declare(aio.scheduler, schedules, async_tick)
    blocking = sync.Runtime(dsn, pool=pool, grace_period_ms=2_000, stop_on_sigterm=False)
    _declare(blocking.scheduler, schedules, sync_tick)
    await aio.start()
    try:
        await asyncio.to_thread(blocking.start)
        try:
            # Warm both (connections configured, statements prepared) before timing anything.
            await _async_slice(aio.jobs, clients, 20)
            await asyncio.to_thread(_sync_slice, blocking.jobs, clients, 20)
            results: Rounds = []
            for n in range(rounds):
                rates: dict[str, float] = {}
                order = ["async", "sync", "async-thread"]
                for kind in order if n % 2 == 0 else reversed(order):
                    if kind == "sync":
                        rates[kind] = await asyncio.to_thread(
                            _sync_slice, blocking.jobs, clients, cycles
                        )
                    else:
                        rates[kind] = await _async_slice(
                            aio.jobs, clients, cycles, plain=kind != "async"
                        )
                results.append((rates["async"], rates["sync"], rates["async-thread"]))
        finally:
            await asyncio.to_thread(blocking.stop)
    finally:
        await aio.stop()
    print(f"clients={clients}: {ticks[0]} ticks ran beside the cycles")
    return results


def main() -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--cycles", type=int, default=300, help="cycles per caller per slice")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds")
    parser.add_argument("--clients", default="1,4", help="comma-separated caller counts")
    parser.add_argument(
        "--schedules", type=int, default=5, help="per-second exclusive schedules on each runtime"
    )
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    with scratch_database(args.database_url, "sdcore_bench_sync") as dsn:
        for clients in (int(c) for c in args.clients.split(",")):
            results = asyncio.run(_measure(dsn, clients, args.cycles, args.rounds, args.schedules))
            ratios = [s / a for a, s, _ in results]
            versus_thread = [s / t for _, s, t in results]
            async_rate = statistics.median(a for a, _, _ in results)
            sync_rate = statistics.median(s for _, s, _ in results)
            thread_rate = statistics.median(t for _, _, t in results)
            ratio = statistics.median(ratios)
            verdict = "met" if ratio >= TARGET else "missed"
            print(
                f"clients={clients}: async {async_rate:,.0f} cycles/s, sync {sync_rate:,.0f} "
                f"cycles/s; sync/async median {ratio:.2f}x (rounds {min(ratios):.2f}-"
                f"{max(ratios):.2f}); target >= {TARGET}x: {verdict}"
            )
            print(
                f"clients={clients}: async-thread {thread_rate:,.0f} cycles/s; sync/async-thread "
                f"median {statistics.median(versus_thread):.2f}x (rounds "
                f"{min(versus_thread):.2f}-{max(versus_thread):.2f})"
            )
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
