"""Validation of identity and lease timing: every bad input is refused before any SQL."""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdcore.job_scheduler import (
    DEFAULT_HEARTBEAT_MS,
    DEFAULT_LEASE_MS,
    InvalidJobIdentityOptionsError,
    InvalidJobLeaseOptionsError,
    JobAcquireOptions,
    JobSchedulerType,
)
from sdcore.job_scheduler._options import coerce_options


class _Weird:
    def __str__(self) -> str:
        return "looks-like-a-code"


def test_defaults() -> None:
    options = JobAcquireOptions(code="c", run_key="r")
    assert options.type is JobSchedulerType.SCHEDULE
    assert options.lease_ms == DEFAULT_LEASE_MS == 900_000
    assert options.heartbeat_ms == DEFAULT_HEARTBEAT_MS == 60_000


@pytest.mark.parametrize(
    ("lease", "heartbeat"),
    [(3, 1), (4, 1), (9, 3), (3000, 1000), (179_999, 59_999), (180_000, 60_000), (10**9, 60_000)],
)
def test_default_heartbeat_is_min_of_60s_and_a_third(lease: int, heartbeat: int) -> None:
    assert JobAcquireOptions(code="c", run_key="r", lease_ms=lease).heartbeat_ms == heartbeat


@pytest.mark.parametrize("value", ["SCHEDULE", JobSchedulerType.SCHEDULE])
def test_type_accepts_member_or_exact_value(value: Any) -> None:
    assert JobAcquireOptions(code="c", run_key="r", type=value).type is JobSchedulerType.SCHEDULE


BAD_IDENTITY: list[tuple[dict[str, Any], str]] = [
    ({"code": "", "run_key": "r"}, "code"),
    ({"code": "   \t\n", "run_key": "r"}, "code"),
    ({"code": "x" * 65, "run_key": "r"}, "code"),
    ({"code": "é" * 65, "run_key": "r"}, "code"),
    ({"code": 123, "run_key": "r"}, "code"),
    ({"code": True, "run_key": "r"}, "code"),
    ({"code": b"c", "run_key": "r"}, "code"),
    ({"code": None, "run_key": "r"}, "code"),
    ({"code": _Weird(), "run_key": "r"}, "code"),
    ({"code": "a\x00b", "run_key": "r"}, "code"),
    ({"code": "a\ud800", "run_key": "r"}, "code"),
    ({"code": "c"}, "run_key"),
    ({"code": "c", "run_key": None}, "run_key"),
    ({"code": "c", "run_key": ""}, "run_key"),
    ({"code": "c", "run_key": 1.5}, "run_key"),
    ({"code": "c", "run_key": ["r"]}, "run_key"),
    ({"code": "c", "run_key": "r" * 1025}, "run_key"),
    ({"code": "c", "run_key": "r\x00"}, "run_key"),
    ({"code": "c", "run_key": "\udfff"}, "run_key"),
    ({"code": "c", "type": "INITIAL", "run_key": "r"}, "run_key"),
    ({"code": "c", "type": "INITIAL", "run_key": ""}, "run_key"),
    ({"code": "c", "run_key": "r", "type": "schedule"}, "type"),
    ({"code": "c", "run_key": "r", "type": "CRON"}, "type"),
    ({"code": "c", "run_key": "r", "type": None}, "type"),
    ({"code": "c", "run_key": "r", "type": 1}, "type"),
    ({"code": "c", "run_key": "r", "name": 5}, "name"),
    ({"code": "c", "run_key": "r", "name": "n" * 257}, "name"),
    ({"code": "c", "run_key": "r", "name": "n\x00"}, "name"),
]


@pytest.mark.parametrize(
    ("kwargs", "field"), BAD_IDENTITY, ids=[str(i) for i in range(len(BAD_IDENTITY))]
)
def test_bad_identity_is_rejected_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidJobIdentityOptionsError) as info:
        JobAcquireOptions(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidJobIdentityOptionsError):
        coerce_options(kwargs)


def test_rejection_never_calls_str_of_the_value() -> None:
    with pytest.raises(InvalidJobIdentityOptionsError) as info:
        JobAcquireOptions(code=_Weird(), run_key="r")  # type: ignore[arg-type]
    assert "looks-like-a-code" not in str(info.value)
    assert "_Weird" in str(info.value)


def test_limits_count_characters_not_bytes() -> None:
    assert JobAcquireOptions(code="é" * 64, run_key="🙂" * 1024, name="ü" * 256).code == "é" * 64


