"""The lease contract's reads and refusals: ``status_of``, ``statuses`` and every malformed input.

Both backends call the same validators (``job_scheduler/_model.py``), so each refusal here has
one exact error type, and nothing is read or written when it is raised.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sdcore.job_scheduler import JobLease, JobSchedulerStatus, JsonTypeError
from sdcore.job_scheduler._options import coerce_options
from tests.contract._lease import Backend, _acquire, _opts

# --- status_of -------------------------------------------------------------------------------


async def test_status_of_follows_the_run_while_the_token_is_on_the_row(backend: Backend) -> None:
    won = await _acquire(backend, run_key="done")
    assert await backend.service.status_of(won.lease) is JobSchedulerStatus.RUNNING
    assert await backend.service.complete(won.lease)
    assert await backend.service.status_of(won.lease) is JobSchedulerStatus.SUCCESS

    failed = await _acquire(backend, run_key="failed")
    assert await backend.service.fail(failed.lease)
    assert await backend.service.status_of(failed.lease) is JobSchedulerStatus.FAIL


async def test_status_of_is_none_for_a_stranger_an_unknown_id_or_a_replaced_owner(
    backend: Backend,
) -> None:
    first = await _acquire(backend)
    stranger = JobLease(id=first.id, owner_token=str(uuid.uuid4()))
    assert await backend.service.status_of(stranger) is None
    unknown = JobLease(id=str(uuid.uuid4()), owner_token=first.owner_token)
    assert await backend.service.status_of(unknown) is None
    assert await backend.service.release(first.lease)
    second = await _acquire(backend)
    assert await backend.service.status_of(first.lease) is None
    assert await backend.service.status_of(second.lease) is JobSchedulerStatus.RUNNING


async def test_upper_case_uuids_name_the_same_lease(backend: Backend) -> None:
    won = await _acquire(backend)
    upper = JobLease(id=won.id.upper(), owner_token=won.owner_token.upper())
    assert await backend.service.status_of(upper) is JobSchedulerStatus.RUNNING
    assert await backend.service.heartbeat(upper)
    assert await backend.service.complete(upper, {"via": "upper"})
    assert (await backend.read(won.id))["data"] == {"via": "upper"}


# --- statuses --------------------------------------------------------------------------------


async def test_statuses_takes_any_sequence_up_to_the_limit(backend: Backend) -> None:
    won = await _acquire(backend)
    key = _opts().lock_key
    expected = {key: JobSchedulerStatus.RUNNING}
    assert await backend.service.statuses((key, key)) == expected
    assert await backend.service.statuses([f"v2:missing-{i}" for i in range(10_000)]) == {}
    many = [f"v2:missing-{i}" for i in range(9_999)] + [key]
    assert await backend.service.statuses(many) == expected
    assert await backend.service.complete(won.lease)


BAD_KEYS: list[tuple[Any, str]] = [
    ([f"k{i}" for i in range(10_001)], "at most 10000 lock keys per call, got 10001"),
    ([1, 2], "lock keys must be str"),
    (["ok", None], "lock keys must be str"),
    ([b"bytes"], "lock keys must be str"),
    ("v2:abc", "lock_keys must be a sequence of str, not a single str"),
    (["nul\x00key"], "lock keys must not contain NUL"),
    (["lone \ud800 surrogate"], "lock keys must be valid Unicode"),
]


async def test_statuses_and_tick_records_refuse_bad_keys_with_one_error(backend: Backend) -> None:
    await _acquire(backend)
    for keys, message in BAD_KEYS:
        for method in (backend.service.statuses, backend.service.tick_records):
            with pytest.raises(ValueError, match="^" + message) as info:
                await method(keys)
            assert type(info.value) is ValueError, (method.__name__, message)


# --- malformed leases, for every lease method -------------------------------------------------

GOOD = "6f1e9c2a-1b2c-4d3e-8f40-5a6b7c8d9e0f"
BAD_UUIDS = {
    "hyphenless": GOOD.replace("-", ""),
    "braces": "{" + GOOD + "}",
    "urn": "urn:uuid:" + GOOD,
    "blank-around": f" {GOOD} ",
    "newline-after": GOOD + "\n",
    "empty": "",
    "too-short": GOOD[:-1],
    "non-hex": GOOD[:-1] + "g",
    "non-ascii-digit": GOOD[:-1] + "\u0663",
    "sql": "x'; --",
}

MALFORMED: list[tuple[str, Any, type[Exception]]] = [
    *((f"id-{n}", JobLease(id=v, owner_token=GOOD), ValueError) for n, v in BAD_UUIDS.items()),
    *((f"token-{n}", JobLease(id=GOOD, owner_token=v), ValueError) for n, v in BAD_UUIDS.items()),
    ("id-int", JobLease(id=7, owner_token=GOOD), ValueError),  # type: ignore[arg-type]
    ("id-uuid-object", JobLease(id=uuid.UUID(GOOD), owner_token=GOOD), ValueError),  # type: ignore[arg-type]
    ("token-none", JobLease(id=GOOD, owner_token=None), ValueError),  # type: ignore[arg-type]
    ("dict", {"id": GOOD, "owner_token": GOOD}, TypeError),
    ("none", None, TypeError),
    ("tuple", (GOOD, GOOD), TypeError),
]

Method = Callable[[Backend, Any], Awaitable[Any]]
METHODS: dict[str, Method] = {
    "heartbeat": lambda b, lease: b.service.heartbeat(lease),
    "complete": lambda b, lease: b.service.complete(lease, {"x": 1}),
    "fail": lambda b, lease: b.service.fail(lease),
    "release": lambda b, lease: b.service.release(lease),
    "status_of": lambda b, lease: b.service.status_of(lease),
}


@pytest.mark.parametrize("method", list(METHODS))
async def test_malformed_leases_get_the_same_error_everywhere(
    backend: Backend, method: str
) -> None:
    won = await _acquire(backend)
    for case, lease, error in MALFORMED:
        with pytest.raises(error) as info:
            await METHODS[method](backend, lease)
        assert type(info.value) is error, case
    row = await backend.read(won.id)
    assert (row["status"], row["data"]) == ("RUNNING", None)


async def test_the_lease_is_checked_before_the_data(backend: Backend) -> None:
    won = await _acquire(backend)
    bad_lease = JobLease(id=BAD_UUIDS["braces"], owner_token=won.owner_token)
    bad_data: Any = {"x": {1, 2}}
    for method in (backend.service.complete, backend.service.fail, backend.service.release):
        with pytest.raises(ValueError, match=r"lease\.id") as info:
            await method(bad_lease, bad_data)
        assert not isinstance(info.value, JsonTypeError)
        with pytest.raises(JsonTypeError):
            await method(won.lease, bad_data)
    assert (await backend.read(won.id))["status"] == "RUNNING"


# --- malformed acquire options ----------------------------------------------------------------

BAD_OPTIONS: list[Any] = [
    {"code": "c", "runKey": "r"},
    {"code": "", "run_key": "r"},
    {"code": 7, "run_key": "r"},
    {"code": "c\x00", "run_key": "r"},
    {"code": "c"},
    {"code": "c", "type": "INITIAL", "run_key": "r"},
    {"code": "c", "type": "WEEKLY", "run_key": "r"},
    {"code": "c", "run_key": "r", "lease_ms": 0},
    {"code": "c", "run_key": "r", "lease_ms": True},
    {"code": "c", "run_key": "r", "lease_ms": 1.5},
    {"code": "c", "run_key": "r", "lease_ms": 2**53},
    {"code": "c", "run_key": "r", "lease_ms": 60_000, "heartbeat_ms": 60_000},
    {"code": "c", "run_key": "r", "heartbeat_ms": -1},
    {"code": "c", "run_key": "r", "name": 3},
    {"code": "c", "run_key": "\ud800"},
    None,
    ["code", "c"],
]


async def test_malformed_options_get_the_same_error_on_every_backend(backend: Backend) -> None:
    for options in BAD_OPTIONS:
        with pytest.raises(Exception) as expected:  # noqa: PT011 - the reference answer
            coerce_options(options)
        with pytest.raises(type(expected.value)) as info:
            await backend.service.acquire(options)
        assert (type(info.value), str(info.value)) == (
            type(expected.value),
            str(expected.value),
        ), options
    assert await backend.count() == 0
