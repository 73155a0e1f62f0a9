"""Client CPU to send one burst's run-history rows: the parameters of ``runs_started`` for 10,000
runs (nine arrays, one element per run) dumped by psycopg in text and in binary format.

The history statements (``src/sdcore/postgres/sql/schedules.sql``) send their arrays in binary,
as the lease's do: a burst's first owner dumps these on the event loop that starts its handlers.
Both formats are timed interleaved in one process, ``--rounds`` times; printed: the median,
the spread and the ratio binary / text.

Run: ``python benchmarks/history_params.py [--runs 10000] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from psycopg.adapt import PyFormat, Transformer


def _params(runs: int) -> list[list[Any]]:
    """``runs_started``'s arrays as ``PostgresScheduleStore.runs_started`` builds them."""
    at = datetime(2026, 12, 7, 8, 0, tzinfo=UTC)
    replica = str(uuid.uuid4())
    return [
        [f"burst-{i:05d}" for i in range(runs)],  # schedule
        ["2026-12-07T08:00:00Z"] * runs,  # run_key
        ["fire"] * runs,  # source
        [at] * runs,  # scheduled_at
        [1] * runs,  # attempt
        list(range(1, runs + 1)),  # fencing_token
        [replica] * runs,  # replica_id
        ["host-1"] * runs,  # host
        [4242] * runs,  # pid
    ]


def _dump(params: list[list[Any]], fmt: PyFormat) -> float:
    start = time.perf_counter()
    transformer = Transformer()
    for column in params:
        transformer.get_dumper(column, fmt).dump(column)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    params = _params(args.runs)
    took: dict[PyFormat, list[float]] = {PyFormat.TEXT: [], PyFormat.BINARY: []}
    for _ in range(args.rounds):
        for fmt, times in took.items():
            times.append(_dump(params, fmt))
    for fmt, times in took.items():
        print(
            f"{fmt.name.lower():6} {statistics.median(times):6.1f} ms "
            f"({min(times):.1f}-{max(times):.1f}) for {args.runs} runs"
        )
    ratio = statistics.median(took[PyFormat.BINARY]) / statistics.median(took[PyFormat.TEXT])
    print(f"binary / text: {ratio:.2f}x")


if __name__ == "__main__":
    main()
