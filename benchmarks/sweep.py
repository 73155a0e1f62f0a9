"""The catch-up sweep's cost, in two parts.

Instants (always): what ``TickStarter.sweep`` computes for each schedule it owns before it asks
the database anything (``candidates``, the last 1,000 instants of the window swept), against
the minimal computation, one walk over the same window (``expected_instants``). A scheduler
sweeps every ``min(lease, 60 s)`` (60 s with the default 300 s lease), over the window since
its last sweep. Each trigger kind is timed on that window for ``--schedules`` schedules, both
interleaved in one process, ``--rounds`` times; printed: the median per schedule, the spread
and the ratio to the walk.

A round on PostgreSQL (with ``--database-url``): a ``Scheduler`` on a ``JobSchedulerService``
with ``--schedules`` exclusive crons (``--cron``, minutely by default), each active for the last
``--window-s`` seconds with a ``SUCCESS`` row for every tick of that window, or an older one if
none falls in it (the steady state: nothing to catch up).
One sweep round over all of them (``TickStarter.sweep``: their instants, the rows of their ticks,
nothing to start), against the minimal SQL for the same answer: one bare psycopg
``SELECT ... WHERE lock_key = ANY(...)`` of all the keys. Interleaved, ``--rounds`` times;
printed: wall time and statements per round, and the ratio. Then the same schedules' start
(``start_all`` then ``aclose``: start-up catch-up reads when each first ran and the rows of its
window's ticks, and finds nothing to start) against the bare reads of the same (one
``GROUP BY code`` of ``min(created_at)`` and the SELECT above).

Run: ``python benchmarks/sweep.py [--schedules 1000] [--rounds 7] [--window-s 60]
[--database-url postgresql://postgres@127.0.0.1:5432/postgres] [--cron "0 2 * * *"]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
from _harness import scratch_database

from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import Scheduler
from sdcore.scheduling._catch_up import MAX_CATCH_UP, candidates, tick_keys
from sdcore.scheduling._cron import CronSpec
from sdcore.scheduling._policy import CatchUp
from sdcore.scheduling._triggers import CronTrigger, IntervalTrigger, Trigger, expected_instants

TRIGGERS: dict[str, Callable[[], Trigger]] = {
    "minutely cron": lambda: CronTrigger(CronSpec.parse("* * * * *", ZoneInfo("Europe/Paris"))),
    "daily cron": lambda: CronTrigger(CronSpec.parse("0 2 * * *", ZoneInfo("Europe/Paris"))),
    "every second": lambda: IntervalTrigger(1_000),
}


def _time(fn: Callable[[], object], schedules: int) -> float:
    """Microseconds per schedule of ``fn`` called once per schedule."""
    started = time.perf_counter()
    for _ in range(schedules):
        fn()
    return (time.perf_counter() - started) / schedules * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--schedules", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--database-url", default=None, help="also time a round on PostgreSQL")
    parser.add_argument("--cron", default="* * * * *", help="the schedules' cron on PostgreSQL")
    args = parser.parse_args()
    end = datetime(2026, 12, 7, 8, 0, 30, tzinfo=UTC)
    start = end - timedelta(seconds=args.window_s)
    print(f"{args.schedules} schedules, window {args.window_s:g} s, {args.rounds} rounds")
    for label, make in TRIGGERS.items():
        trigger = make()
        sweep: list[float] = []
        walk: list[float] = []

        def swept(trigger: Trigger = trigger) -> object:
            return candidates(CatchUp.ALL, trigger, start, end)

        def walked(trigger: Trigger = trigger) -> object:
            return expected_instants(trigger, start, end, limit=MAX_CATCH_UP)

        for _ in range(args.rounds):
            sweep.append(_time(swept, args.schedules))
            walk.append(_time(walked, args.schedules))
        ratios = [s / w for s, w in zip(sweep, walk, strict=True)]
        print(
            f"{label:14} sweep {statistics.median(sweep):8.1f} µs/schedule "
            f"({min(sweep):.1f}–{max(sweep):.1f})  walk {statistics.median(walk):8.1f} "
            f"({min(walk):.1f}–{max(walk):.1f})  ratio {statistics.median(ratios):.2f}× "
            f"({min(ratios):.2f}–{max(ratios):.2f})"
        )

    if args.database_url:
        with scratch_database(args.database_url, "sdcore_bench_sweep") as dsn:
            asyncio.run(
                _round_on_postgres(dsn, args.schedules, args.rounds, args.window_s, args.cron)
            )


async def _round_on_postgres(
    dsn: str, schedules: int, rounds: int, window_s: float, cron: str
) -> None:
    """A sweep round of ``schedules`` crons against one bare SELECT of their keys."""
    async with JobSchedulerService.connect(dsn) as jobs:
        await jobs.ensure_schema()
        scheduler = Scheduler(jobs=jobs)
        handler: Callable[[Any], None] = lambda tick: None  # noqa: E731 - never called
        names = [f"sweep-{i:05d}" for i in range(schedules)]
        for name in names:
            scheduler.add_cron(name, cron, handler, catch_up="all")
        entries = [scheduler._entries[name] for name in names]
        now = datetime.now(UTC)
        keys: list[str] = []
        for entry in entries:
            instants = candidates(
                entry.policy.catch_up, entry.trigger, now - timedelta(seconds=window_s), now
            )
            ticks = tick_keys(entry.name, entry.trigger, instants)
            keys.extend(ticks)
            run_keys = [entry.trigger.run_key(t) for t in ticks.values()]
            # A schedule with no tick in the window ran before all the same (an older row).
            for run_key in run_keys or ["2026-01-01T00:00:00Z"]:
                won = await jobs.acquire({"code": entry.name, "run_key": run_key})
                assert won.acquired
                await jobs.complete(won.lease)
        print(
            f"on PostgreSQL: {schedules} crons {cron!r}, {len(keys)} ticks in the window, "
            f"all SUCCESS"
        )

        async def sweep() -> None:
            start = datetime.now(UTC) - timedelta(seconds=window_s)
            for entry in entries:
                entry.active_since, entry.swept_until = start, None
            await scheduler._sup.sweep(entries, scheduler._clock, lambda e: True)

        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:

            async def bare() -> None:
                await (
                    await conn.execute(
                        "SELECT lock_key, status, attempts FROM job_scheduler"
                        " WHERE lock_key = ANY(%s)",
                        (keys,),
                    )
                ).fetchall()

            ours: list[float] = []
            base: list[float] = []
            statements = await _calls(jobs, sweep)
            for _ in range(rounds):
                ours.append(await _wall(sweep))
                base.append(await _wall(bare))

            # Start-up: start_all (start-up catch-up reads when each schedule first ran and the
            # rows of its window's ticks; nothing to start) against the bare reads of the same.
            async def start() -> None:
                await scheduler.start_all()
                await scheduler.aclose()

            async def bare_start() -> None:
                await (
                    await conn.execute(
                        "SELECT code, min(created_at) FROM job_scheduler"
                        " WHERE code = ANY(%s) GROUP BY code",
                        (names,),
                    )
                ).fetchall()
                await bare()

            starts: list[float] = []
            base_starts: list[float] = []
            for _ in range(rounds):
                starts.append(await _wall(start))
                base_starts.append(await _wall(bare_start))
        ratios = [o / b for o, b in zip(ours, base, strict=True)]
        start_ratios = [o / b for o, b in zip(starts, base_starts, strict=True)]
        print(
            f"  start_all + aclose {statistics.median(starts) * 1e3:8.1f} ms "
            f"({min(starts) * 1e3:.1f}–{max(starts) * 1e3:.1f}); bare reads "
            f"{statistics.median(base_starts) * 1e3:.1f} ms; ratio "
            f"{statistics.median(start_ratios):.2f}× "
            f"({min(start_ratios):.2f}–{max(start_ratios):.2f})"
        )
        print(
            f"  sweep round {statistics.median(ours) * 1e3:8.1f} ms ({min(ours) * 1e3:.1f}–"
            f"{max(ours) * 1e3:.1f}), {statements} tick_records statements; bare SELECT "
            f"{statistics.median(base) * 1e3:.1f} ms ({min(base) * 1e3:.1f}–{max(base) * 1e3:.1f})"
            f", 1 statement; ratio {statistics.median(ratios):.2f}× "
            f"({min(ratios):.2f}–{max(ratios):.2f})"
        )


async def _wall(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def _calls(jobs: JobSchedulerService, fn: Callable[[], Any]) -> int:
    """How many ``tick_records`` calls one call of ``fn`` makes."""
    count = 0
    real = jobs.tick_records

    async def counting(lock_keys: Any) -> Any:
        nonlocal count
        count += 1
        return await real(lock_keys)

    jobs.tick_records = counting  # type: ignore[method-assign]
    try:
        await fn()
    finally:
        del jobs.tick_records
    return count


if __name__ == "__main__":
    main()
