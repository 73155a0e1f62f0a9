"""The run history's group commit: many runs, few statements; a failed statement loses no run;
the statements wait for the scheduler's acquires."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sdcore.job_scheduler import AttemptAcquireResult, AttemptBudget, JobAcquireOptions
from sdcore.scheduling import Tick
from sdcore.scheduling._batch import TickAcquirer
from sdcore.scheduling._control import Replica, RunFinish, RunStart
from sdcore.scheduling._history import YIELD_S, RunHistory
from sdcore.scheduling._runner import Handler
from sdcore.testing import MemoryJobScheduler, MemoryScheduleStore

AT = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
REPLICA = Replica(replica_id="00000000-0000-0000-0000-000000000001", host="h", pid=1)


class Refused(Exception):
    """A statement the server refused (nothing written), as psycopg reports it."""

    sqlstate = "22021"


class CountingStore(MemoryScheduleStore):
    """Counts the statements; refuses any containing a schedule of ``refuse``; fails the
    first ``fail`` start statements as a broken connection would; holds starts on ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.refuse: set[str] = set()
        self.fail = 0
        self.gate: asyncio.Event | None = None

    async def runs_started(self, runs: Sequence[RunStart]) -> list[int]:
        self.starts.append(len(runs))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise ConnectionError("connection lost")
        if any(r.schedule in self.refuse for r in runs):
            raise Refused("invalid byte sequence")
        return await super().runs_started(runs)

    async def runs_finished(self, runs: Sequence[RunFinish]) -> None:
        self.ends.append(len(runs))
        await super().runs_finished(runs)


def _tick(name: str, minute: int = 0) -> Tick:
    at = AT + timedelta(minutes=minute)
    return Tick(
        schedule=name, scheduled_at=at, local_time=at, run_key=at.strftime("%Y-%m-%dT%H:%MZ")
    )


def _history(store: CountingStore, **kwargs: int) -> RunHistory:
    history = RunHistory(store, REPLICA, logging.getLogger("test.history"), **kwargs)
    history.loop = asyncio.get_running_loop()
    return history


async def _statuses(store: CountingStore, names: Sequence[str]) -> list[str]:
    return [r.status for name in names for r in await store.history(name, 10)]


async def test_runs_started_together_share_one_statement_each() -> None:
    store = CountingStore()
    history = _history(store)
    ran: list[str] = []

    async def handler(tick: Tick) -> str:
        ran.append(tick.schedule)
        await asyncio.sleep(0)
        return tick.schedule

    recorded = history.wrap("x", handler)
    names = [f"s{i:03d}" for i in range(300)]
    results = await asyncio.gather(*(recorded(_tick(n)) for n in names))
    assert results == names
    assert (store.starts, store.ends) == ([300], [300])
    assert await _statuses(store, names) == ["SUCCESS"] * 300


@pytest.mark.parametrize(
    ("in_flight", "max_items", "statements"),
    [(1, 100, 3), (2, 100, 3), (4, 1_000, 1)],
    ids=["one-at-a-time", "two-at-a-time", "all-in-one"],
)
async def test_a_statement_holds_at_most_max_items_rows(
    in_flight: int, max_items: int, statements: int
) -> None:
    store = CountingStore()
    history = _history(store, in_flight=in_flight, max_items=max_items)
    recorded = history.wrap("x", _noop)
    names = [f"s{i:03d}" for i in range(250)]
    await asyncio.gather(*(recorded(_tick(n)) for n in names))
    assert len(store.starts) == statements
    assert max(store.starts) <= max_items
    assert sum(store.starts) == sum(store.ends) == 250
    assert await _statuses(store, names) == ["SUCCESS"] * 250


async def test_runs_requested_while_a_statement_is_out_leave_together() -> None:
    store = CountingStore()
    store.gate = asyncio.Event()
    history = _history(store, in_flight=1)
    recorded = history.wrap("x", _noop)
    first = asyncio.create_task(_call(recorded, _tick("first")))
    await asyncio.sleep(0.01)
    assert store.starts == [1]  # out, and held
    later = [asyncio.create_task(_call(recorded, _tick(f"s{i}"))) for i in range(50)]
    await asyncio.sleep(0.01)
    assert store.starts == [1]  # queued behind it
    store.gate.set()
    await asyncio.gather(first, *later)
    assert store.starts == [1, 50]