BAD_TIMING: list[tuple[dict[str, Any], str]] = [
    ({"lease_ms": None}, "lease_ms"),
    ({"lease_ms": True}, "lease_ms"),
    ({"lease_ms": 900000.0}, "lease_ms"),
    ({"lease_ms": 1.5}, "lease_ms"),
    ({"lease_ms": math.nan}, "lease_ms"),
    ({"lease_ms": math.inf}, "lease_ms"),
    ({"lease_ms": "1000"}, "lease_ms"),
    ({"lease_ms": Decimal(1000)}, "lease_ms"),
    ({"lease_ms": 0}, "lease_ms"),
    ({"lease_ms": -1}, "lease_ms"),
    ({"lease_ms": 2}, "lease_ms"),
    ({"lease_ms": 2**53}, "lease_ms"),
    ({"lease_ms": 2**63}, "lease_ms"),
    ({"heartbeat_ms": None}, "heartbeat_ms"),
    ({"heartbeat_ms": False}, "heartbeat_ms"),
    ({"heartbeat_ms": -1}, "heartbeat_ms"),
    ({"heartbeat_ms": 10.0}, "heartbeat_ms"),
    ({"heartbeat_ms": 2**53}, "heartbeat_ms"),
    ({"lease_ms": 1000, "heartbeat_ms": 500}, "heartbeat_ms"),
    ({"lease_ms": 1000, "heartbeat_ms": 1000}, "heartbeat_ms"),
    ({"lease_ms": 1000, "heartbeat_ms": 5000}, "heartbeat_ms"),
]


@pytest.mark.parametrize(
    ("kwargs", "field"), BAD_TIMING, ids=[str(i) for i in range(len(BAD_TIMING))]
)
def test_bad_timing_is_rejected_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidJobLeaseOptionsError) as info:
        JobAcquireOptions(code="c", run_key="r", **kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidJobLeaseOptionsError):
        coerce_options({"code": "c", "run_key": "r", **kwargs})


@pytest.mark.parametrize(("lease", "heartbeat"), [(3, 0), (3, 1), (1000, 499), (2**53 - 1, 60_000)])
def test_edge_timings_are_accepted(lease: int, heartbeat: int) -> None:
    options = JobAcquireOptions(code="c", run_key="r", lease_ms=lease, heartbeat_ms=heartbeat)
    assert (options.lease_ms, options.heartbeat_ms) == (lease, heartbeat)


def test_explicit_minus_one_heartbeat_is_not_the_default() -> None:
    with pytest.raises(InvalidJobLeaseOptionsError):
        JobAcquireOptions(code="c", run_key="r", heartbeat_ms=-1)


@given(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.one_of(st.none(), st.integers(min_value=-(2**64), max_value=2**64)),
)
def test_timing_rules_hold_for_any_integers(lease: int, heartbeat: int | None) -> None:
    kwargs: dict[str, Any] = {"lease_ms": lease}
    if heartbeat is not None:
        kwargs["heartbeat_ms"] = heartbeat
    try:
        options = JobAcquireOptions(code="c", run_key="r", **kwargs)
    except InvalidJobLeaseOptionsError:
        valid_lease = 2 < lease <= 2**53 - 1
        valid_heartbeat = heartbeat is None or (
            0 <= heartbeat <= 2**53 - 1 and (heartbeat == 0 or 2 * heartbeat < lease)
        )
        assert not (valid_lease and valid_heartbeat)
        return
    assert 2 < options.lease_ms <= 2**53 - 1
    assert options.heartbeat_ms >= 0
    assert options.heartbeat_ms == 0 or 2 * options.heartbeat_ms < options.lease_ms


@given(
    st.one_of(
        st.floats(), st.text(), st.booleans(), st.none(), st.binary(), st.lists(st.integers())
    )
)
def test_non_int_timing_is_always_rejected(value: object) -> None:
    with pytest.raises(InvalidJobLeaseOptionsError):
        JobAcquireOptions(code="c", run_key="r", lease_ms=value)  # type: ignore[arg-type]


def test_mapping_input_is_validated_the_same_way() -> None:
    options = coerce_options({"code": " c ", "run_key": "r", "type": "SCHEDULE", "lease_ms": 3000})
    assert options == JobAcquireOptions(code="c", run_key="r", lease_ms=3000)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"code": "c", "runKey": "r"}, "did you mean 'run_key'"),
        ({"code": "c", "run_key": "r", "leaseMs": 5}, "did you mean 'lease_ms'"),
        ({"code": "c", "run_key": "r", "extra": 1}, "unknown option 'extra'"),
        ({"run_key": "r"}, "code"),
        ({1: "x"}, "unknown option"),
        (["code", "c"], "mapping"),
        (None, "mapping"),
    ],
    ids=["camel-run-key", "camel-lease", "unknown", "missing-code", "int-key", "list", "none"],
)
def test_untyped_callers_get_clear_errors(options: Any, message: str) -> None:
    with pytest.raises(InvalidJobIdentityOptionsError, match=message):
        coerce_options(options)


def test_options_are_frozen() -> None:
    options = JobAcquireOptions(code="c", run_key="r")
    with pytest.raises(AttributeError):
        options.code = "d"  # type: ignore[misc]
