"""The shared argument checks: one rule per kind, one message form, the caller's error type."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from sdcore._internal.errors import FieldError
from sdcore._internal.validation import (
    SHOWN_CHARS,
    Refusal,
    at_least,
    boolean,
    field_error,
    int_between,
    integer,
    non_empty_str,
    number_at_least,
    positive_number,
    positive_timedelta,
    shown,
    text,
)
from sdcore.events import EventBus
from sdcore.job_scheduler import InvalidJobLeaseOptionsError, JobAcquireOptions
from sdcore.outbox import Outbox
from sdcore.queues import Job, Processor, Workers
from sdcore.scheduling import ScheduleAdmin, ScheduleControlError
from sdcore.testing import MemoryScheduleStore

Check = Callable[..., object]


class _Nothing(Processor):
    queue = "reports"

    async def process(self, job: Job) -> None:
        return None


class _Field(FieldError, ValueError):
    """A caller's own error, of the ``FieldError(field, problem)`` family."""


# (check, arguments after the name, a value it returns, a wrong type, an out-of-range value, rule)
CASES: list[tuple[Check, tuple[object, ...], object, object, object, str]] = [
    (at_least, (1,), 1, "3", 0, "an int of at least 1"),
    (int_between, (1, 10), 10, 1.5, 11, "an int from 1 to 10"),
    (number_at_least, (0.5,), 0.5, "1", 0.4, "a number of at least 0.5"),
    (positive_number, (), 0.25, "1", 0, "a positive number"),
    (non_empty_str, (), "x", b"x", "", "a non-empty str"),
    (positive_timedelta, (), timedelta(seconds=1), 1, timedelta(0), "a positive timedelta"),
]
IDS = [case[0].__name__ for case in CASES]


@pytest.mark.parametrize(("check", "args", "good", "wrong", "out", "rule"), CASES, ids=IDS)
def test_a_check_returns_what_it_accepts(
    check: Check, args: tuple[object, ...], good: object, wrong: object, out: object, rule: str
) -> None:
    assert check("x", good, *args) == good


@pytest.mark.parametrize(("check", "args", "good", "wrong", "out", "rule"), CASES, ids=IDS)
def test_a_wrong_type_is_a_type_error_naming_the_rule_and_the_value(
    check: Check, args: tuple[object, ...], good: object, wrong: object, out: object, rule: str
) -> None:
    with pytest.raises(TypeError) as caught:
        check("x", wrong, *args)
    assert str(caught.value) == f"x must be {rule}, got {wrong!r}"


@pytest.mark.parametrize(("check", "args", "good", "wrong", "out", "rule"), CASES, ids=IDS)
def test_a_value_out_of_range_is_a_value_error_naming_the_rule_and_the_value(
    check: Check, args: tuple[object, ...], good: object, wrong: object, out: object, rule: str
) -> None:
    with pytest.raises(ValueError, match=rf"^x must be {rule}, got ") as caught:
        check("x", out, *args)
    assert type(caught.value) is ValueError
    assert str(caught.value) == f"x must be {rule}, got {out!r}"


@pytest.mark.parametrize(("check", "args", "good", "wrong", "out", "rule"), CASES, ids=IDS)
def test_a_caller_raises_its_own_field_error_with_the_same_problem(
    check: Check, args: tuple[object, ...], good: object, wrong: object, out: object, rule: str
) -> None:
    for value in (wrong, out):
        with pytest.raises(_Field) as caught:
            check("x", value, *args, error=field_error(_Field))
        assert (caught.value.field, caught.value.problem) == ("x", f"must be {rule}, got {value!r}")
        assert str(caught.value) == f"invalid x: must be {rule}, got {value!r}"


@pytest.mark.parametrize(
    ("check", "bounds"),
    [(at_least, (0,)), (int_between, (0, 10)), (number_at_least, (0,)), (positive_number, ())],
    ids=["at_least", "int_between", "number_at_least", "positive_number"],
)
def test_a_bool_is_not_a_number(check: Check, bounds: tuple[int, ...]) -> None:
    for value in (True, False):
        with pytest.raises(TypeError, match=r"must be an? .*(int|number).*, got (True|False)$"):
            check("flag", value, *bounds)


def test_integer_takes_any_int_and_nothing_else() -> None:
    assert integer("expected_version", -(2**70)) == -(2**70)
    for value in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match=r"^expected_version must be an int, got "):
            integer("expected_version", value)


def test_the_bounds_are_inclusive() -> None:
    assert int_between("x", 1, 1, 3) == 1
    assert int_between("x", 3, 1, 3) == 3
    assert at_least("x", 0, 0) == 0
    assert number_at_least("x", 2, 1, maximum=2) == 2
    assert positive_number("x", 3600, maximum=3600) == 3600
    with pytest.raises(
        ValueError, match=r"^x must be a positive number of at most 3600, got 3601$"
    ):
        positive_number("x", 3601, maximum=3600)
    with pytest.raises(ValueError, match=r"^x must be a number from 1 to 2, got 2\.5$"):
        number_at_least("x", 2.5, 1, maximum=2)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_number_is_finite(value: float) -> None:
    with pytest.raises(ValueError, match=r"^x must be a number of at least 0, got "):
        number_at_least("x", value, 0)
    with pytest.raises(ValueError, match=r"^x must be a positive number, got "):
        positive_number("x", value)


