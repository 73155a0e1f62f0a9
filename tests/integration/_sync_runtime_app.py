"""A script around ``sdcore.sync.Runtime`` for the subprocess tests: ``python -m
tests.integration._sync_runtime_app MODE`` with ``DATABASE_URL`` set.

Modes: ``sigterm`` (start, then sleep until killed), ``exit`` (start, then leave the main thread
without ``stop()``), ``start`` (``start()`` against an unanswering server, until killed),
``fork-started`` (start, fork: the child's ``start()`` and ``health()`` must be refused),
``fork-built`` (build, fork, the child starts and stops its own), ``two`` (two runtimes, then
sleep until killed). Lines on stdout say where it is; logs go to stderr.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from sdcore.postgres import PoolSettings
from sdcore.runtime import RuntimeStateError
from sdcore.scheduling import Tick
from sdcore.sync import Runtime


def say(line: str) -> None:
    print(line, flush=True)  # noqa: T201 - the test reads stdout


def build(name: str = "a") -> Runtime:
    runtime = Runtime(
        os.environ["DATABASE_URL"],
        pool=PoolSettings(max_size=2, connect_timeout=30),
        grace_period_ms=2_000,
        control=None,
        logger_name=f"sdcore.runtime.{name}",
    )

    @runtime.scheduler.interval(200, name=f"tick-{name}", exclusive=False)
    def tick(tick: Tick) -> None:
        del tick

    return runtime


def child(runtime: Runtime) -> int:
    try:
        runtime.health()
    except RuntimeStateError as exc:
        say(f"child health refused: {exc}")
    try:
        runtime.start()
    except RuntimeStateError as exc:
        say(f"child start refused: {exc}")
        return 0
    return 1


def main(mode: str) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(process)d %(name)s %(message)s"
    )
    if mode == "start":
        runtime = build()
        say("starting")
        runtime.start()
        say("started")  # not reached: the server never answers
        return 1
    if mode == "two":
        first, second = build("a"), build("b")
        first.start()
        second.start()
        say("ready")
        time.sleep(60)
        return 1
    runtime = build()
    if mode == "fork-built":
        pid = os.fork()
        if pid == 0:
            with runtime:
                say(f"child started: {runtime.health()['database'].ok}")
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        say(f"child status {os.waitstatus_to_exitcode(status)}")
        return 0
    runtime.start()
    say("ready")
    if mode == "sigterm":
        time.sleep(60)
        return 1
    if mode == "exit":
        return 0  # no stop(): interpreter exit stops it
    if mode == "fork-started":
        pid = os.fork()
        if pid == 0:
            os._exit(child(runtime))
        _, status = os.waitpid(pid, 0)
        say(f"child status {os.waitstatus_to_exitcode(status)}")
        say(f"parent still healthy: {runtime.health()['database'].ok}")
        runtime.stop()
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
