"""``sdcore.sync.Runtime`` without a server: its arguments are the async Runtime's, it is inert
until started, and bad arguments are refused with the argument's name."""

from __future__ import annotations

import inspect
import threading

import pytest

import sdcore
from sdcore.runtime import RuntimeStateError
from sdcore.scheduling import Tick
from sdcore.sync import Runtime

DSN = "postgresql://nobody@127.0.0.1:1/none"


def test_the_arguments_are_the_async_runtimes_plus_two() -> None:
    mine = inspect.signature(Runtime).parameters
    theirs = {
        name: parameter
        for name, parameter in inspect.signature(sdcore.Runtime).parameters.items()
        if parameter.kind is not inspect.Parameter.VAR_KEYWORD  # the 0.1 keywords
    }
    assert list(mine) == [*theirs, "handler_threads", "stop_on_sigterm"]
    for name, parameter in theirs.items():
        assert mine[name].kind is parameter.kind, name
        assert mine[name].default == parameter.default, name
    assert mine["handler_threads"].default == 8
    assert mine["stop_on_sigterm"].default is True


def test_construction_starts_nothing_and_takes_plain_handlers() -> None:
    before = threading.active_count()
    runtime = Runtime(DSN, stop_on_sigterm=False)

    @runtime.scheduler.cron("0 1 * * *", name="nightly")
    def nightly(tick: Tick) -> None: ...

    @runtime.scheduler.interval(1_000, name="often")
    def often(tick: Tick) -> None: ...

    @runtime.scheduler.timeout(10, name="once")
    def once(tick: Tick) -> None: ...

    assert threading.active_count() == before
    assert {info.name for info in runtime.scheduler.schedules()} == {"nightly", "often", "once"}
    assert runtime.scheduler is runtime.aio.scheduler
    assert runtime.events is runtime.aio.events
    assert not runtime.started
    assert not runtime.portal.running
    assert runtime.aio.pool_settings.max_size == 10
    runtime.stop()  # not started: nothing to do
    assert repr(runtime) == "<sdcore.sync.Runtime stopped>"


def test_probes_of_a_runtime_not_started() -> None:
    runtime = Runtime(DSN)
    live = runtime.liveness()
    assert not live.ok
    assert live.checks["runtime"].detail == "not started"
    assert not runtime.readiness().ok
    with pytest.raises(RuntimeStateError, match="not started: start"):
        runtime.health()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"handler_threads": 0},
            ValueError,
            "handler_threads must be an int from 1 to 1024, got 0",
        ),
        ({"handler_threads": 2000}, ValueError, "handler_threads must be an int from 1 to 1024"),
        ({"handler_threads": True}, TypeError, "handler_threads must be an int"),
        ({"handler_threads": "8"}, TypeError, "handler_threads must be an int"),
        ({"stop_on_sigterm": 1}, TypeError, "stop_on_sigterm must be a bool"),
        ({"grace_period_ms": -1}, ValueError, "grace_period_ms"),
        ({"pool_max_size": 4}, TypeError, "pool_max_size"),
    ],
    ids=["zero", "too-many", "bool", "str", "sigterm-int", "grace", "0.1-keyword"],
)
def test_bad_arguments_are_refused_by_name(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Runtime(DSN, **kwargs)  # type: ignore[arg-type]
