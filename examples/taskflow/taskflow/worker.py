"""``python -m taskflow.worker``: the notifications worker on its own (no HTTP).

By default every API replica also processes the ``notifications`` queue. To move that work to
separate processes, start the API with ``TASKFLOW_RUN_WORKERS=0`` and run this instead: the
producer side (outbox + relay) does not change. It is ``sdcore run`` on :func:`runtime`, so these
two commands are the same::

    python -m taskflow.worker
    sdcore run taskflow.worker:runtime --no-scheduler --no-relay --log-level INFO
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from sdcore.postgres import PoolSettings
from sdcore.runtime import Runtime

from taskflow.settings import Settings, SettingsError

COMMAND = ["run", "taskflow.worker:runtime", "--no-scheduler", "--no-relay"]


def runtime() -> Runtime:
    """A Runtime that processes the notification jobs (no relay, no schedules: the API has them).

    Raises:
        SettingsError: Bad settings, or no ``REDIS_URL`` (no queue to work on).
    """
    from taskflow.queueing import NotificationsProcessor

    settings = Settings.from_env()
    if not settings.queues_enabled:
        raise SettingsError("REDIS_URL is not set: no queue to work on")
    return Runtime(
        database_url=settings.libpq_url,
        redis_url=settings.redis_url,
        processors=[NotificationsProcessor()],
        pool=PoolSettings(max_size=2),
        relay=None,
        scheduling=None,
        queue_prefix=settings.queue_prefix,
        logger_name="taskflow.worker",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``sdcore run`` on :func:`runtime`; return its exit status.

    Extra arguments are passed on (``--log-json``, ``--ready-file PATH``, …); logging is at INFO
    unless ``--log-level`` says otherwise. Bad settings exit 2 with one line.
    """
    from sdcore.cli import main as sdcore_main

    extra = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"taskflow.worker: {exc}", file=sys.stderr)
        return 2
    if not settings.queues_enabled:
        print("taskflow.worker: REDIS_URL is not set: no queue to work on", file=sys.stderr)
        return 2
    if "--log-level" not in extra:
        extra += ["--log-level", "INFO"]
    return sdcore_main([*COMMAND, *extra])


if __name__ == "__main__":
    sys.exit(main())