async def test_a_failed_statement_is_logged_and_the_runs_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = CountingStore()
    store.fail = 1
    history = _history(store)
    recorded = history.wrap("x", _noop)
    names = [f"s{i:02d}" for i in range(12)]
    with caplog.at_level(logging.WARNING, "test.history"):
        results = await asyncio.gather(*(recorded(_tick(n)) for n in names))
    assert results == [None] * 12
    assert store.starts == [12]
    assert store.ends == []  # no start row: no end to record
    (line,) = [r for r in caplog.records if r.getMessage().startswith("run history")]
    assert "12 run start(s) not recorded" in line.getMessage()
    assert "'s00'" in line.getMessage()
    assert "and 2 more" in line.getMessage()
    assert getattr(line, "schedules", None) == names


async def test_a_refused_row_loses_none_of_the_others(caplog: pytest.LogCaptureFixture) -> None:
    store = CountingStore()
    store.refuse = {"bad"}
    history = _history(store)
    recorded = history.wrap("x", _noop)
    names = [f"s{i:02d}" for i in range(7)]
    with caplog.at_level(logging.WARNING, "test.history"):
        await asyncio.gather(*(recorded(_tick(n)) for n in [*names[:3], "bad", *names[3:]]))
    assert await _statuses(store, names) == ["SUCCESS"] * 7
    assert await store.history("bad", 10) == []
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run history")]
    assert logged == [
        "run history: 1 run start(s) not recorded (schedule 'bad'): invalid byte sequence"
    ]
    assert store.starts[0] == 8
    assert len(store.starts) <= 1 + 2 * 3  # halved until alone: about 2·log2(8) statements


async def test_the_handler_does_not_wait_for_its_start_row() -> None:
    """Nothing comes between the gate's last look (the runner's) and the handler: the start row
    is queued, and the handler runs while it is written."""
    store = CountingStore()
    store.gate = asyncio.Event()  # the start statement waits
    history = _history(store)
    ran: list[str] = []

    async def handler(tick: Tick) -> None:
        ran.append(tick.schedule)

    task = asyncio.create_task(_call(history.wrap("x", handler), _tick("quick")))
    await asyncio.sleep(0.01)
    assert ran == ["quick"]
    assert not task.done()  # its end waits for the start's id
    store.gate.set()
    await task
    ((run),) = await store.history("quick", 10)
    assert run.status == "SUCCESS"


