"""The shared constructor checks, and the components that use them."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from sdcore._internal.validation import at_least, flag, int_between, positive_number, text
from sdcore.queues import Job, Processor, Workers


class _Nothing(Processor):
    queue = "reports"

    async def process(self, job: Job) -> None:
        return None


@pytest.mark.parametrize("value", [True, 1.5, "3", None, -1])
def test_at_least_refuses_what_is_not_an_int_in_range(value: object) -> None:
    with pytest.raises(ValueError, match=r"^claim_ms must be an int of at least 0, got "):
        at_least("claim_ms", value, 0)


def test_at_least_returns_the_value_and_shortens_a_long_one() -> None:
    assert at_least("limit", 7, 1) == 7
    with pytest.raises(ValueError, match=r"^limit must be an int") as caught:
        at_least("limit", "x" * 1000, 1)
    assert len(str(caught.value)) < 100


def test_workers_name_the_bad_stall_option() -> None:
    with pytest.raises(ValueError, match="stalled_interval_ms must be an int of at least 100"):
        Workers([_Nothing()], redis_url="redis://127.0.0.1:1/0", stalled_interval_ms=99)
    with pytest.raises(ValueError, match="max_stalled_count must be an int of at least 0"):
        Workers([_Nothing()], redis_url="redis://127.0.0.1:1/0", max_stalled_count=-1)


def test_int_between_names_the_type_or_the_range() -> None:
    assert int_between("max_size", 5, 1, 10) == 5
    with pytest.raises(TypeError, match="max_size must be an int, got bool"):
        int_between("max_size", True, 1, 10)
    with pytest.raises(ValueError, match=r"max_size must be in 1\.\.10, got 11"):
        int_between("max_size", 11, 1, 10)


@pytest.mark.parametrize(
    ("check", "value", "error", "message"),
    [
        (lambda v: flag("listen", v), 1, TypeError, "listen must be a bool, got 1"),
        (lambda v: text("time_zone", v), None, TypeError, "time_zone must be a str, got None"),
        (lambda v: text("time_zone", v), " ", ValueError, "time_zone must be a non-empty str"),
        (lambda v: positive_number("after_s", v), 0, ValueError, "after_s must be a positive"),
        (lambda v: positive_number("after_s", v), True, ValueError, "got True"),
        (lambda v: positive_number("after_s", v), float("inf"), ValueError, "got inf"),
    ],
    ids=["flag", "text-type", "text-blank", "number-zero", "number-bool", "number-inf"],
)
def test_each_check_names_the_argument_and_the_value(
    check: Callable[[object], object], value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        check(value)


def test_the_checks_return_what_they_accept() -> None:
    assert flag("listen", False) is False
    assert text("name", "", empty=True) == ""
    assert positive_number("after_s", 2) == 2.0
