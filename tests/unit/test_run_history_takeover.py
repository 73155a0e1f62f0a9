"""The in-memory store closes a tick's superseded RUNNING attempt as PostgreSQL does."""

from __future__ import annotations

from datetime import UTC, datetime

from sdcore.scheduling._control import Replica, RunStart
from sdcore.testing import MemoryScheduleStore

AT = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def _start(token: int, pid: int, run_key: str = "2026-12-01T09:00:00Z") -> RunStart:
    return RunStart(
        schedule="report",
        run_key=run_key,
        source="tick",
        scheduled_at=AT,
        attempt=token,
        fencing_token=token,
        replica=Replica(replica_id=f"00000000-0000-0000-0000-00000000000{pid}", host="h", pid=pid),
    )


async def test_a_takeover_closes_the_earlier_running_attempt() -> None:
    store = MemoryScheduleStore()
    await store.run_started(_start(1, 1))
    await store.run_started(_start(1, 3, run_key="2026-12-01T10:00:00Z"))  # another tick
    await store.run_started(_start(2, 2))
    runs = {(r.run_key, r.fencing_token): r for r in await store.history("report", 10)}
    old = runs[("2026-12-01T09:00:00Z", 1)]
    assert (old.status, old.error) == (
        "FAIL",
        "abandoned: the tick was taken over (fencing token 2)",
    )
    assert old.finished_at is not None
    assert runs[("2026-12-01T09:00:00Z", 2)].status == "RUNNING"
    assert runs[("2026-12-01T10:00:00Z", 1)].status == "RUNNING"
