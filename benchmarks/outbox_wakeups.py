"""Wake-up latency of the debounced outbox NOTIFY in its edge cases (docs/benchmarks.md#outbox).

One relay (LISTEN/NOTIFY, ``--poll-ms`` poll, a publisher that only records the time) runs idle:
each case starts after its look-again window (1 s after the last rows it found) has passed. A
writer then commits one row, and the time from that commit to the relay's ``publish`` is
measured, with the writer's and the relay's ``Outbox(notify_interval_ms=…)`` at 0 (every
insert notifies) and at the default 20 ms. The cases:

- ``fresh``: a row after a quiet spell (the NOTIFY's ordinary job);
- ``after no-op``: an ``enqueue_once`` of a key that already holds the same message (returns
  ``False``, inserts nothing), then at once a new row;
- ``beside open``: transaction A enqueues (carrying the NOTIFY) and stays open ``--open-s``;
  transaction B enqueues right after A's statement and commits: B's latency (A still open).

Then what the debounce is for: ``--writers`` concurrent writers in this process (one connection
each) commit one-row transactions for ``--seconds``, with ``notify_interval_ms`` at 0 and 20 and
with ``notify=False``, and a listener counts the NOTIFYs: rows/s and NOTIFYs/s (the notifying
commits are the ones PostgreSQL serializes).

Run: ``python benchmarks/outbox_wakeups.py [--rounds 5] [--poll-ms 4000] [--open-s 3]
[--writers 8] [--seconds 3]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from _harness import base_parser, machine, scratch_database
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import Outbox, OutboxMessage, OutboxRelay, PostgresOutboxStore

LIVELY_S = 1.0  # the relay looks again for max(1 s, 50 intervals) after it found rows


class Recorder:
    """A publisher that records when each key reached it."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.arrived = asyncio.Event()

    async def publish(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        now = time.monotonic()
        for message in messages:
            self.at.setdefault(message.idempotency_key, now)
        self.arrived.set()
        return [None] * len(messages)

    async def wait_for(self, key: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while key not in self.at:
            self.arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(key)
            try:
                async with asyncio.timeout(left):
                    await self.arrived.wait()
            except TimeoutError:
                continue
        return self.at[key]


async def enqueue(
    pool: AsyncConnectionPool[Any], outbox: Outbox, key: str, payload: dict[str, Any]
) -> bool:
    async with pool.connection() as conn, conn.transaction():
        return await outbox.enqueue_once(
            conn, idempotency_key=key, queue="q", name="wake", payload=payload
        )


async def one_case(
    pool: AsyncConnectionPool[Any],
    writer: Outbox,
    recorder: Recorder,
    case: str,
    tag: str,
    open_s: float,
    timeout: float,
) -> float:
    """Run one case once; return the measured row's commit → publish latency in ms."""
    key = f"{tag}-row"
    if case == "fresh":
        await enqueue(pool, writer, key, {})
        committed = time.monotonic()
    elif case == "after no-op":
        assert not await enqueue(pool, writer, "held", {"n": 1})
        await enqueue(pool, writer, key, {})
        committed = time.monotonic()
    else:  # beside open
        async with pool.connection() as conn_a, conn_a.transaction():
            await writer.enqueue_once(
                conn_a, idempotency_key=f"{tag}-open", queue="q", name="wake", payload={}
            )
            await enqueue(pool, writer, key, {})
            committed = time.monotonic()
            await asyncio.sleep(open_s)
    published = await recorder.wait_for(key, timeout)
    return (published - committed) * 1000


async def run(args: Any) -> None:
    cases = ("fresh", "after no-op", "beside open")
    results: dict[tuple[int, str], list[float]] = {}
    with scratch_database(args.database_url, "sdcore_bench_wake") as dsn:
        with psycopg.connect(dsn) as conn:
            print(machine(conn))
        async with AsyncConnectionPool(dsn, min_size=2, max_size=4, open=False) as pool:
            await Outbox().ensure_schema(pool)
            await enqueue(pool, Outbox(notify=False), "held", {"n": 1})
            async with pool.connection() as conn:
                await conn.execute("UPDATE outbox SET status = 'PUBLISHED', published_at = now()")
            counter = itertools.count()
            for interval in (0, 20):
                writer = Outbox(notify_interval_ms=interval)
                recorder = Recorder()
                relay = OutboxRelay(
                    PostgresOutboxStore(pool, outbox=Outbox(notify_interval_ms=interval)),
                    recorder,
                    poll_interval_ms=args.poll_ms,
                )
                async with relay:
                    while not relay.state.listening:
                        await asyncio.sleep(0.02)
                    for _round in range(args.rounds):
                        for case in cases:
                            await asyncio.sleep(LIVELY_S + 0.5)  # past any look-again window
                            tag = f"r{next(counter)}"
                            latency = await one_case(
                                pool,
                                writer,
                                recorder,
                                case,
                                tag,
                                args.open_s,
                                args.poll_ms / 1000 + args.open_s + 10,
                            )
                            results.setdefault((interval, case), []).append(latency)
        report(results, args)
        if args.writers:
            await concurrency(dsn, args.writers, args.seconds)


def report(results: dict[tuple[int, str], list[float]], args: Any) -> None:
    """Print the wake-up latencies per debounce and case."""
    print(
        f"\ncommit → publish, ms ({args.rounds} rounds; relay poll {args.poll_ms} ms,"
        f" A open {args.open_s} s)"
    )
    print(f"{'debounce':>9} {'case':>12} | {'median':>8} {'max':>8}  all")
    for (interval, case), values in results.items():
        shown = " ".join(f"{v:.0f}" for v in values)
        print(
            f"{interval:>7} ms {case:>12} | {statistics.median(values):>8.1f}"
            f" {max(values):>8.1f}  {shown}"
        )


async def concurrency(dsn: str, writers: int, seconds: float) -> None:
    """Rows/s and NOTIFYs/s of ``writers`` concurrent writers per debounce setting."""
    print(f"\n{writers} writers in one process, {seconds} s each, rounds interleaved")
    print(f"{'setting':>16} | {'rows/s':>8} {'NOTIFY/s':>9} {'per 20 ms':>9}")
    settings = {
        "every insert": Outbox(notify_interval_ms=0),
        "debounced 20 ms": Outbox(notify_interval_ms=20),
        "never": Outbox(notify=False),
    }
    totals: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    async with AsyncConnectionPool(dsn, min_size=writers, max_size=writers, open=False) as pool:
        for _round in range(3):
            for name, outbox in settings.items():
                async with pool.connection() as conn:
                    await conn.execute("TRUNCATE outbox")
                stop = time.monotonic() + seconds
                counter = itertools.count()

                async def writer(
                    outbox: Outbox = outbox, stop: float = stop, keys: Any = counter
                ) -> int:
                    done = 0
                    while time.monotonic() < stop:
                        await enqueue(pool, outbox, f"c{next(keys)}", {"n": done})
                        done += 1
                    return done

                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as ear:
                    await ear.execute('LISTEN "sdcore_outbox"')
                    started = time.monotonic()
                    rows = sum(await asyncio.gather(*(writer() for _ in range(writers))))
                    elapsed = time.monotonic() - started
                    heard = 0
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.3):
                            async for _ in ear.notifies():
                                heard += 1
                totals[name].append((rows / elapsed, heard / elapsed))
    for name, values in totals.items():
        rate = statistics.median(v[0] for v in values)
        notes = statistics.median(v[1] for v in values)
        print(f"{name:>16} | {rate:>8.0f} {notes:>9.0f} {notes / 50:>9.2f}")


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--poll-ms", type=int, default=4000)
    parser.add_argument("--open-s", type=float, default=3.0)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