async def test_a_run_cancelled_while_its_start_is_written_is_closed_as_cancelled() -> None:
    store = CountingStore()
    store.gate = asyncio.Event()
    history = _history(store)

    async def slow(tick: Tick) -> None:
        await asyncio.sleep(10)

    for handler in (_noop, slow):  # cancelled after its handler, and during it
        task = asyncio.create_task(_call(history.wrap("x", handler), _tick(handler.__name__)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    store.gate.set()
    await history.drain()
    for name in ("_noop", "slow"):
        ((run),) = await store.history(name, 10)
        assert (run.status, run.error) == ("FAIL", "cancelled")


async def test_a_run_cancelled_while_its_rows_wait_for_their_statement_keeps_both_rows() -> None:
    """The start row still queued (its statement waits for the acquires) when the run is
    cancelled after its handler: written all the same and closed as cancelled. The end row
    queued when the run is cancelled: written as the handler ended."""
    store = CountingStore()
    history = _history(store)
    acquires_done = asyncio.Event()

    async def quiet(at_most_s: float) -> None:
        await acquires_done.wait()

    history.quiet = quiet
    task = asyncio.create_task(_call(history.wrap("x", _noop), _tick("queued")))
    await asyncio.sleep(0.01)
    assert store.starts == []  # the start row waits for the acquires
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    acquires_done.set()
    await history.drain()
    ((run),) = await store.history("queued", 10)
    assert (run.status, run.error) == ("FAIL", "cancelled")

    store.gate = asyncio.Event()
    history.quiet = None
    task = asyncio.create_task(_call(history.wrap("x", _noop), _tick("ending")))
    await asyncio.sleep(0.01)  # the start statement is out
    acquires_done.clear()
    history.quiet = quiet  # the end row's statement will wait
    store.gate.set()
    await asyncio.sleep(0.01)
    assert store.ends == [1]  # the first run's end only: this one's waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    acquires_done.set()
    await history.drain()
    ((run),) = await store.history("ending", 10)
    assert (run.status, run.error) == ("SUCCESS", None)


async def test_sync_handlers_record_through_the_loop() -> None:
    store = CountingStore()
    history = _history(store)

    def handler(tick: Tick) -> str:
        if tick.schedule == "boom":
            raise ValueError("boom")
        return tick.schedule

    recorded = history.wrap("x", handler)
    names = [f"s{i}" for i in range(20)]
    results = await asyncio.gather(
        *(asyncio.to_thread(recorded, _tick(n)) for n in [*names, "boom"]),
        return_exceptions=True,
    )
    assert results[:20] == names
    assert isinstance(results[20], ValueError)
    assert await _statuses(store, names) == ["SUCCESS"] * 20
    ((failed),) = await store.history("boom", 10)
    assert failed.status == "FAIL"
    assert failed.error is not None
    assert "boom" in failed.error
    assert sum(store.starts) == sum(store.ends) == 21


async def test_statements_wait_for_the_schedulers_acquires_then_take_every_row_queued() -> None:
    """No handler waits for a history row, and every handler of a burst waits for its acquire:
    the history's statements go out once the scheduler has no acquire in flight, or after
    YIELD_S, whichever comes first, with every row queued by then."""
    store = CountingStore()
    history = _history(store)
    acquires_done = asyncio.Event()
    asked: list[float] = []

    async def quiet(at_most_s: float) -> None:
        asked.append(at_most_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(acquires_done.wait(), at_most_s)

    history.quiet = quiet
    ran: list[str] = []

    async def handler(tick: Tick) -> None:
        ran.append(tick.schedule)

    recorded = history.wrap("x", handler)
    first = [asyncio.create_task(_call(recorded, _tick(f"a{i}"))) for i in range(30)]
    await asyncio.sleep(0.05)
    later = [asyncio.create_task(_call(recorded, _tick(f"b{i}"))) for i in range(20)]
    await asyncio.sleep(0.05)
    assert len(ran) == 50  # the handlers ran
    assert store.starts == []  # their rows wait for the acquires
    acquires_done.set()
    await asyncio.gather(*first, *later)
    assert store.starts == [50]  # one statement, with the rows queued meanwhile
    assert store.ends == [50]
    assert set(asked) == {YIELD_S}


@pytest.mark.parametrize("held", [True, False])
async def test_acquirer_quiet_waits_for_the_calls_in_flight_at_most_as_long_as_asked(
    held: bool,
) -> None:
    release = asyncio.Event()

    class Held(MemoryJobScheduler):
        async def acquire_attempts(
            self, items: Sequence[tuple[JobAcquireOptions, AttemptBudget]]
        ) -> list[AttemptAcquireResult]:
            await release.wait()
            return await super().acquire_attempts(items)

    acquirer = TickAcquirer(Held(), logging.getLogger("test.acquirer"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    await acquirer.quiet(5.0)
    assert loop.time() - started < 0.05  # nothing in flight: at once
    budget = AttemptBudget(max_attempts=1, backoff_ms=0)
    asked = asyncio.create_task(
        acquirer.acquire(JobAcquireOptions(code="x", run_key="k", lease_ms=1_000), budget)
    )
    await asyncio.sleep(0)  # queued; flushed at the next turn
    if not held:
        loop.call_later(0.1, release.set)
    started = loop.time()
    await acquirer.quiet(0.3)
    waited = loop.time() - started
    if held:
        assert 0.3 <= waited < 0.5  # the call still out: no longer than asked
        assert not asked.done()
        release.set()
    else:
        assert 0.1 <= waited < 0.3  # returned once the call was answered
    assert (await asked).attempt == 1


async def _noop(tick: Tick) -> None:
    return None


async def _call(handler: Handler, tick: Tick) -> Any:
    return await handler(tick)
