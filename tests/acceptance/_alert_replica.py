"""One replica of the alerting acceptance test: ``python -m tests.acceptance._alert_replica``.

Arguments: the database URL, the webhook receiver's URL, the hold file, the replica id. A
Runtime with alerting (a webhook sink) runs one exclusive interval schedule, ``beacon``, with
catch-up ``all``. Its handler prints one JSON line per start (``{"started": run_key, …}``) and,
while the hold file exists, hangs (the test kills the replica mid-tick with SIGKILL). SIGTERM
stops it cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from sdcore.alerting import Alerting, WebhookSink
from sdcore.runtime import Runtime
from sdcore.scheduling import ControlSettings, Tick

SECRET = "acceptance-secret-0123456789"
EVERY_MS = 3_000
LEASE_MS = 1_500


async def main(dsn: str, hook: str, hold: str, replica: str) -> None:
    alerting = Alerting(
        [WebhookSink(f"{hook}/hook", secret=SECRET)],
        poll_interval_ms=200,
        retry_base_ms=200,
        missed_after_ms=2_500,
        scan_interval_ms=500,
    )
    runtime = Runtime(
        dsn,
        control=ControlSettings(poll_interval_ms=200, heartbeat_ms=500),
        alerting=alerting,
        grace_period_ms=1_000,
    )

    @runtime.scheduler.interval(
        EVERY_MS, name="beacon", catch_up="all", lease_ms=LEASE_MS, max_runtime_ms=60_000
    )
    async def beacon(tick: Tick) -> None:
        line = {"started": tick.run_key, "attempt": tick.attempt, "replica": replica}
        print(json.dumps(line), flush=True)  # noqa: T201 - the test reads it
        if os.path.exists(hold):
            await asyncio.sleep(120)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with runtime:
        print(json.dumps({"ready": replica}), flush=True)  # noqa: T201
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