def test_boolean_takes_only_a_bool() -> None:
    assert boolean("strict", True) is True
    assert boolean("strict", False) is False
    for value in (0, 1, "yes", None):
        with pytest.raises(
            TypeError, match=rf"^strict must be a bool, got {re.escape(repr(value))}$"
        ):
            boolean("strict", value)


def test_a_str_and_a_timedelta_may_have_an_upper_bound() -> None:
    assert non_empty_str("prefix", "ab", max_length=2) == "ab"
    with pytest.raises(
        ValueError, match=r"^prefix must be a non-empty str of at most 2 characters"
    ):
        non_empty_str("prefix", "abc", max_length=2)
    week = timedelta(days=7)
    assert positive_timedelta("older_than", week, at_most=week) == week
    with pytest.raises(ValueError, match=r"^older_than must be a positive timedelta of at most 7"):
        positive_timedelta("older_than", week * 2, at_most=week)


def test_a_long_value_is_shown_cut() -> None:
    with pytest.raises(TypeError) as caught:
        at_least("limit", "x" * 1000, 1)
    message = str(caught.value)
    assert message.startswith("limit must be an int of at least 1, got 'xxx")
    assert message.endswith("…")
    assert len(shown("x" * 1000)) == SHOWN_CHARS
    assert shown(12) == "12"


def test_a_value_whose_repr_fails_is_shown_by_its_type() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert shown(Broken()) == "<Broken>"


def test_a_refusal_is_a_value_the_caller_can_word() -> None:
    refusal = Refusal(name="limit", rule="an int from 1 to 10", value=0, wrong_type=False)
    assert refusal.problem == "must be an int from 1 to 10, got 0"
    assert refusal.message == "limit must be an int from 1 to 10, got 0"
    assert type(refusal.exception()) is ValueError
    seen: list[Refusal] = []

    def word(refusal: Refusal) -> Exception:
        seen.append(refusal)
        return KeyError(f"schedule 'daily': {refusal.message}")

    with pytest.raises(KeyError, match="schedule 'daily': limit must be an int from 1 to 10"):
        int_between("limit", 0, 1, 10, error=word)
    assert seen == [refusal]


def test_workers_name_the_bad_stall_option() -> None:
    with pytest.raises(ValueError, match="stalled_interval_ms must be an int of at least 100"):
        Workers([_Nothing()], redis_url="redis://127.0.0.1:1/0", stalled_interval_ms=99)
    with pytest.raises(ValueError, match="max_stalled_count must be an int of at least 0"):
        Workers([_Nothing()], redis_url="redis://127.0.0.1:1/0", max_stalled_count=-1)


def _lease(**options: Any) -> object:
    return JobAcquireOptions(code="nightly", type="SCHEDULE", run_key="r", **options)


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (
            lambda: Outbox(max_attempts=0),
            ValueError,
            "max_attempts must be an int from 1 to 1000, got 0",
        ),
        (
            lambda: Outbox(notify_interval_ms="5"),  # type: ignore[arg-type]
            TypeError,
            "notify_interval_ms must be an int from 0 to 10000, got '5'",
        ),
        (lambda: EventBus(strict=1), TypeError, "strict must be a bool, got 1"),  # type: ignore[arg-type]
        (
            lambda: _lease(lease_ms=2),
            InvalidJobLeaseOptionsError,
            "invalid lease_ms: must be an int from 3 to 9007199254740991, got 2",
        ),
        (
            lambda: _lease(lease_ms=9, heartbeat_ms=True),
            InvalidJobLeaseOptionsError,
            "invalid heartbeat_ms: must be an int from 0 to 9007199254740991, got True",
        ),
    ],
    ids=["outbox-range", "outbox-type", "bus-bool", "lease-field", "heartbeat-bool"],
)
def test_public_apis_refuse_in_the_same_words(
    build: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        build()
    assert str(caught.value) == message


async def test_the_schedule_admin_words_a_refusal_as_its_own_error() -> None:
    admin = ScheduleAdmin(MemoryScheduleStore())
    with pytest.raises(ScheduleControlError) as caught:
        await admin.history("nightly", limit=0)
    assert str(caught.value) == "limit must be an int from 1 to 10000, got 0"
    with pytest.raises(ScheduleControlError, match=r"^older_than must be a positive timedelta"):
        await admin.prune(timedelta(0))


def test_text_refuses_a_non_str_and_a_blank_one_unless_empty_is_allowed() -> None:
    with pytest.raises(TypeError, match=re.escape("time_zone must be a non-blank str, got None")):
        text("time_zone", None)
    with pytest.raises(ValueError, match=re.escape("time_zone must be a non-blank str, got ' '")):
        text("time_zone", " ")
    assert text("name", "", empty=True) == ""
    with pytest.raises(TypeError, match=re.escape("name must be a str, got 3")):
        text("name", 3, empty=True)
