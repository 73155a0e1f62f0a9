"""The in-process event bus: ordering, errors, emit_async, wildcards, drain, cancellation."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import gc
import logging
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdcore.events
from sdcore.events import (
    MAX_EVENT_NAME_LENGTH,
    EventBus,
    EventError,
    EventLoopRequiredError,
    InvalidEventNameError,
    InvalidListenerError,
    Subscription,
    UnknownEventError,
)
from sdcore.events._bus import CACHE_LIMIT
from sdcore.events._patterns import match_segments

LOGGER = "sdcore.events"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StatusChanged:
    task_id: str
    to: str


EVENT = StatusChanged(task_id="t1", to="DONE")


def _failures(caplog: pytest.LogCaptureFixture, action: str = "listener_failed") -> list[Any]:
    return [r for r in caplog.records if getattr(r, "action", None) == action]


def _reference(pattern: Sequence[str], name: Sequence[str]) -> bool:
    """The obvious recursive definition: ``*`` eats one segment, ``**`` zero or more."""
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return _reference(rest, name) or (bool(name) and _reference(pattern, name[1:]))
    return bool(name) and head in ("*", name[0]) and _reference(rest, name[1:])


# -- surface ------------------------------------------------------------------------------------


def test_public_surface_is_pinned() -> None:
    assert sdcore.events.__all__ == [
        "MAX_EVENT_NAME_LENGTH",
        "EventBus",
        "EventError",
        "EventLoopRequiredError",
        "InvalidEventNameError",
        "InvalidListenerError",
        "Listener",
        "Subscription",
        "UnknownEventError",
    ]
    assert MAX_EVENT_NAME_LENGTH == 255


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (InvalidEventNameError, ValueError),
        (InvalidListenerError, TypeError),
        (UnknownEventError, LookupError),
        (EventLoopRequiredError, RuntimeError),
    ],
    ids=["name-ValueError", "listener-TypeError", "unknown-LookupError", "loop-RuntimeError"],
)
def test_error_tree(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, EventError)
    assert issubclass(error, builtin)


# -- ordering -----------------------------------------------------------------------------------


async def test_sync_listeners_run_during_emit_in_registration_order() -> None:
    bus = EventBus()
    seen: list[str] = []
    bus.on("task.status.changed", lambda e: seen.append("first"))
    bus.on("task.*.changed", lambda e: seen.append("wildcard"))
    bus.on("task.status.changed", lambda e: seen.append("third"))
    assert bus.emit("task.status.changed", EVENT) is True
    assert seen == ["first", "wildcard", "third"]


async def test_sync_async_and_deferred_order() -> None:
    bus = EventBus()
    seen: list[str] = []

    async def coroutine(event: StatusChanged) -> None:
        seen.append("coroutine")

    async def deferred_coroutine(event: StatusChanged) -> None:
        seen.append("deferred coroutine")

    bus.on("t", deferred_coroutine, deferred=True)
    bus.on("t", lambda e: seen.append("deferred sync"), deferred=True)
    bus.on("t", coroutine)
    bus.on("t", lambda e: seen.append("sync"))
    assert bus.emit("t", EVENT)
    seen.append("emit returned")
    assert seen == ["sync", "emit returned"]
    await bus.drain()
    # Tasks are not eager in 3.11: the coroutine starts on the next iteration, before the deferred
    # batch (scheduled after it); a deferred coroutine starts one iteration later still.
    assert seen == ["sync", "emit returned", "coroutine", "deferred sync", "deferred coroutine"]


async def test_deferred_listener_runs_on_a_later_loop_iteration() -> None:
    bus = EventBus()
    seen: list[str] = []
    bus.on("t", lambda e: seen.append("deferred"), deferred=True)
    assert bus.emit("t", EVENT)
    assert seen == []
    assert bus.pending == 1
    await asyncio.sleep(0)
    assert seen == ["deferred"]
    assert bus.pending == 0


async def test_emit_return_value() -> None:
    bus = EventBus()
    bus.on("only.deferred", lambda e: None, deferred=True)
    assert bus.emit("nobody.listens", EVENT) is False
    assert bus.emit("only.deferred", EVENT) is True
    await bus.drain()


async def test_registration_after_an_emit_is_seen_by_the_next_emit() -> None:
    bus = EventBus()
    seen: list[str] = []
    assert not bus.emit("a.b", EVENT)
    bus.on("a.*", lambda e: seen.append("late"))
    assert bus.emit("a.b", EVENT)
    assert seen == ["late"]


def test_resolution_cache_is_bounded() -> None:
    bus = EventBus()
    seen: list[int] = []
    bus.on("user.**", lambda e: seen.append(e))
    for i in range(CACHE_LIMIT + 10):
        assert bus.emit(f"user.{i}.created", i)
    assert len(bus._cache) <= CACHE_LIMIT
    assert seen == list(range(CACHE_LIMIT + 10))


# -- event passthrough --------------------------------------------------------------------------


async def test_event_object_is_passed_through_unchanged(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    received: list[object] = []

    def mutate(event: StatusChanged) -> None:
        event.to = "HACKED"  # type: ignore[misc]

    async def coroutine(event: StatusChanged) -> None:
        received.append(event)

    bus.on("t", received.append)
    bus.on("t", mutate)
    bus.on("t", coroutine)
    bus.on("t", received.append, deferred=True)
    bus.emit("t", EVENT)
    await bus.drain()
    assert len(received) == 3
    assert all(item is EVENT for item in received)
    assert EVENT.to == "DONE"
    [record] = _failures(caplog)
    assert record.exc_info[0] is dataclasses.FrozenInstanceError


# -- errors -------------------------------------------------------------------------------------


def _sync_boom(event: object) -> None:
    raise ValueError("boom")


async def _async_boom(event: object) -> None:
    await asyncio.sleep(0)
    raise ValueError("boom")


@pytest.mark.parametrize(
    ("listener", "deferred"),
    [(_sync_boom, False), (_async_boom, False), (_sync_boom, True), (_async_boom, True)],
    ids=["sync", "coroutine", "deferred-sync", "deferred-coroutine"],
)
async def test_listener_error_is_logged_and_others_still_run(
    caplog: pytest.LogCaptureFixture, listener: Callable[[object], Any], deferred: bool
) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    bus = EventBus()
    seen: list[str] = []
    bus.on("task.failed", listener, deferred=deferred)
    bus.on("task.failed", lambda e: seen.append("after"), deferred=deferred)
    assert bus.emit("task.failed", EVENT) is True  # nothing raised at the emitter
    await bus.drain()
    gc.collect()
    assert seen == ["after"]
    [record] = _failures(caplog)
    assert record.levelno == logging.ERROR
    assert record.name == LOGGER
    assert record.event == "task.failed"
    assert record.listener == f"{__name__}.{listener.__qualname__}"
    assert record.exc_info[0] is ValueError
    assert "'task.failed'" in record.getMessage()
    assert unhandled == []  # no "Task exception was never retrieved"


async def test_plain_emit_only_logs_a_propagating_listener(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = EventBus()
    bus.on("t", _sync_boom, propagate_errors=True)
    bus.on("t", _async_boom, propagate_errors=True)
    assert bus.emit("t", EVENT)
    await bus.drain()
    assert len(_failures(caplog)) == 2


async def test_keyboard_interrupt_is_not_swallowed() -> None:
    bus = EventBus()

    def interrupt(event: object) -> None:
        raise KeyboardInterrupt

    bus.on("t", interrupt)
    with pytest.raises(KeyboardInterrupt):
        bus.emit("t", EVENT)


# -- emit_async ---------------------------------------------------------------------------------


async def test_emit_async_returns_results_in_registration_order() -> None:
    bus = EventBus()

    async def slow(event: StatusChanged) -> str:
        await asyncio.sleep(0.02)
        return "slow"

    async def fast(event: StatusChanged) -> str:
        return "fast"

    release = asyncio.Event()

    async def deferred(event: StatusChanged) -> str:
        await release.wait()
        return "deferred"

    bus.on("t", slow)
    bus.on("t", lambda e: "sync")
    bus.on("t", fast)
    bus.on("t", deferred, deferred=True)
    assert await bus.emit_async("t", EVENT) == ["slow", "sync", "fast"]
    assert bus.pending == 1  # the deferred listener: started, not awaited
    release.set()
    await bus.drain()


async def test_emit_async_runs_coroutine_listeners_concurrently() -> None:
    bus = EventBus()
    ready = asyncio.Event()

    async def waiter(event: object) -> str:
        await ready.wait()  # would deadlock if listeners were awaited one after the other
        return "waited"

    async def setter(event: object) -> str:
        ready.set()
        return "set"

    bus.on("t", waiter)
    bus.on("t", setter)
    async with asyncio.timeout(5):
        assert await bus.emit_async("t", EVENT) == ["waited", "set"]


async def test_emit_async_raises_the_first_propagated_error_after_all_finished(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = EventBus()
    finished: list[str] = []

    async def late_failure(event: object) -> None:
        await asyncio.sleep(0.02)
        finished.append("late")
        raise LookupError("first by registration")

    async def early_failure(event: object) -> None:
        finished.append("early")
        raise KeyError("second by registration")

    async def slow_success(event: object) -> str:
        await asyncio.sleep(0.05)
        finished.append("slow")
        return "ok"

    bus.on("t", _sync_boom)  # not propagating: logged
    bus.on("t", late_failure, propagate_errors=True)
    bus.on("t", early_failure, propagate_errors=True)
    bus.on("t", slow_success)
    with pytest.raises(LookupError, match="first by registration"):
        await bus.emit_async("t", EVENT)
    assert sorted(finished) == ["early", "late", "slow"]
    logged = {r.exc_info[0] for r in _failures(caplog)}
    assert logged == {ValueError, KeyError}


async def test_emit_async_failed_listener_yields_none(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    bus.on("t", _async_boom)
    bus.on("t", lambda e: 42)
    assert await bus.emit_async("t", EVENT) == [None, 42]
    assert len(_failures(caplog)) == 1


async def test_emit_async_propagates_a_sync_error_after_the_others_ran() -> None:
    bus = EventBus()
    seen: list[str] = []
    bus.on("t", _sync_boom, propagate_errors=True)
    bus.on("t", lambda e: seen.append("after"))
    with pytest.raises(ValueError, match="boom"):
        await bus.emit_async("t", EVENT)
    assert seen == ["after"]


async def test_emit_async_without_listener() -> None:
    assert await EventBus().emit_async("nobody", EVENT) == []
    with pytest.raises(UnknownEventError):
        await EventBus(strict=True).emit_async("nobody", EVENT)


# -- wildcards ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("task.created", "task.created", True),
        ("task.created", "task.create", False),
        ("task.*", "task.created", True),
        ("task.*", "task.status.changed", False),
        ("task.*", "task", False),
        ("task.**", "task.created", True),
        ("task.**", "task.status.changed", True),
        ("task.**", "task", True),
        ("task.**", "tasks.created", False),
        ("*", "task", True),
        ("*", "task.created", False),
        ("**", "anything.at.all", True),
        ("*.status.*", "task.status.changed", True),
        ("*.status.*", "task.status", False),
        ("task.**.changed", "task.changed", True),
        ("task.**.changed", "task.a.b.changed", True),
        ("task.**.changed", "task.a.b.changed.x", False),
        ("**.changed", "task.status.changed", True),
        ("task.*.*", "task.status.changed", True),
        ("Task.*", "task.created", False),
    ],
    ids=lambda value: str(value),
)
def test_wildcard_matching(pattern: str, name: str, expected: bool) -> None:
    bus = EventBus()
    bus.on(pattern, lambda e: None)
    assert bus.emit(name, EVENT) is expected
    assert _reference(pattern.split("."), name.split(".")) is expected


_segment = st.sampled_from(["a", "b", "c"])
_pattern_segment = st.sampled_from(["a", "b", "*", "**"])


@settings(max_examples=400)
@given(
    pattern=st.lists(_pattern_segment, min_size=1, max_size=6),
    name=st.lists(_segment, min_size=1, max_size=7),
)
def test_matching_agrees_with_the_reference(pattern: list[str], name: list[str]) -> None:
    expected = _reference(pattern, name)
    assert match_segments(pattern, name) is expected
    bus = EventBus()
    bus.on(".".join(pattern), lambda e: None)
    assert bus.emit(".".join(name), EVENT) is expected


@given(name=st.lists(_segment, min_size=1, max_size=7))
def test_double_star_alone_matches_everything_and_a_plain_name_only_itself(
    name: list[str],
) -> None:
    text = ".".join(name)
    assert match_segments(["**"], name)
    bus = EventBus()
    bus.on(text, lambda e: None)
    assert bus.emit(text, EVENT)
    assert not bus.emit(text + ".x", EVENT)


@given(text=st.text(max_size=300))
def test_any_text_is_accepted_or_refused_with_a_clear_error(text: str) -> None:
    bus = EventBus()
    try:
        bus.on(text, lambda e: None)
    except InvalidEventNameError as exc:
        assert exc.name == text
    try:
        bus.emit(text, EVENT)
    except InvalidEventNameError as exc:
        assert exc.problem


# -- validation ---------------------------------------------------------------------------------


_BAD_NAMES = [
    ("", "empty"),
    ("a..b", "empty segment"),
    (".a", "empty segment"),
    ("a.", "empty segment"),
    ("a\x00b", "NUL"),
    ("x" * (MAX_EVENT_NAME_LENGTH + 1), "256 characters"),
    (5, "must be a str"),
    (None, "must be a str"),
]


@pytest.mark.parametrize(
    ("name", "problem"),
    _BAD_NAMES,
    ids=["empty", "double-dot", "lead", "trail", "nul", "long", "int", "none"],
)
def test_bad_names_are_refused_everywhere(name: Any, problem: str) -> None:
    bus = EventBus()
    for call in (
        lambda: bus.emit(name, EVENT),
        lambda: bus.on(name, print),
        lambda: bus.off(name),
        lambda: bus.listener(name),
    ):
        with pytest.raises(InvalidEventNameError, match=problem):
            call()


@pytest.mark.parametrize(
    "pattern",
    ["a.**b", "a*", "a.*b.c", "***", "a.b*", "*a"],
    ids=["double-star-glued", "trailing-star", "star-prefix", "triple", "glued-end", "lead"],
)
def test_bad_wildcards_are_refused_at_registration(pattern: str) -> None:
    with pytest.raises(InvalidEventNameError, match="whole segment"):
        EventBus().on(pattern, print)


def test_wildcards_cannot_be_emitted() -> None:
    with pytest.raises(InvalidEventNameError, match="concrete name"):
        EventBus().emit("task.*", EVENT)


def test_longest_name_is_accepted() -> None:
    bus = EventBus()
    name = "x" * MAX_EVENT_NAME_LENGTH
    bus.on(name, print)
    assert bus.listeners(name)


@pytest.mark.parametrize(
    ("listener", "options", "problem"),
    [
        ("not callable", {}, "must be callable"),
        (None, {}, "must be callable"),
        (print, {"deferred": 1}, "deferred must be a bool"),
        (print, {"propagate_errors": "yes"}, "propagate_errors must be a bool"),
        (print, {"deferred": True, "propagate_errors": True}, "nobody awaits"),
    ],
    ids=["str", "none", "deferred-int", "propagate-str", "deferred-and-propagate"],
)
def test_bad_listeners_are_refused(listener: Any, options: dict[str, Any], problem: str) -> None:
    bus = EventBus()
    with pytest.raises(InvalidListenerError, match=problem):
        bus.on("t", listener, **options)
    assert bus.listeners("t") == []


# -- registration and removal -------------------------------------------------------------------


async def test_decorator_registers_and_returns_the_function_unchanged() -> None:
    bus = EventBus()
    seen: list[str] = []

    @bus.listener("task.status.changed", deferred=True)
    async def on_status_changed(event: StatusChanged) -> None:
        seen.append(event.to)

    assert on_status_changed.__name__ == "on_status_changed"
    [subscription] = bus.listeners("task.status.changed")
    assert subscription.listener is on_status_changed
    assert subscription.deferred
    assert not subscription.propagate_errors
    bus.emit("task.status.changed", EVENT)
    assert seen == []
    await bus.drain()
    assert seen == ["DONE"]
    assert bus.off("task.status.changed", on_status_changed) == 1


def test_subscription_handle_unsubscribes_once() -> None:
    bus = EventBus()
    seen: list[str] = []
    handle = bus.on("t", seen.append)
    assert isinstance(handle, Subscription)
    assert (handle.pattern, handle.active) == ("t", True)
    assert "Subscription 't'" in repr(handle)
    assert handle() is True
    assert handle.unsubscribe() is False
    assert (handle.active, "inactive" in repr(handle)) == (False, True)
    assert bus.emit("t", "x") is False
    assert seen == []


def test_off_removes_by_exact_pattern_and_listener() -> None:
    bus = EventBus()
    seen: list[str] = []

    class Listener:
        def method(self, event: str) -> None:
            seen.append("method")

    target = Listener()
    bus.on("a.*", seen.append)
    bus.on("a.b", seen.append)
    bus.on("a.b", seen.append)
    bus.on("a.b", target.method)
    assert bus.off("a.b", lambda e: None) == 0
    assert bus.off("a.c", seen.append) == 0
    assert bus.off("a.b", target.method) == 1  # a new bound method, equal to the registered one
    assert bus.off("a.b", seen.append) == 2
    assert bus.emit("a.b", "wild")
    assert seen == ["wild"]
    assert bus.off("a.*") == 1
    assert not bus.emit("a.b", "x")


def test_listeners_lists_matches_in_registration_order() -> None:
    bus = EventBus()
    first = bus.on("**", print)
    second = bus.on("a.b", print, deferred=True)
    third = bus.on("a.*", print, propagate_errors=True)
    bus.on("a.c", print)
    assert bus.listeners("a.b") == [first, second, third]
    assert "listeners=4" in repr(bus)


async def test_listener_removing_itself_during_emit() -> None:
    bus = EventBus()
    seen: list[str] = []

    def once(event: object) -> None:
        seen.append("once")
        handle.unsubscribe()

    handle = bus.on("t", once)
    bus.on("t", lambda e: seen.append("other"))
    bus.emit("t", EVENT)
    bus.emit("t", EVENT)
    assert seen == ["once", "other", "other"]


async def test_removed_listeners_are_never_called_again_even_mid_emit() -> None:
    bus = EventBus()
    seen: list[str] = []

    def remover(event: object) -> None:
        seen.append("remover")
        later.unsubscribe()
        deferred.unsubscribe()
        bus.on("t", lambda e: seen.append("added during emit"))

    bus.on("t", remover)
    later = bus.on("t", lambda e: seen.append("later"))
    deferred = bus.on("t", lambda e: seen.append("deferred"), deferred=True)
    bus.emit("t", EVENT)
    await bus.drain()
    assert seen == ["remover"]
    bus.off("t", remover)
    bus.emit("t", EVENT)
    assert seen == ["remover", "added during emit"]


async def test_unsubscribing_before_the_deferred_batch_runs() -> None:
    bus = EventBus()
    seen: list[str] = []
    handle = bus.on("t", seen.append, deferred=True)
    bus.emit("t", "x")
    handle()
    await bus.drain()
    assert seen == []


# -- re-entrancy --------------------------------------------------------------------------------


async def test_a_listener_may_emit_another_event_depth_first() -> None:
    bus = EventBus()
    seen: list[str] = []

    def on_changed(event: StatusChanged) -> None:
        seen.append("changed:start")
        bus.emit("task.notified", event)
        seen.append("changed:end")

    async def on_notified_async(event: StatusChanged) -> None:
        seen.append("notified:async")
        bus.emit("task.audited", event)

    bus.on("task.status.changed", on_changed)
    bus.on("task.notified", lambda e: seen.append("notified"))
    bus.on("task.notified", on_notified_async)
    bus.on("task.audited", lambda e: seen.append("audited"), deferred=True)
    bus.emit("task.status.changed", EVENT)
    assert seen == ["changed:start", "notified", "changed:end"]
    await bus.drain()  # waits for work started while draining, too
    assert seen[3:] == ["notified:async", "audited"]
    assert bus.pending == 0


# -- strict mode and misspelled names -----------------------------------------------------------


def test_strict_bus_names_the_event_and_the_closest_patterns() -> None:
    bus = EventBus(strict=True)
    bus.on("task.status.changed", print)
    bus.on("task.created", print)
    bus.on("user.*", print)
    assert bus.strict
    with pytest.raises(UnknownEventError) as info:
        bus.emit("task.status.chnged", EVENT)
    assert info.value.event == "task.status.chnged"
    assert info.value.suggestions[0] == "task.status.changed"
    assert "'task.status.chnged'" in str(info.value)
    assert "closest registered: 'task.status.changed'" in str(info.value)
    with pytest.raises(UnknownEventError, match="no registered pattern looks like it"):
        bus.emit("zzz", EVENT)


def test_lenient_bus_logs_a_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    bus = EventBus()
    assert bus.emit("task.status.chnged", EVENT) is False
    [record] = _failures(caplog, "no_listener")
    assert record.levelno == logging.DEBUG
    assert record.event == "task.status.chnged"


def test_error_is_an_ordinary_name_unlike_eventemitter2() -> None:
    # EventEmitter2 throws an unheard "error" event's payload; sdcore deliberately does not
    # (docs/reference/events.md), and strict mode raises for it as for any unheard name.
    assert EventBus().emit("error", ValueError("boom")) is False
    with pytest.raises(UnknownEventError):
        EventBus(strict=True).emit("error", ValueError("boom"))


def test_custom_logger_name(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus(logger_name="app.events")
    bus.on("t", _sync_boom)
    bus.emit("t", EVENT)
    [record] = _failures(caplog)
    assert record.name == "app.events"


def test_strict_must_be_a_bool() -> None:
    with pytest.raises(TypeError):
        EventBus(strict="yes")  # type: ignore[arg-type]


# -- drain --------------------------------------------------------------------------------------


async def test_drain_leaves_no_pending_task() -> None:
    bus = EventBus()
    done: list[int] = []

    async def work(event: int) -> None:
        await asyncio.sleep(0.01 * event)
        done.append(event)

    bus.on("t", work)
    bus.on("t", work, deferred=True)
    for i in range(3):
        bus.emit("t", i)
    assert bus.pending == 6  # per emit: one task and one deferred batch, none started yet
    assert await bus.drain() is True
    assert sorted(done) == [0, 0, 1, 1, 2, 2]
    assert bus.pending == 0
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_async_with_drains_on_exit() -> None:
    done: list[str] = []

    async def work(event: object) -> None:
        await asyncio.sleep(0.01)
        done.append("done")

    async with EventBus() as bus:
        bus.on("t", work, deferred=True)
        bus.emit("t", EVENT)
    assert done == ["done"]


async def test_drain_timeout_cancels_what_is_left(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    cleaned: list[str] = []

    async def hang(event: object) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append("cleaned")

    bus.on("t", hang)
    bus.emit("t", EVENT)
    assert await bus.drain(timeout=0.05) is False
    assert cleaned == ["cleaned"]
    assert bus.pending == 0
    [record] = _failures(caplog, "drain_timeout")
    assert record.cancelled == 1
    assert _failures(caplog) == []  # a cancellation is not a listener failure


async def test_a_listener_may_drain_without_deadlock() -> None:
    bus = EventBus()
    seen: list[str] = []

    async def drainer(event: object) -> None:
        assert await bus.drain(timeout=5)
        seen.append("drained")

    bus.on("t", drainer)
    bus.on("t", lambda e: seen.append("deferred"), deferred=True)
    bus.emit("t", EVENT)
    assert await bus.drain(timeout=5)
    assert seen == ["deferred", "drained"]


# -- cancellation -------------------------------------------------------------------------------


async def test_cancelling_emit_async_cancels_its_listeners() -> None:
    bus = EventBus()
    started = asyncio.Event()
    cleaned: list[str] = []

    async def hang(event: object) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append("cleaned")

    bus.on("t", hang)
    caller = asyncio.create_task(bus.emit_async("t", EVENT))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert cleaned == ["cleaned"]
    assert bus.pending == 0


async def test_emit_async_under_a_timeout_raises_timeout_error() -> None:
    bus = EventBus()

    async def hang(event: object) -> None:
        await asyncio.sleep(3600)

    bus.on("t", hang)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await bus.emit_async("t", EVENT)
    assert bus.pending == 0


async def test_cancelled_error_from_a_sync_listener_reaches_the_emitter() -> None:
    bus = EventBus()
    seen: list[str] = []

    def cancelled(event: object) -> None:
        raise asyncio.CancelledError

    bus.on("t", cancelled)
    bus.on("t", lambda e: seen.append("not reached"))
    with pytest.raises(asyncio.CancelledError):
        bus.emit("t", EVENT)
    with pytest.raises(asyncio.CancelledError):
        await bus.emit_async("t", EVENT)
    assert seen == []


async def test_cancelling_drain_propagates_and_leaves_the_work_running() -> None:
    bus = EventBus()
    release = asyncio.Event()

    async def work(event: object) -> None:
        await release.wait()

    bus.on("t", work)
    bus.emit("t", EVENT)
    drainer = asyncio.create_task(bus.drain())
    await asyncio.sleep(0.01)
    drainer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await drainer
    assert bus.pending == 1
    release.set()
    assert await bus.drain(timeout=5)


async def test_a_cancelled_listener_in_emit_async(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()

    async def gives_up(event: object) -> None:
        raise asyncio.CancelledError

    bus.on("t", gives_up)
    bus.on("t", lambda e: "ok")
    assert await bus.emit_async("t", EVENT) == [None, "ok"]
    [record] = _failures(caplog, "listener_cancelled")
    assert record.levelno == logging.WARNING
    bus.off("t")
    bus.on("t", gives_up, propagate_errors=True)
    with pytest.raises(asyncio.CancelledError):
        await bus.emit_async("t", EVENT)


# -- without an event loop ----------------------------------------------------------------------


def test_emit_from_plain_sync_code_runs_sync_listeners() -> None:
    bus = EventBus()
    seen: list[object] = []
    bus.on("t", seen.append)
    assert bus.emit("t", EVENT) is True
    assert seen == [EVENT]


async def _coroutine_listener(event: object) -> None:
    return None


@pytest.mark.parametrize(
    ("listener", "deferred"),
    [(_coroutine_listener, False), (print, True)],
    ids=["coroutine", "deferred"],
)
def test_emit_without_loop_refuses_listeners_that_need_one(
    listener: Callable[[object], Any], deferred: bool
) -> None:
    bus = EventBus()
    seen: list[object] = []
    bus.on("t", seen.append)
    bus.on("t", listener, deferred=deferred)
    with pytest.raises(EventLoopRequiredError) as info:
        bus.emit("t", EVENT)
    assert info.value.event == "t"
    assert info.value.listeners == (f"{listener.__module__}.{listener.__qualname__}",)
    assert "no event loop is running" in str(info.value)
    assert seen == []  # all or nothing: checked before any listener ran


def test_sync_listener_returning_a_coroutine_without_loop_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = EventBus()
    bus.on("t", lambda e: _coroutine_listener(e))
    assert bus.emit("t", EVENT)
    gc.collect()  # the coroutine was closed: no "never awaited" RuntimeWarning (warnings = errors)
    [record] = _failures(caplog)
    assert record.exc_info[0] is EventLoopRequiredError


# -- references, listener kinds, context --------------------------------------------------------


def _register_closure(bus: EventBus, seen: list[str]) -> None:
    def closure(event: object) -> None:
        seen.append("closure")

    class Handler:
        def method(self, event: object) -> None:
            seen.append("method")

    bus.on("t", closure)
    bus.on("t", Handler().method)


def test_listeners_are_held_strongly() -> None:
    bus = EventBus()
    seen: list[str] = []
    _register_closure(bus, seen)
    gc.collect()
    bus.emit("t", EVENT)
    assert seen == ["closure", "method"]


async def test_background_tasks_are_held_strongly() -> None:
    bus = EventBus()
    done: list[str] = []

    async def work(event: object) -> None:
        for _ in range(3):
            await asyncio.sleep(0)
            gc.collect()
        done.append("done")

    bus.on("t", work)
    bus.emit("t", EVENT)
    gc.collect()
    await bus.drain()
    assert done == ["done"]


async def test_async_callables_and_partials_are_coroutine_listeners() -> None:
    bus = EventBus()
    seen: list[str] = []

    class AsyncHandler:
        async def __call__(self, event: object) -> None:
            seen.append("callable")

    async def tagged(tag: str, event: object) -> None:
        seen.append(tag)

    handler = AsyncHandler()
    bus.on("t", handler)
    bus.on("t", functools.partial(tagged, "partial"))
    bus.on("t", lambda e: tagged("returned awaitable", e))  # a plain listener returning one
    subscriptions = bus.listeners("t")
    assert f"{__name__}." in subscriptions[0]._description
    assert subscriptions[1]._description.startswith("functools.partial(")
    bus.emit("t", EVENT)
    assert seen == []
    await bus.drain()
    assert seen == ["callable", "partial", "returned awaitable"]
    assert await bus.emit_async("t", EVENT) == [None, None, None]


async def test_a_plain_listener_may_return_a_future() -> None:
    loop = asyncio.get_running_loop()
    bus = EventBus()
    first, second = loop.create_future(), loop.create_future()
    futures = iter([first, second])
    bus.on("t", lambda e: next(futures))
    loop.call_later(0.01, first.set_result, "resolved")
    assert await bus.emit_async("t", EVENT) == ["resolved"]
    bus.emit("t", EVENT)
    assert bus.pending == 1
    loop.call_later(0.01, second.set_result, "ignored")
    assert await bus.drain(timeout=5)


async def test_listeners_see_the_emitters_context_variables() -> None:
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")
    bus = EventBus()
    seen: list[str] = []

    async def coroutine(event: object) -> None:
        seen.append(request_id.get())

    bus.on("t", lambda e: seen.append(request_id.get()))
    bus.on("t", coroutine)
    bus.on("t", lambda e: seen.append(request_id.get()), deferred=True)
    token = request_id.set("req-1")
    bus.emit("t", EVENT)
    request_id.reset(token)
    await bus.drain()
    assert seen == ["req-1", "req-1", "req-1"]
