"""The ``v2:`` key encoding: pinned test vectors, injectivity, independence from the process."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdcore.job_scheduler import (
    InvalidJobIdentityOptionsError,
    JobAcquireOptions,
    JobSchedulerType,
    bullmq_job_id,
    idempotency_key,
    lock_key,
)
from sdcore.job_scheduler._options import (
    IDEMPOTENCY_KEY_DOMAIN,
    LOCK_KEY_DOMAIN,
    encode_identity,
)

# (code, run_key, type, lock_key, idempotency_key) — the same table is in docs/reference/keys.md.
VECTORS = [
    (
        "sync-orders",
        "2026-07-20T03:00:00Z",
        "SCHEDULE",
        "v2:43b5ba524a8a1001e7f584b8ff9d3966126f01b3add0afacdeab92abd5ef0226",
        "v2:337ef05e5b4e5fa449c45aeebd3698bb537358c63ecc94b6705107a6d6ab9689",
    ),
    (
        "seed-reference-data",
        None,
        "INITIAL",
        "v2:7fdb6100111578a00fe23a943b0dcae83459c4dde62d8ae989179f0706034be6",
        "v2:aa0b6528ad50b0e4f43a9a36d2c4bbfe4da475fc26983ae4f5528990f3d08bc3",
    ),
    (
        "a:b",
        "c",
        "SCHEDULE",
        "v2:ea60cc7e76858f54f0f5064c9db63d4073e595897ecaa4971ba0f7cc97009590",
        "v2:528cd2234f3a0f1d47e10eb103332576f09fb692547ec05ae662285e31ccbb52",
    ),
    (
        "a",
        "b:c",
        "SCHEDULE",
        "v2:160d4d5e3ef144585c29cd5a3ec3c8404930d39371077e6860965b9bcadbe7d6",
        "v2:83ff65e572f11b35512ac3da9a195f75116758a3537a10a2aa5a879409345a85",
    ),
    (
        "café",
        "ü",
        "SCHEDULE",
        "v2:24036a1591c5d37a3543d6908bf4a6bc9d277caac42960afa19a16fb65d98a15",
        "v2:1c42fb47d92af3887b499765349fd88e5f8776cd3725a9dcf4ab21777b136c4f",
    ),
]


def _reference(domain: str, type_: str, code: str, run_key: str | None) -> str:
    """An independent re-implementation of the documented encoding."""

    def frame(text: str | None) -> bytes:
        if text is None:
            return b"\x00"
        data = text.encode("utf-8")
        return b"\x01" + struct.pack(">I", len(data)) + data

    material = frame(domain) + frame(type_) + frame(code) + frame(run_key)
    return "v2:" + hashlib.sha256(material).hexdigest()


@pytest.mark.parametrize(
    ("code", "run_key", "type_", "lock", "idem"), VECTORS, ids=lambda v: str(v)[:20]
)
def test_vectors(code: str, run_key: str | None, type_: str, lock: str, idem: str) -> None:
    assert lock_key(code, run_key, type_) == lock
    assert idempotency_key(code, run_key, type_) == idem
    assert _reference(LOCK_KEY_DOMAIN, type_, code, run_key) == lock
    assert _reference(IDEMPOTENCY_KEY_DOMAIN, type_, code, run_key) == idem


def test_options_carry_the_keys_and_code_is_trimmed() -> None:
    options = JobAcquireOptions(code="  sync-orders \n", run_key="2026-07-20T03:00:00Z")
    assert options.code == "sync-orders"
    assert options.lock_key == VECTORS[0][3]
    assert options.idempotency_key == VECTORS[0][4]


def test_concatenation_ambiguity_does_not_collide() -> None:
    assert lock_key("a:b", "c") != lock_key("a", "b:c")
    assert lock_key("x", "1") != lock_key("x1", "1")


def test_lock_and_idempotency_keys_are_domain_separated() -> None:
    options = JobAcquireOptions(code="c", run_key="r")
    assert options.lock_key != options.idempotency_key
    assert options.lock_key.startswith("v2:")
    assert options.idempotency_key.startswith("v2:")


def test_initial_and_schedule_are_distinct_identities() -> None:
    initial = JobAcquireOptions(code="c", type=JobSchedulerType.INITIAL)
    assert initial.lock_key != lock_key("c", "INITIAL")


def test_name_and_timing_are_not_part_of_the_identity() -> None:
    a = JobAcquireOptions(code="c", run_key="r", name="A", lease_ms=10_000)
    b = JobAcquireOptions(code="c", run_key="r", name="B", lease_ms=20_000)
    assert a.lock_key == b.lock_key
    assert a.idempotency_key == b.idempotency_key


def test_no_unicode_normalization() -> None:
    # NFC "é" and NFD "e\u0301" are different identities: replicas must send the same bytes.
    assert lock_key("caf\u00e9", "r") != lock_key("cafe\u0301", "r")


identity = st.tuples(
    st.sampled_from(["SCHEDULE", "INITIAL"]),
    st.text(min_size=0, max_size=20),
    st.one_of(st.none(), st.text(max_size=20)),
)


@given(identity, identity)
def test_encoding_is_injective(
    a: tuple[str, str, str | None], b: tuple[str, str, str | None]
) -> None:
    def enc(t: tuple[str, str, str | None]) -> bytes:
        run_key = None if t[2] is None else t[2].encode("utf-8", "surrogatepass")
        return encode_identity(
            LOCK_KEY_DOMAIN, t[0], t[1].encode("utf-8", "surrogatepass"), run_key
        )

    if a != b:
        assert enc(a) != enc(b)


@given(
    st.text(min_size=1, max_size=64).filter(lambda s: s.strip() and "\x00" not in s),
    st.text(min_size=1, max_size=50),
)
def test_valid_identities_always_give_keys(code: str, run_key: str) -> None:
    try:
        options = JobAcquireOptions(code=code, run_key=run_key)
    except InvalidJobIdentityOptionsError as exc:
        # Only NUL or lone surrogates in the run key may be refused here.
        assert exc.field == "run_key"
        assert "\x00" in run_key or any(0xD800 <= ord(ch) <= 0xDFFF for ch in run_key)
        return
    assert len(options.lock_key) == 67
    # The keys are SHA-256 of encode_identity's bytes (the options derive them faster, with the
    # constant frames made once: the bytes must stay the same).
    code_bytes = options.code.encode("utf-8")
    run_key_bytes = run_key.encode("utf-8")
    for domain, key in (
        (LOCK_KEY_DOMAIN, options.lock_key),
        (IDEMPOTENCY_KEY_DOMAIN, options.idempotency_key),
    ):
        encoded = encode_identity(domain, "SCHEDULE", code_bytes, run_key_bytes)
        assert key == "v2:" + hashlib.sha256(encoded).hexdigest()
    initial = JobAcquireOptions(code=code, type="INITIAL")
    encoded = encode_identity(LOCK_KEY_DOMAIN, "INITIAL", code_bytes, None)
    assert initial.lock_key == "v2:" + hashlib.sha256(encoded).hexdigest()


def test_bullmq_job_id_is_node_safe_and_deterministic() -> None:
    key = VECTORS[0][4]
    job_id = bullmq_job_id(key)
    assert job_id == "sd-a0363694bca160190632cbff856b7f4d9d879a5c8ad594fe2005785f78d333a6"
    assert ":" not in job_id
    assert not job_id.isdigit()
    assert bullmq_job_id(key) == job_id
    assert bullmq_job_id("12345") != "12345"
    assert ":" not in bullmq_job_id("a:b:c")


@pytest.mark.parametrize("bad", [None, 123, b"x", ""], ids=["none", "int", "bytes", "empty"])
def test_bullmq_job_id_rejects_bad_keys(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        bullmq_job_id(bad)  # type: ignore[arg-type]
