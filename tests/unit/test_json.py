"""Strict JSON for jsonb: refused in Python, naming the path, before any SQL."""

from __future__ import annotations

import datetime as dt
import json
import math
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdcore._json import MAX_JSON_DEPTH, JsonTypeError, JsonValueError, dump_json_object


def test_none_and_objects() -> None:
    assert dump_json_object(None) is None
    assert dump_json_object({}) == "{}"
    text = dump_json_object({"rows": 42, "ok": True, "items": (1, 2.5, None, "é")})
    assert text is not None
    assert json.loads(text) == {"rows": 42, "ok": True, "items": [1, 2.5, None, "é"]}


def test_hostile_strings_are_kept_verbatim() -> None:
    value = {
        "sql": "'; DROP TABLE job_scheduler;--",
        "fmt": "%s %(x)s {} $1 \\",
        "nl": "a\nb\x1b[31m",
    }
    text = dump_json_object(value)
    assert text is not None
    assert json.loads(text) == value


def _deep(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def _circular() -> dict[str, Any]:
    value: dict[str, Any] = {}
    value["self"] = value
    return value


BAD_VALUES: list[tuple[Any, type[Exception], str]] = [
    ({"x": math.nan}, JsonValueError, "$.x"),
    ({"x": [math.inf]}, JsonValueError, "$.x[0]"),
    ({"x": -math.inf}, JsonValueError, "$.x"),
    ({"x": "a\x00b"}, JsonValueError, "NUL"),
    ({"x\x00": 1}, JsonValueError, "NUL"),
    ({"x": "\ud800"}, JsonValueError, "surrogate"),
    ({1: "a", "1": "b"}, JsonTypeError, "keys must be str"),
    ({True: 1}, JsonTypeError, "keys must be str"),
    ({"x": Decimal("NaN")}, JsonTypeError, "Decimal"),
    ({"x": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}, JsonTypeError, "datetime"),
    ({"x": b"bytes"}, JsonTypeError, "bytes"),
    ({"x": {1, 2}}, JsonTypeError, "set"),
    ({"x": object()}, JsonTypeError, "object"),
    (_circular(), JsonValueError, "circular"),
    (_deep(10_000), JsonValueError, "deeper"),
    ([1, 2], JsonTypeError, "JSON object"),
    ("text", JsonTypeError, "JSON object"),
    ({"big": "x" * (1024 * 1024)}, JsonValueError, "bytes"),
]


@pytest.mark.parametrize(
    ("value", "error", "message"), BAD_VALUES, ids=[str(i) for i in range(len(BAD_VALUES))]
)
def test_bad_values(value: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(
        error, match=message.replace("$", r"\$").replace("[", r"\[").replace("]", r"\]")
    ):
        dump_json_object(value)


def test_depth_limit_is_exact() -> None:
    # _deep(n) nests n + 1 objects.
    assert dump_json_object(_deep(MAX_JSON_DEPTH - 1)) is not None
    with pytest.raises(JsonValueError):
        dump_json_object(_deep(MAX_JSON_DEPTH))


def test_shared_subobjects_are_not_mistaken_for_cycles() -> None:
    shared = {"k": 1}
    assert dump_json_object({"a": shared, "b": shared, "c": [shared, shared]}) is not None


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=20,
)


@given(st.dictionaries(st.text(), json_values, max_size=5))
def test_every_json_object_round_trips_or_is_refused_for_a_stated_reason(
    value: dict[str, Any],
) -> None:
    try:
        text = dump_json_object(value)
    except JsonValueError as exc:
        assert "NUL" in exc.problem or "surrogate" in exc.problem
        return
    assert text is not None
    assert json.loads(text) == value
