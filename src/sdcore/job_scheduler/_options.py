"""Validation of run identity and lease timing, and the ``v2:`` key encoding.

Everything here runs before any SQL is sent, and is pure (no clock, no I/O, no hash seed).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sdcore._internal.validation import field_error, int_between
from sdcore.job_scheduler._model import (
    DEFAULT_HEARTBEAT_MS,
    DEFAULT_LEASE_MS,
    MAX_SAFE_INTEGER,
    MAX_STATUS_KEYS,
    InvalidJobIdentityOptionsError,
    InvalidJobLeaseOptionsError,
    JobSchedulerType,
)

MAX_CODE_LENGTH = 64
MAX_NAME_LENGTH = 256
MAX_RUN_KEY_LENGTH = 1024

KEY_PREFIX = "v2:"
LOCK_KEY_DOMAIN = "sdcore/job-scheduler/lock-key/v2"
IDEMPOTENCY_KEY_DOMAIN = "sdcore/job-scheduler/idempotency-key/v2"

# What JavaScript's String.prototype.trim removes (ECMA-262 WhiteSpace + LineTerminator): TAB, VT,
# FF, SP, NBSP, ZWNBSP (BOM) and every Zs character, plus LF, CR, LS, PS. Python's str.strip()
# differs (it strips \x1c-\x1f and \x85, keeps \ufeff): a NestJS replica sharing the table would
# compute another key for the same code.
JS_TRIM_CHARS = (
    "\t\n\v\f\r \xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
)


def js_trim(text: str) -> str:
    """Return ``text`` trimmed exactly as JavaScript's ``String.prototype.trim`` trims it."""
    return text.strip(JS_TRIM_CHARS)


class _OmittedHeartbeat(int):
    """Marker default of ``heartbeat_ms``: an explicit ``-1`` is a plain ``int`` and is rejected."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<default heartbeat>"


_HEARTBEAT_OMITTED: int = _OmittedHeartbeat(-1)


def _describe(value: object) -> str:
    """Name a rejected value's type without calling its ``__str__``/``__repr__``."""
    return type(value).__name__


def _check_text(field_name: str, value: str, max_length: int) -> bytes:
    if "\x00" in value:
        raise InvalidJobIdentityOptionsError(field_name, "must not contain a NUL character")
    if len(value) > max_length:
        raise InvalidJobIdentityOptionsError(
            field_name, f"must hold at most {max_length} characters, got {len(value)}"
        )
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidJobIdentityOptionsError(
            field_name, "must be valid Unicode (it contains a lone surrogate)"
        ) from None


def _frame(part: bytes | None) -> bytes:
    # Tag + length prefix makes the concatenation injective: ("a:b", "c") and ("a", "b:c")
    # frame differently, and None (tag 0) differs from "" (tag 1, length 0).
    if part is None:
        return b"\x00"
    return b"\x01" + len(part).to_bytes(4, "big") + part


def encode_identity(domain: str, type_: str, code: bytes, run_key: bytes | None) -> bytes:
    """Return the injective byte encoding of one run identity in ``domain``.

    Args:
        domain: The domain-separation label (``LOCK_KEY_DOMAIN`` or ``IDEMPOTENCY_KEY_DOMAIN``).
        type_: ``"INITIAL"`` or ``"SCHEDULE"``.
        code: The trimmed code, UTF-8.
        run_key: The run key, UTF-8, or ``None`` for ``INITIAL``.

    Returns:
        The bytes that are hashed with SHA-256 into the key.
    """
    return b"".join(
        (
            _frame(domain.encode("ascii")),
            _frame(type_.encode("ascii")),
            _frame(code),
            _frame(run_key),
        )
    )


def _head(domain: str, type_: str) -> bytes:
    return _frame(domain.encode("ascii")) + _frame(type_.encode("ascii"))


