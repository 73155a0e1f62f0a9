"""What every benchmark shares: scratch databases, pgbench, the common options, summaries.

Benchmarks print ratios against a baseline measured in the same run; none asserts a time.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
_TPS = re.compile(r"^tps = ([0-9.]+)", re.MULTILINE)


def base_parser(description: str) -> argparse.ArgumentParser:
    """A parser with ``--database-url`` (default ``$SDCORE_BENCH_DATABASE_URL``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("SDCORE_BENCH_DATABASE_URL", DEFAULT_URL),
        help="server to create the scratch database on (default: $SDCORE_BENCH_DATABASE_URL "
        f"or {DEFAULT_URL})",
    )
    return parser


def dsn_for(url: str, dbname: str) -> str:
    """Return ``url`` pointed at another database."""
    params = {k: str(v) for k, v in conninfo_to_dict(url).items()}
    params["dbname"] = dbname
    return make_conninfo(**params)


@contextmanager
def scratch_database(url: str, prefix: str) -> Iterator[str]:
    """Create a database with a unique name on ``url``'s server; drop it at the end."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield dsn_for(url, name)
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def substitute(statement: bytes | str, names: Sequence[str]) -> str:
    """Replace the ``%s`` placeholders of a rendered statement, in order, with ``names``."""
    text = statement.decode("utf-8") if isinstance(statement, bytes) else statement
    parts = text.split("%s")
    if len(parts) != len(names) + 1:
        raise RuntimeError(f"expected {len(names)} placeholders, found {len(parts) - 1}")
    out = [parts[0]]
    for name, part in zip(names, parts[1:], strict=True):
        out.extend((name, part))
    return "".join(out)


def run_pgbench(
    dsn: str,
    script: Path,
    clients: int,
    seconds: int,
    defines: dict[str, str],
    threads: int | None = None,
) -> float:
    """Run ``pgbench -M prepared`` with ``script``; return its transactions per second."""
    command = [
        "pgbench", "-n", "-M", "prepared", "-c", str(clients), "-j", str(threads or clients),
        "-T", str(seconds), "-f", str(script),
    ]  # fmt: skip
    for name, value in defines.items():
        command += ["-D", f"{name}={value}"]
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    env = dict(os.environ)
    if "password" in params:
        env["PGPASSWORD"] = params.pop("password")
    done = subprocess.run(
        [*command, make_conninfo(**params)], capture_output=True, text=True, env=env, check=False
    )
    match = _TPS.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"pgbench failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return float(match.group(1))


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0–100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary(values: Sequence[float]) -> dict[str, float]:
    """Count, median, p99, min and max."""
    if not values:
        return {"n": 0.0}
    return {
        "n": float(len(values)),
        "p50": statistics.median(values),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


def spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """``median (min–max)`` of per-round figures."""
    if not values:
        return "n/a"
    return (
        f"{fmt.format(statistics.median(values))} "
        f"({fmt.format(min(values))}–{fmt.format(max(values))})"
    )


def machine(conn: psycopg.Connection[tuple[object, ...]]) -> str:
    """One line describing the server and this machine, for the report."""
    row = conn.execute("SHOW server_version").fetchone()
    version = row[0] if row else "?"
    return (
        f"PostgreSQL {version}; Python {platform.python_version()}, psycopg "
        f"{psycopg.__version__}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}"
    )
