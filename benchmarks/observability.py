"""The cost of metrics: the lease cycle and the tick start latency with metrics on vs off.

Both measurements run in one process on one scratch database, alternating *off* and *on* slices
(``off, on, on, off, off, on…``, so drift and warm-up hit both sides alike); only the telemetry
hub of the same service and scheduler is swapped between slices, so everything else (pool,
connections, statements, the event loop) is identical.

``lease``
    ``--clients`` concurrent ``run_exclusive`` calls, each on a fresh run key with a trivial
    function: acquire, the function, complete — the path the lease's hooks sit on (lease
    acquired/released, heartbeat failures). Throughput (runs/s) and CPU per run.
``ticks``
    ``--schedules`` exclusive interval schedules firing every 100 ms on one scheduler; the handler
    records ``time.time() - tick.scheduled_at`` (scheduled instant → handler start, what
    ``sdcore_schedule_tick_lag_seconds`` measures). With metrics on, every tick also updates the
    run counter, the lag and duration histograms and the lease counters and gauge.

Each round prints the on/off ratio; the summary gives the median and spread (min–max) over
``--rounds``. The target: within 3 % (ratios 0.97–1.03). Nothing is asserted (a benchmark, not a
test); on a shared machine the spread is the noise floor.

Usage::

    python benchmarks/observability.py [--database-url URL] [--rounds N] [--seconds S]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import base_parser, machine, scratch_database, spread

from sdcore._internal.telemetry import NOOP, Telemetry
from sdcore.job_scheduler import JobAcquireOptions, JobSchedulerService
from sdcore.metrics import SdcoreMetrics
from sdcore.scheduling import Scheduler, Tick

# Short alternating slices (off, on, on, off) × 4 per round: noise from other processes lands on
# both sides alike.
ORDER = ("off", "on", "on", "off") * 4


def _on_off(figures: dict[str, list[float]], ratios: list[float]) -> tuple[float, float, float]:
    """Mean off, mean on and their ratio (appended to ``ratios``) of one round's slices."""
    off, on = statistics.mean(figures["off"]), statistics.mean(figures["on"])
    ratios.append(on / off)
    return off, on, on / off


def _hub() -> Telemetry:
    hub = Telemetry()
    hub.add(SdcoreMetrics().observer)
    return hub


async def _lease_slice(
    jobs: JobSchedulerService, clients: int, seconds: float
) -> tuple[int, float]:
    """Runs completed and CPU seconds used in one slice."""
    stop = time.monotonic() + seconds
    prefix = uuid.uuid4().hex[:8]

    async def client(index: int) -> int:
        done = 0
        while time.monotonic() < stop:
            options = JobAcquireOptions(code="bench", run_key=f"{prefix}-{index}-{done}")
            result = await jobs.run_exclusive(options, _nothing)
            if not result.acquired:
                raise RuntimeError("a fresh run key was not acquired")
            done += 1
        return done

    cpu = time.process_time()
    counts = await asyncio.gather(*(client(i) for i in range(clients)))
    return sum(counts), time.process_time() - cpu


async def _nothing(lease: object) -> None:
    return None


async def bench_lease(dsn: str, rounds: int, seconds: float, clients: int) -> list[float]:
    async with JobSchedulerService.connect(dsn, max_connections=clients) as jobs:
        return await _bench_lease(jobs, rounds, seconds, clients)


async def _bench_lease(
    jobs: JobSchedulerService, rounds: int, seconds: float, clients: int
) -> list[float]:
    ratios: list[float] = []
    try:
        await jobs.ensure_schema()
        await _lease_slice(jobs, clients, 1.0)  # warm-up: prepares, pool
        for r in range(rounds):
            rates: dict[str, list[float]] = {"off": [], "on": []}
            cpus: dict[str, list[float]] = {"off": [], "on": []}
            for mode in ORDER:
                jobs.telemetry = _hub() if mode == "on" else NOOP
                count, cpu = await _lease_slice(jobs, clients, seconds / 8)
                rates[mode].append(count / (seconds / 8))
                cpus[mode].append(cpu / max(count, 1) * 1e6)
            off, on, ratio = _on_off(rates, ratios)
            print(
                f"lease round {r + 1}: off {off:.0f} runs/s ({statistics.mean(cpus['off']):.0f} µs"
                f" CPU/run), on {on:.0f} runs/s ({statistics.mean(cpus['on']):.0f} µs CPU/run):"
                f" on/off throughput {ratio:.3f}"
            )
    finally:
        jobs.telemetry = NOOP
    return ratios


async def bench_ticks(dsn: str, rounds: int, seconds: float, schedules: int) -> list[float]:
    async with JobSchedulerService.connect(dsn, max_connections=4) as jobs:
        return await _bench_ticks(jobs, rounds, seconds, schedules)


