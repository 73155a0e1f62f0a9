"""A contender process for the acceptance tests: ``python -m tests.acceptance._worker``.

Every process owns its own ``JobSchedulerService`` (its own pool and connection). It reads one
JSON command per line on stdin and answers with JSON lines on stdout; nothing else is written to
stdout (logs go to stderr).

Commands that race take part in a barrier: the worker prepares everything (connection, validated
options), answers ``{"ready": true}`` and blocks until the parent sends ``{"op": "go"}`` to all
contenders at once; only then does it send its statement. A failure before the barrier is
answered instead of ``ready``.

Commands (``op``):

- ``open`` ``{dsn, app, options}``: connect a service (pool min_size=1, max_size=1).
- ``close``: close it.
- ``acquire`` ``{options, barrier}``: one ``acquire``.
- ``acquire_many`` ``{items, barrier}``: one ``acquire_many`` (answers ``results``, in order).
- ``acquire_until`` ``{options, deadline_s, pause_s}``: retry ``acquire`` until it wins.
- ``run_exclusive`` ``{options, sleep_s}``: ``run_exclusive`` with an async fn that announces
  ``{"event": "started", ...}`` and then sleeps.
- ``ensure_schema`` ``{dsn, app, schema, barrier}``: connect a service for ``schema`` and apply
  the schema after the barrier.
- ``clock``: this process's wall clock next to the database's ``clock_timestamp()``.
- ``keys`` ``{cases}``: lock/idempotency keys of ``[code, run_key, type]`` identities.
- ``exit``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from typing import Any

import psycopg

from sdcore.job_scheduler import (
    JobAcquireOptions,
    JobAcquireResult,
    JobExecutionLease,
    JobSchedulerService,
    bullmq_job_id,
    idempotency_key,
    lock_key,
)
from sdcore.postgres import PoolSettings

Json = dict[str, Any]


class Aborted(Exception):
    """The parent called the round off before ``go``."""


def emit(obj: Json) -> None:
    """Write one JSON line to stdout and flush it."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def barrier() -> None:
    """Announce readiness and block until the parent says ``go``."""
    emit({"ready": True})
    line = sys.stdin.readline()
    if not line:
        raise Aborted("stdin closed before go")
    if json.loads(line).get("op") != "go":
        raise Aborted(f"expected go, got {line.strip()[:80]}")


def describe(result: JobAcquireResult) -> Json:
    """The JSON form of an acquire result."""
    if not result.acquired:
        return {"acquired": False}
    return {
        "acquired": True,
        "id": result.id,
        "owner_token": result.owner_token,
        "fencing_token": result.fencing_token,
        "idempotency_key": result.idempotency_key,
        "modified_at": result.row.modified_at.isoformat(),
    }


