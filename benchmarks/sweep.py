"""CPU of one catch-up sweep's instants: what ``TickStarter.sweep`` computes for each schedule it
owns before it asks the database anything (``candidates``, the last 1,000 instants of the
window swept), against the minimal computation, one walk over the same window
(``expected_instants``).

A scheduler sweeps every ``min(lease, 60 s)`` (60 s with the default 300 s lease), over the
window since its last sweep. Each trigger kind is timed on that window for ``--schedules``
schedules, both computations interleaved in one process, ``--rounds`` times; printed: the
median per schedule, the spread and the ratio to the walk.

Run: ``python benchmarks/sweep.py [--schedules 1000] [--rounds 7] [--window-s 60]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from sdcore.scheduling._catch_up import MAX_CATCH_UP, candidates
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


if __name__ == "__main__":
    main()