async def _bench_ticks(
    jobs: JobSchedulerService, rounds: int, seconds: float, schedules: int
) -> list[float]:
    scheduler = Scheduler(jobs=jobs, lease_ms=30_000)
    lags: list[float] = []

    async def handler(tick: Tick) -> None:
        lags.append(time.time() - tick.scheduled_at.timestamp())

    for index in range(schedules):
        scheduler.add_interval(f"bench-{index}", 100, handler)
    ratios: list[float] = []
    try:
        await jobs.ensure_schema()
        async with scheduler:
            await asyncio.sleep(1.0)  # warm-up
            for r in range(rounds):
                medians: dict[str, list[float]] = {"off": [], "on": []}
                p99s: dict[str, list[float]] = {"off": [], "on": []}
                for mode in ORDER:
                    hub = _hub() if mode == "on" else NOOP
                    jobs.telemetry = scheduler.telemetry = hub
                    await asyncio.sleep(0.2)  # ticks started under the other mode finish
                    lags.clear()  # only ticks started under this mode
                    await asyncio.sleep(seconds / 8)
                    window = sorted(lags)
                    if not window:
                        raise RuntimeError("no tick ran in the window")
                    medians[mode].append(statistics.median(window) * 1000)
                    p99s[mode].append(window[min(len(window) - 1, int(len(window) * 0.99))] * 1000)
                off, on, ratio = _on_off(medians, ratios)
                print(
                    f"ticks round {r + 1}: start lag p50 off {off:.2f} ms (p99"
                    f" {statistics.mean(p99s['off']):.2f}), on {on:.2f} ms (p99"
                    f" {statistics.mean(p99s['on']):.2f}): on/off p50 {ratio:.3f}"
                )
    finally:
        jobs.telemetry = scheduler.telemetry = NOOP
    return ratios


def hook_cost_us(repeat: int = 20_000) -> tuple[tuple[float, float], tuple[float, float]]:
    """CPU µs per run spent in the hooks, (metrics on, off), for a tick and for a bare lease.

    A tick's hooks as the tick runner and the lease call them: tick scope, tick started, lease
    acquired, lease released, tick finished; a ``run_exclusive`` call fires the two lease hooks
    only. No I/O: a figure the machine's load barely moves.
    """
    from datetime import UTC, datetime

    tick = Tick(schedule="bench", scheduled_at=datetime.now(UTC), local_time=datetime.now(UTC),
                run_key="k")  # fmt: skip

    def one(hub: Telemetry, ticks: bool) -> float:
        started = time.process_time()
        for _ in range(repeat):
            run = hub.tick_scope("bench") if ticks else None
            hub.tick_started(run, tick)
            hub.lease_acquired("bench")
            hub.lease_released("bench", False)
            hub.tick_finished(run, "success")
        return (time.process_time() - started) / repeat * 1e6

    hub = _hub()
    figures = []
    for ticks in (True, False):
        one(hub, ticks)  # warm-up
        on = statistics.median(one(hub, ticks) for _ in range(5))
        off = statistics.median(one(NOOP, ticks) for _ in range(5))
        figures.append((on, off))
    return figures[0], figures[1]


def _verdict(name: str, ratios: Sequence[float], higher_is_better: bool) -> str:
    median = statistics.median(ratios)
    cost = (1 - median) if higher_is_better else (median - 1)
    met = "met" if cost <= 0.03 else "MISSED"
    return f"{name}: on/off {spread(ratios, '{:.3f}')} over {len(ratios)} rounds; 3 % target {met}"


async def main_async(url: str, rounds: int, seconds: float, clients: int, schedules: int) -> int:
    with psycopg.connect(url, autocommit=True) as admin:
        print(machine(admin))
    with scratch_database(url, "sdcore_bench_obs") as dsn:
        lease = await bench_lease(dsn, rounds, seconds, clients)
        ticks = await bench_ticks(dsn, rounds, seconds, schedules)
    (tick_on, tick_off), (lease_on, lease_off) = hook_cost_us()
    print(
        f"hooks per tick (CPU, no I/O): {tick_on:.2f} µs with metrics, {tick_off:.2f} µs without;"
        f" per run_exclusive: {lease_on:.2f} µs with, {lease_off:.2f} µs without"
    )
    print(_verdict("lease run_exclusive throughput", lease, higher_is_better=True))
    print(_verdict("tick start lag p50", ticks, higher_is_better=False))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser((__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--seconds", type=float, default=4.0, help="per mode per round (default 4)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent lease clients (4)")
    parser.add_argument("--schedules", type=int, default=10, help="tick schedules (default 10)")
    args = parser.parse_args(argv)
    return asyncio.run(
        main_async(args.database_url, args.rounds, args.seconds, args.clients, args.schedules)
    )


if __name__ == "__main__":
    raise SystemExit(main())
