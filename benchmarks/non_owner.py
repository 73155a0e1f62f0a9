"""What an instant costs a replica that owns none of its ticks (most replicas of a large fleet).

With owners (the control plane on), each instant's exclusive ticks are asked for by three
replicas; every other replica's timer still comes due at the instant and re-arms the schedules at
their next instants. This times ``Timer._fire_due`` on such a replica: ``--schedules`` exclusive
per-second crons (``* * * * * *``: one shared trigger), in a view of 24 replicas, called wherever
the loop would wake within each of ``--seconds`` consecutive seconds (100 schedules or more are a
burst, looked at again after the owners' turns); the seconds of epochs this replica does not own
are counted. The baseline, interleaved in the same run, is the least that re-arming them takes: the
next instant computed once for the trigger, and each schedule pushed to a heap at it.

Printed: the median and 90th percentile per instant for both, and the median ratio. The fleet's
figure (``fleet.py --only steady``) is where this shows: 21 of 24 replicas do this every second.

Run: ``python benchmarks/non_owner.py [--schedules 20] [--seconds 3000]``; compare two codes with
``PYTHONPATH=/path/to/other/src``.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

import sdcore
from sdcore.scheduling import Scheduler
from sdcore.scheduling._owners import OWNERS, Member, Owners
from sdcore.testing import MemoryJobScheduler


async def measure(schedules: int, seconds: int) -> tuple[list[int], list[int]]:
    clock = [datetime(2026, 1, 1, tzinfo=UTC)]
    scheduler = Scheduler(jobs=MemoryJobScheduler(), clock=lambda: clock[0])
    names = [f"tick{i}" for i in range(schedules)]
    for name in names:
        scheduler.add_cron(name, "* * * * * *", lambda tick: None, exclusive=True)
    ids = [str(uuid.UUID(int=i)) for i in range(24)]
    owners = Owners(ids[0], stale_s=1e9, clock=lambda: 0.0)
    owners.update((Member(r, None) for r in ids), frozenset(names))
    scheduler._sup.owners = owners  # as ScheduleControl links it
    timer = scheduler._timer
    timer.reset()
    entries = list(scheduler._entries.values())
    for entry in entries:
        timer.arm(entry, clock[0])
    trigger = entries[0].trigger
    heap: list[tuple[datetime | None, int, object]] = []
    timed: list[int] = []
    bare: list[int] = []
    due = clock[0]
    for _ in range(seconds):
        due += timedelta(seconds=1)
        spent = 0
        # Each time the loop would wake before the next instant (a burst it leaves to its
        # owners is looked at again later, to re-arm it).
        while timer.heap and timer.heap[0][0] < due + timedelta(seconds=1):
            clock[0] = max(due, timer.heap[0][0])
            began = time.perf_counter_ns()
            await timer._fire_due(clock[0])
            spent += time.perf_counter_ns() - began
        if owners.place(due, names) < OWNERS:
            continue  # an instant it owns: not what is measured
        timed.append(spent)
        began = time.perf_counter_ns()
        following = trigger.next_after(due)
        heap.clear()
        for index, entry in enumerate(entries):
            heapq.heappush(heap, (following, index, entry))
        bare.append(time.perf_counter_ns() - began)
    return timed, bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=20)
    parser.add_argument("--seconds", type=int, default=3000)
    args = parser.parse_args()
    timed, bare = asyncio.run(measure(args.schedules, args.seconds))
    print(f"sdcore from {sdcore.__file__}; {len(timed)} instants left to others")

    def line(what: str, ns: list[int]) -> str:
        p90 = statistics.quantiles(ns, n=10)[-1]
        return f"{what}: median {statistics.median(ns) / 1000:.1f} us, p90 {p90 / 1000:.1f} us"

    print(line("timer", timed))
    print(line("bare re-arm", bare))
    ratio = statistics.median(timed) / statistics.median(bare)
    print(f"ratio (medians): {ratio:.1f}x, {args.schedules} schedules")


if __name__ == "__main__":
    main()
