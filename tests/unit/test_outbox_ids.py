"""Outbox job ids (v2), the namespace and ``exact_numbers``: no sockets."""

from __future__ import annotations

import hashlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdcore.outbox import InvalidOutboxMessageError, Outbox
from sdcore.outbox._model import check_exact_numbers, job_id_v2

_ID = re.compile(r"sd2-[0-9a-f]{64}")
_text = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1,
    max_size=40,
)


def test_a_known_vector() -> None:
    # "7:billingorder:1", hashed: the documented formula, by hand.
    expected = "sd2-" + hashlib.sha256(b"7:billingorder:1").hexdigest()
    assert job_id_v2("billing", "order:1") == expected
    assert Outbox(namespace="billing").job_id("order:1") == expected


@given(namespace=_text, key=_text)
def test_ids_are_node_safe(namespace: str, key: str) -> None:
    assert _ID.fullmatch(job_id_v2(namespace, key))


@given(a=_text, b=_text, cut=st.integers(min_value=1, max_value=39))
def test_moving_the_boundary_between_namespace_and_key_changes_the_id(
    a: str, b: str, cut: int
) -> None:
    text = a + b
    if not 0 < cut < len(text) or cut == len(a):
        return
    assert job_id_v2(a, b) != job_id_v2(text[:cut], text[cut:])


def test_namespaces_separate_equal_keys() -> None:
    assert job_id_v2("tenant_a", "k") != job_id_v2("tenant_b", "k")


@pytest.mark.parametrize(
    "namespace", ["", "x" * 201, "a\x00b", 5], ids=["empty", "long", "nul", "int"]
)
def test_bad_namespaces(namespace: object) -> None:
    with pytest.raises(InvalidOutboxMessageError, match="namespace"):
        Outbox(namespace=namespace)  # type: ignore[arg-type]


def test_job_id_needs_a_namespace_and_a_good_key() -> None:
    with pytest.raises(ValueError, match="no namespace"):
        Outbox().job_id("k")
    with pytest.raises(InvalidOutboxMessageError, match="idempotency_key"):
        Outbox(namespace="n").job_id("")


@given(value=st.floats(allow_nan=False, allow_infinity=False))
def test_exact_numbers_accepts_exactly_the_floats_jsonb_returns_as_floats(value: float) -> None:
    lossy = abs(value) >= 1e16 or (value == 0.0 and str(value).startswith("-"))
    if lossy:
        with pytest.raises(InvalidOutboxMessageError):
            check_exact_numbers({"v": value})
    else:
        check_exact_numbers({"v": value})


@given(value=st.integers())
def test_exact_numbers_accepts_exactly_the_safe_integers(value: int) -> None:
    if abs(value) > 2**53 - 1:
        with pytest.raises(InvalidOutboxMessageError, match="2\\^53"):
            check_exact_numbers([value])
    else:
        check_exact_numbers([value])
