"""The portal under a stop: every caller returns, whatever the moment its call reached the loop."""

from __future__ import annotations

import asyncio
import threading

from sdcore.runtime import RuntimeStateError
from sdcore.sync._portal import Portal


async def _nap() -> int:
    await asyncio.sleep(0)
    return 1


def _race(callers: int) -> tuple[list[threading.Thread], list[str]]:
    """``callers`` threads calling the portal in a loop while it stops."""
    portal = Portal(name="race")
    portal.start()
    outcomes: list[str] = []
    go = threading.Event()

    def caller() -> None:
        go.wait()
        while True:
            try:
                portal.call(_nap)
            except RuntimeStateError as exc:
                outcomes.append(str(exc))
                return

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for thread in threads:
        thread.start()
    go.set()
    portal.stop()
    for thread in threads:
        thread.join(5)
    return threads, outcomes


def test_calls_racing_a_stop_all_return_a_clear_error() -> None:
    for _ in range(30):
        threads, outcomes = _race(4)
        assert not any(thread.is_alive() for thread in threads), "a caller waits for ever"
        assert len(outcomes) == 4
        assert all("portal" in text for text in outcomes), outcomes