def _check_int(field_name: str, value: object, minimum: int) -> int:
    if value is None:
        raise InvalidJobLeaseOptionsError(
            field_name, "None is not 'omitted'; leave the option out to get its default"
        )
    error = field_error(InvalidJobLeaseOptionsError)
    return int(int_between(field_name, value, minimum, MAX_SAFE_INTEGER, error=error))


def resolve_timing(lease_ms: object, heartbeat_ms: object) -> tuple[int, int]:
    """Validate lease timing and fill in the heartbeat default.

    Args:
        lease_ms: The lease length in milliseconds.
        heartbeat_ms: The heartbeat interval, or the omitted marker.

    Returns:
        ``(lease_ms, heartbeat_ms)`` as plain ints.

    Raises:
        InvalidJobLeaseOptionsError: Any violation of the timing rules.
    """
    lease = _check_int("lease_ms", lease_ms, 3)
    if type(heartbeat_ms) is _OmittedHeartbeat:
        return lease, min(DEFAULT_HEARTBEAT_MS, lease // 3)
    heartbeat = _check_int("heartbeat_ms", heartbeat_ms, 0)
    if heartbeat and 2 * heartbeat >= lease:
        raise InvalidJobLeaseOptionsError(
            "heartbeat_ms",
            f"must be strictly less than half the lease ({lease} ms), got {heartbeat}",
        )
    return lease, heartbeat


def _identity(
    code: object, raw_type: object, run_key: object
) -> tuple[str, JobSchedulerType, str, str]:
    """Validate an identity; return the trimmed code, the type, the lock and idempotency keys.

    Raises:
        InvalidJobIdentityOptionsError: Bad ``code``, ``type`` or ``run_key``.
    """
    if not isinstance(code, str):
        raise InvalidJobIdentityOptionsError("code", f"must be a str, got {_describe(code)}")
    code = js_trim(code)
    if not code:
        raise InvalidJobIdentityOptionsError("code", "must not be empty or only whitespace")
    code_bytes = _check_text("code", code, MAX_CODE_LENGTH)

    if isinstance(raw_type, JobSchedulerType):
        type_ = raw_type
    elif type(raw_type) is str and raw_type in _TYPES:
        type_ = _TYPES[raw_type]
    else:
        shown = repr(raw_type) if type(raw_type) is str else _describe(raw_type)
        raise InvalidJobIdentityOptionsError(
            "type", f"must be 'INITIAL' or 'SCHEDULE', got {shown[:80]}"
        )

    run_key_bytes: bytes | None
    if type_ is JobSchedulerType.INITIAL:
        if run_key is not None:
            raise InvalidJobIdentityOptionsError(
                "run_key", "must be None for INITIAL jobs (one run per code, ever)"
            )
        run_key_bytes = None
    else:
        if not isinstance(run_key, str):
            raise InvalidJobIdentityOptionsError(
                "run_key",
                f"is required for SCHEDULE jobs and must be a str, got {_describe(run_key)}",
            )
        if not run_key:
            raise InvalidJobIdentityOptionsError("run_key", "must not be empty for SCHEDULE jobs")
        run_key_bytes = _check_text("run_key", run_key, MAX_RUN_KEY_LENGTH)
    # encode_identity's framing, with the constant domain and type frames made once (a burst
    # derives 20,000 keys): the same bytes, so the same keys.
    tail = _frame(code_bytes) + _frame(run_key_bytes)
    lock_head, idem_head = _HEADS[type_]
    return (
        code,
        type_,
        KEY_PREFIX + hashlib.sha256(lock_head + tail).hexdigest(),
        KEY_PREFIX + hashlib.sha256(idem_head + tail).hexdigest(),
    )


# Only for exact str / JobSchedulerType / None values (a str subclass could compare equal to a
# cached value and skip a check). Invalid identities raise and are never cached.
_cached_identity = functools.lru_cache(maxsize=4096)(_identity)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobAcquireOptions:
    """Identity and lease timing of one logical run, validated on construction.

    Args:
        code: Job code; trimmed as JavaScript's ``trim()`` does, then 1–64 characters.
        run_key: Required for ``SCHEDULE`` (1–1,024 characters, the same on every replica for the
            same tick, e.g. ``"2026-07-20T03:00:00Z"``); must be ``None`` for ``INITIAL``.
        name: Optional display name (at most 256 characters); not part of the identity.
        type: ``JobSchedulerType`` member or its exact string value; defaults to ``SCHEDULE``.
        lease_ms: Lease length in ms (int, 3 to 2**53 - 1); defaults to ``DEFAULT_LEASE_MS``.
        heartbeat_ms: Heartbeat interval in ms; omitted means ``min(60_000, lease_ms // 3)``;
            ``0`` disables it; otherwise ``2 * heartbeat_ms < lease_ms``.

    Raises:
        InvalidJobIdentityOptionsError: Bad ``code``, ``type``, ``run_key`` or ``name``.
        InvalidJobLeaseOptionsError: Bad ``lease_ms`` or ``heartbeat_ms``.

    After construction ``code`` is trimmed, ``type`` is a ``JobSchedulerType``, ``heartbeat_ms``
    holds the effective interval, and ``lock_key`` / ``idempotency_key`` hold the ``v2:`` keys.
    """

    code: str
    run_key: str | None = None
    name: str | None = None
    type: JobSchedulerType | Literal["INITIAL", "SCHEDULE"] = JobSchedulerType.SCHEDULE
    lease_ms: int = DEFAULT_LEASE_MS
    heartbeat_ms: int = _HEARTBEAT_OMITTED
    lock_key: str = field(init=False, repr=False, compare=False)
    idempotency_key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        code: object = self.code
        raw_type: object = self.type
        run_key: object = self.run_key
        if (
            type(code) is str
            and (run_key is None or type(run_key) is str)
            and (type(raw_type) is str or type(raw_type) is JobSchedulerType)
        ):
            # Plain values: the keys of one identity are derived once (two SHA-256 and the
            # checks), however many times options for it are built.
            code, type_, lock, idem = _cached_identity(code, raw_type, run_key)
        else:
            code, type_, lock, idem = _identity(code, raw_type, run_key)

        name: object = self.name
        if name is not None:
            if not isinstance(name, str):
                raise InvalidJobIdentityOptionsError(
                    "name", f"must be a str or None, got {_describe(name)}"
                )
            _check_text("name", name, MAX_NAME_LENGTH)

        lease, heartbeat = resolve_timing(self.lease_ms, self.heartbeat_ms)

        setattr_(self, "code", code)
        setattr_(self, "type", type_)
        setattr_(self, "lease_ms", lease)
        setattr_(self, "heartbeat_ms", heartbeat)
        setattr_(self, "lock_key", lock)
        setattr_(self, "idempotency_key", idem)


_TYPES = {member.value: member for member in JobSchedulerType}
# The frames every key of a type starts with: (lock key's, idempotency key's).
_HEADS = {
    member: (_head(LOCK_KEY_DOMAIN, member.value), _head(IDEMPOTENCY_KEY_DOMAIN, member.value))
    for member in JobSchedulerType
}
_FIELDS = frozenset({"code", "run_key", "name", "type", "lease_ms", "heartbeat_ms"})
_CAMEL = {"runKey": "run_key", "leaseMs": "lease_ms", "heartbeatMs": "heartbeat_ms"}


def coerce_options(options: JobAcquireOptions | Mapping[str, Any]) -> JobAcquireOptions:
    """Accept a ``JobAcquireOptions`` or a plain mapping, validated the same way.

    Args:
        options: The options, typed or not.

    Returns:
        A validated ``JobAcquireOptions``.

    Raises:
        InvalidJobIdentityOptionsError: Not options, an unknown key, or bad identity.
        InvalidJobLeaseOptionsError: Bad timing.
    """
    if isinstance(options, JobAcquireOptions):
        return options
    if not isinstance(options, Mapping):
        raise InvalidJobIdentityOptionsError(
            "options", f"must be JobAcquireOptions or a mapping, got {_describe(options)}"
        )
    for key in options:
        if key not in _FIELDS:
            hint = f"; did you mean {_CAMEL[key]!r}?" if key in _CAMEL else ""
            shown = repr(key)[:80] if isinstance(key, str) else _describe(key)
            raise InvalidJobIdentityOptionsError("options", f"unknown option {shown}{hint}")
    if "code" not in options:
        raise InvalidJobIdentityOptionsError("code", "is required")
    return JobAcquireOptions(**options)


def coerce_batch(
    options: Sequence[JobAcquireOptions | Mapping[str, Any]],
) -> list[JobAcquireOptions]:
    """Validate every item of an ``acquire_many`` call, all before any SQL.

    Args:
        options: A sequence of options (typed or mappings), at most :data:`MAX_STATUS_KEYS`.

    Returns:
        The validated options, in the input order.

    Raises:
        InvalidJobIdentityOptionsError: Not a sequence, too many items, an invalid item (the
            error names its index), or two items with one identity (one lock key).
        InvalidJobLeaseOptionsError: An item with bad timing (the error names its index).
    """
    if isinstance(options, str | bytes | Mapping) or not isinstance(options, Sequence):
        raise InvalidJobIdentityOptionsError(
            "options", f"must be a sequence of options, got {_describe(options)}"
        )
    if len(options) > MAX_STATUS_KEYS:
        raise InvalidJobIdentityOptionsError(
            "options", f"at most {MAX_STATUS_KEYS} items per call, got {len(options)}"
        )
    batch: list[JobAcquireOptions] = []
    first: dict[str, int] = {}
    for index, item in enumerate(options):
        try:
            opts = item if type(item) is JobAcquireOptions else coerce_options(item)
        except (InvalidJobLeaseOptionsError, InvalidJobIdentityOptionsError) as exc:
            raise type(exc)(f"options[{index}].{exc.field}", exc.problem) from None
        seen = first.setdefault(opts.lock_key, index)
        if seen != index:
            raise InvalidJobIdentityOptionsError(
                f"options[{index}]", f"the same run as options[{seen}] (one lock key)"
            )
        batch.append(opts)
    return batch


def lock_key(code: str, run_key: str | None = None, type: str = "SCHEDULE") -> str:  # noqa: A002
    """Return the ``v2:`` lock key of an identity (the unique column of the table).

    Raises:
        InvalidJobIdentityOptionsError: The identity is invalid.
    """
    return coerce_options({"code": code, "run_key": run_key, "type": type}).lock_key


def idempotency_key(code: str, run_key: str | None = None, type: str = "SCHEDULE") -> str:  # noqa: A002
    """Return the ``v2:`` idempotency key of an identity (stable across reclaims).

    Raises:
        InvalidJobIdentityOptionsError: The identity is invalid.
    """
    return coerce_options({"code": code, "run_key": run_key, "type": type}).idempotency_key


def bullmq_job_id(key: str) -> str:
    """Turn an idempotency key into a deterministic BullMQ custom job id.

    Node's BullMQ refuses ``:`` in custom ids and ids made only of digits. The id is
    ``"sd-"`` + the SHA-256 hex of the key's UTF-8 bytes: 67 characters from ``[a-z0-9-]``, the
    same in every process and in any language.

    Args:
        key: Any non-empty string, usually ``lease.idempotency_key``.

    Returns:
        The job id.

    Raises:
        TypeError: ``key`` is not a str.
        ValueError: ``key`` is empty or not valid Unicode.
    """
    if not isinstance(key, str):
        raise TypeError(f"idempotency key must be a str, got {_describe(key)}")
    if not key:
        raise ValueError("idempotency key must not be empty")
    try:
        data = key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("idempotency key must be valid Unicode") from None
    return "sd-" + hashlib.sha256(data).hexdigest()
