"""A Flask app under Gunicorn with sdcore: plain-function schedules, an outbox write per request.

Every Gunicorn worker runs the same :class:`sdcore.sync.Runtime` (started by ``post_fork`` in
``gunicorn.conf.py``); the lease gives each tick to one of them, across workers and machines.

Environment: ``DATABASE_URL`` (required), ``NIGHTLY_CRON`` (default ``0 1 * * *``),
``HEARTBEAT_CRON`` (a second schedule that writes one ``heartbeats`` row per tick, e.g.
``* * * * * *`` for every second; unset: no such schedule), ``SDCORE_GRACE_MS`` (default 10000).
"""

from __future__ import annotations

import logging
import os

import psycopg
from flask import Flask, request

from sdcore.postgres import PoolSettings
from sdcore.scheduling import Tick
from sdcore.sync import Runtime

DATABASE_URL = os.environ["DATABASE_URL"]

logging.basicConfig(
    level=logging.INFO, format="%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"
)
log = logging.getLogger("flask_app")

# Built at import (no thread, no connection): safe in Gunicorn's master with preload_app.
runtime = Runtime(
    DATABASE_URL,
    pool=PoolSettings(max_size=4, application_name="flask-app"),
    grace_period_ms=int(os.environ.get("SDCORE_GRACE_MS", "10000")),
)

TABLES = """
CREATE TABLE IF NOT EXISTS signups (
    email      text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS daily_signups (
    day           date PRIMARY KEY,
    signups       bigint NOT NULL,
    fencing_token bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS heartbeats (
    id            bigserial PRIMARY KEY,
    run_key       text NOT NULL,
    fencing_token bigint NOT NULL,
    pid           int NOT NULL,
    at            timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


def create_tables() -> None:
    """Create the example's own tables (the runtime creates sdcore's: ``ensure_schema``)."""
    with psycopg.connect(DATABASE_URL) as conn:
        # Several masters may start at once: one creates, the others find the tables.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('sdcore flask_app example'))")
        conn.execute(TABLES)


@runtime.scheduler.cron(os.environ.get("NIGHTLY_CRON", "0 1 * * *"), name="nightly-report")
def nightly_report(tick: Tick) -> None:
    """Count yesterday's signups, once per night across every worker and pod."""
    assert tick.lease is not None  # exclusive (the default): the lease's fencing token
    day = tick.scheduled_at.date()
    with psycopg.connect(DATABASE_URL) as conn:
        conn.execute(
            "INSERT INTO daily_signups (day, signups, fencing_token)"
            " SELECT %s, count(*), %s FROM signups"
            " WHERE created_at >= %s::date - 1 AND created_at < %s::date"
            " ON CONFLICT (day) DO NOTHING",
            (day, tick.lease.fencing_token, day, day),
        )
    log.info("nightly report for %s done", day)


if os.environ.get("HEARTBEAT_CRON"):

    @runtime.scheduler.cron(os.environ["HEARTBEAT_CRON"], name="heartbeat")
    def heartbeat(tick: Tick) -> None:
        """One row per tick: run once across the cluster, whichever worker wins the lease."""
        assert tick.lease is not None
        with psycopg.connect(DATABASE_URL) as conn:
            conn.execute(
                "INSERT INTO heartbeats (run_key, fencing_token, pid) VALUES (%s, %s, %s)",
                (tick.run_key, tick.lease.fencing_token, os.getpid()),
            )


app = Flask(__name__)


@app.get("/healthz")
def healthz() -> tuple[dict[str, object], int]:
    """Readiness of this worker's runtime (database reachable, scheduler running)."""
    result = runtime.readiness()
    return result.as_dict(details=True), 200 if result.ok else 503


@app.post("/signups")
def signup() -> tuple[dict[str, object], int]:
    """Record a signup and its welcome mail in one transaction: both or neither."""
    email = str((request.get_json(silent=True) or {}).get("email", "")).strip().lower()
    if "@" not in email:
        return {"error": "an email address is required"}, 400
    with psycopg.connect(DATABASE_URL) as conn, conn.transaction():
        conn.execute("INSERT INTO signups (email) VALUES (%s) ON CONFLICT DO NOTHING", (email,))
        runtime.outbox.enqueue_once(
            conn,
            idempotency_key=f"welcome:{email}",
            queue="mail",
            name="welcome",
            payload={"email": email},
        )
    return {"email": email}, 201
