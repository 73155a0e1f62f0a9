"""The relay's peak memory (RSS) while it drains a backlog of large rows, per claim byte budget.

**Set-up.** A scratch database with an outbox of ``--rows`` rows (default 500) whose payloads are
``--row-kib`` KiB each (default 1,024: ``{"i": n, "blob": "…"}`` just under the outbox's 1 MiB
limit, random base64 text so that neither PostgreSQL nor anything else compresses them), and a
redis-server of this run on a spare port (``--redis-server``, default ``redis-server``;
``appendonly no``, no snapshots), flushed before every drain.

**Measured.** For each budget of ``--budgets`` (MiB; default 2, 4, 8, 16 and 32, the relay's
default ``batch_bytes`` among them), a fresh Python process imports sdcore, opens its pool and
its ``BullMQPublisher`` and reads its own ``VmHWM`` (peak RSS so far: the baseline), then runs
``OutboxRelay(PostgresOutboxStore(pool), publisher, batch_bytes=budget).drain()`` — what the
relay's background loop runs, two batches in flight — until every row is ``PUBLISHED``, and reads
``VmHWM`` again (the peak) and the elapsed time. Between budgets every row is made ``PENDING``
again. The rows are written once (about 1.5 s per 100 MiB here).

**Reported.** Per budget: the baseline and peak RSS in MB, the growth over the baseline, the
growth per MiB of budget (the relay holds about five copies of each batch's payload: libpq's
result, the decoded dicts, BullMQ's JSON, redis-py's packed command, plus two batches in flight),
and the throughput in MiB/s of payload. The script exits 0 whatever the figures (a benchmark,
not a test); it prints whether the peak with the default budget stays under ``--bound-mb``
(default 256).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import base_parser, machine, scratch_database

from sdcore.outbox import DEFAULT_RELAY_BATCH_BYTES, Outbox

MIB = 1024 * 1024

# The relay process: prints its baseline VmHWM once connected, then its peak after the drain.
_RELAY = """
import asyncio, json, sys, time
from psycopg_pool import AsyncConnectionPool
from sdcore.outbox import OutboxRelay, PostgresOutboxStore
from sdcore.queues import BullMQPublisher

def hwm():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

async def main(dsn, url, budget):
    async with AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        async with BullMQPublisher.from_url(url, check_server=False) as publisher:
            relay = OutboxRelay(PostgresOutboxStore(pool), publisher, batch_bytes=int(budget))
            await relay.stats()
            base = hwm()
            started = time.perf_counter()
            claimed = 0
            while (await relay.stats()).pending:
                claimed += await relay.drain()
            elapsed = time.perf_counter() - started
    print(json.dumps({"base": base, "peak": hwm(), "seconds": elapsed, "claimed": claimed}))

asyncio.run(main(*sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server(binary: str) -> Iterator[str]:
    """A redis-server of this run on a spare port; killed (and its directory removed) at the end."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="sdcore-bench-redis-") as directory:
        proc = subprocess.Popen(
            [
                *(binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""),
                *("--appendonly", "no", "--dir", directory, "--logfile", "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 15
            while True:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), 0.2),
                ):
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the benchmark's redis-server did not start")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}"
        finally:
            proc.kill()
            proc.wait(10)


def fill(dsn: str, rows: int, row_kib: int) -> None:
    """Write the backlog: ``rows`` rows of about ``row_kib`` KiB each."""
    rng = random.Random(14)
    size = row_kib * 1024 - 64  # {"i": n, "blob": "…"} stays under the outbox's 1 MiB
    outbox = Outbox()

    async def write() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await outbox.ensure_schema(conn)
            for i in range(rows):
                blob = base64.b64encode(rng.randbytes(size * 3 // 4 + 3)).decode()[:size]
                async with conn.transaction():
                    await outbox.enqueue_once(
                        conn,
                        idempotency_key=f"big-{i}",
                        queue="memory",
                        name="n",
                        payload={"i": i, "blob": blob},
                    )

    asyncio.run(write())
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox")


def reset(dsn: str, url: str) -> None:
    """Every row due again, Redis empty."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox SET status = 'PENDING', published_at = NULL, attempts = 0,"
            " claimed_until = NULL, claim_token = NULL, next_attempt_at = clock_timestamp()"
        )
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


def run_relay(dsn: str, url: str, budget: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _RELAY, dsn, url, str(budget)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the relay process failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser: argparse.ArgumentParser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=500, help="rows pending (default 500)")
    parser.add_argument(
        "--row-kib", type=int, default=1024, help="payload KiB per row (default 1024)"
    )
    parser.add_argument(
        "--budgets",
        default="2,4,8,16,32",
        help="claim byte budgets to run, MiB, comma-separated (default 2,4,8,16,32)",
    )
    parser.add_argument(
        "--bound-mb", type=float, default=256, help="peak RSS bound to check (default 256)"
    )
    parser.add_argument("--redis-server", default="redis-server", help="redis-server binary")
    args = parser.parse_args(argv)
    binary = shutil.which(args.redis_server)
    if binary is None:
        parser.error(f"{args.redis_server} is not installed")
    budgets = [int(float(b) * MIB) for b in args.budgets.split(",") if b.strip()]
    with scratch_database(args.database_url, "sdcore_bench_relay_mem") as dsn:
        with psycopg.connect(dsn) as conn:
            print(machine(conn))
        started = time.perf_counter()
        fill(dsn, args.rows, args.row_kib)
        print(
            f"{args.rows} rows of {args.row_kib} KiB written in"
            f" {time.perf_counter() - started:.1f} s"
        )
        print(
            f"{'budget MiB':>10} {'base MB':>8} {'peak MB':>8} {'growth MB':>9}"
            f" {'MB/MiB':>7} {'MiB/s':>7}"
        )
        peak_default: float | None = None
        with redis_server(binary) as url:
            for budget in budgets:
                reset(dsn, url)
                result = run_relay(dsn, url, budget)
                base, peak = result["base"] / 1e6, result["peak"] / 1e6
                rate = args.rows * args.row_kib / 1024 / result["seconds"]
                print(
                    f"{budget / MIB:>10g} {base:>8.0f} {peak:>8.0f} {peak - base:>9.0f}"
                    f" {(peak - base) / (budget / MIB):>7.1f} {rate:>7.1f}"
                )
                if budget == DEFAULT_RELAY_BATCH_BYTES:
                    peak_default = peak
    if peak_default is not None:
        verdict = "within" if peak_default <= args.bound_mb else "OVER"
        print(
            f"default batch_bytes ({DEFAULT_RELAY_BATCH_BYTES / MIB:g} MiB): peak RSS"
            f" {peak_default:.0f} MB, {verdict} the {args.bound_mb:g} MB bound"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
