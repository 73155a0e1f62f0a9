"""``python -m taskflow.worker``: the notifications worker on its own (no HTTP).

By default every API replica also processes the ``notifications`` queue. To move that work to
separate processes, start the API with ``TASKFLOW_RUN_WORKERS=0`` and run this instead: the
producer side (outbox + relay) does not change.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from taskflow.settings import Settings, SettingsError


async def run(settings: Settings) -> None:
    """Process notification jobs until SIGINT/SIGTERM."""
    from sdcore.queues import Workers

    from taskflow.queueing import NotificationsProcessor

    assert settings.redis_url is not None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Workers(
        [NotificationsProcessor()], redis_url=settings.redis_url, prefix=settings.queue_prefix
    ) as workers:
        await workers.wait_ready()
        logging.getLogger(__name__).info("notifications worker ready")
        await stop.wait()


def main() -> int:
    """Entry point; return the exit status (2: bad settings or no ``REDIS_URL``)."""
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"taskflow.worker: {exc}", file=sys.stderr)
        return 2
    if not settings.queues_enabled:
        print("taskflow.worker: REDIS_URL is not set: no queue to work on", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s"
    )
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