class Worker:
    """The state of one contender process."""

    def __init__(self) -> None:
        self.stack: AsyncExitStack | None = None
        self.service: JobSchedulerService | None = None
        self.dsn: str | None = None

    def svc(self) -> JobSchedulerService:
        if self.service is None:
            raise RuntimeError("no service: send 'open' first")
        return self.service

    async def op_open(self, cmd: Json) -> Json:
        await self.op_close(cmd)
        stack = AsyncExitStack()
        self.service = await stack.enter_async_context(
            JobSchedulerService.connect(
                cmd["dsn"],
                pool=PoolSettings(
                    min_size=1, max_size=1, application_name=cmd.get("app", "sdcore")
                ),
                **cmd.get("options", {}),
            )
        )
        self.stack = stack
        self.dsn = cmd["dsn"]
        return {"ok": True, "pid": os.getpid()}

    async def op_close(self, cmd: Json) -> Json:
        stack, self.stack, self.service = self.stack, None, None
        if stack is not None:
            await stack.aclose()
        return {"ok": True}

    async def op_acquire(self, cmd: Json) -> Json:
        svc = self.svc()
        opts = JobAcquireOptions(**cmd["options"])
        if cmd.get("barrier"):
            barrier()
        t0 = time.monotonic()
        result = await svc.acquire(opts)
        t1 = time.monotonic()
        return {**describe(result), "ms": (t1 - t0) * 1000, "t0": t0, "t1": t1}

    async def op_acquire_many(self, cmd: Json) -> Json:
        svc = self.svc()
        items = [JobAcquireOptions(**item) for item in cmd["items"]]
        if cmd.get("barrier"):
            barrier()
        t0 = time.monotonic()
        results = await svc.acquire_many(items)
        t1 = time.monotonic()
        return {"results": [describe(result) for result in results], "ms": (t1 - t0) * 1000}

    async def op_acquire_until(self, cmd: Json) -> Json:
        svc = self.svc()
        opts = JobAcquireOptions(**cmd["options"])
        deadline = time.monotonic() + float(cmd.get("deadline_s", 20))
        pause = float(cmd.get("pause_s", 0.05))
        falses = 0
        while True:
            result = await svc.acquire(opts)
            if result.acquired:
                return {**describe(result), "falses": falses}
            falses += 1
            if time.monotonic() >= deadline:
                return {"acquired": False, "falses": falses, "gave_up": True}
            await asyncio.sleep(pause)

    async def op_run_exclusive(self, cmd: Json) -> Json:
        svc = self.svc()
        sleep_s = float(cmd["sleep_s"])

        async def work(lease: JobExecutionLease) -> str:
            emit(
                {
                    "event": "started",
                    "id": lease.id,
                    "owner_token": lease.owner_token,
                    "fencing_token": lease.fencing_token,
                    "pid": os.getpid(),
                }
            )
            await asyncio.sleep(sleep_s)
            return "finished"

        outcome = await svc.run_exclusive(cmd["options"], work)
        return {"acquired": outcome.acquired, "result": outcome.result}

    async def op_ensure_schema(self, cmd: Json) -> Json:
        async with JobSchedulerService.connect(
            cmd["dsn"],
            pool=PoolSettings(min_size=1, max_size=1, application_name=cmd.get("app", "sdcore")),
            schema=cmd.get("schema"),
        ) as svc:
            if cmd.get("barrier"):
                barrier()
            await svc.ensure_schema()
        return {"ok": True}

    async def op_clock(self, cmd: Json) -> Json:
        dsn = cmd.get("dsn") or self.dsn
        if dsn is None:
            raise RuntimeError("clock needs a dsn")
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            wall_before = time.time()
            cur = await conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8")
            row = await cur.fetchone()
            wall_after = time.time()
        assert row is not None
        return {
            "wall": (wall_before + wall_after) / 2,
            "db": float(row[0]),
            "wall_iso": datetime.now(UTC).isoformat(),
            "monotonic": time.monotonic(),
        }

    async def op_keys(self, cmd: Json) -> Json:
        keys = []
        for code, run_key, type_ in cmd["cases"]:
            lk = lock_key(code, run_key, type_)
            ik = idempotency_key(code, run_key, type_)
            opts = JobAcquireOptions(code=code, run_key=run_key, type=type_)
            if (opts.lock_key, opts.idempotency_key) != (lk, ik):
                raise AssertionError("JobAcquireOptions and the key helpers disagree")
            keys.append([lk, ik, bullmq_job_id(ik)])
        return {
            "keys": keys,
            "hash_probe": hash("sdcore-hash-probe"),
            "utcoffset": time.strftime("%z", time.localtime(1_700_000_000)),
            "tz_env": os.environ.get("TZ"),
        }


def serve() -> None:
    """Answer commands from stdin until ``exit`` or end of input."""
    worker = Worker()
    handlers: dict[str, Callable[[Json], Coroutine[Any, Any, Json]]] = {
        "open": worker.op_open,
        "close": worker.op_close,
        "acquire": worker.op_acquire,
        "acquire_many": worker.op_acquire_many,
        "acquire_until": worker.op_acquire_until,
        "run_exclusive": worker.op_run_exclusive,
        "ensure_schema": worker.op_ensure_schema,
        "clock": worker.op_clock,
        "keys": worker.op_keys,
    }
    with asyncio.Runner() as runner:
        try:
            while True:
                line = sys.stdin.readline()
                if not line:
                    break
                cmd = json.loads(line)
                op = cmd.get("op")
                if op == "exit":
                    break
                handler = handlers.get(op)
                if handler is None:
                    emit({"error": "UnknownCommand", "message": repr(op)})
                    continue
                reply: Json
                try:
                    reply = runner.run(handler(cmd))
                except Exception as exc:
                    reply = {"error": type(exc).__name__, "message": str(exc)[:500]}
                emit(reply)
        finally:
            runner.run(worker.op_close({}))


if __name__ == "__main__":
    serve()
