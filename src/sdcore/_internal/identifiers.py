"""Identifier rules for every configurable table, schema and channel name."""

from __future__ import annotations

import hashlib
import os

from psycopg import sql

from sdcore._internal.errors import FieldError
from sdcore.exceptions import SdcoreError

MAX_IDENTIFIER_BYTES = 63


class InvalidIdentifierError(FieldError, SdcoreError, ValueError):
    """A schema or table name that PostgreSQL would truncate or cannot hold."""


def check_identifier(field: str, value: object) -> str:
    """Validate a configurable identifier (quoted later with ``sql.Identifier``).

    Args:
        field: The option name, for the message.
        value: The identifier.

    Returns:
        The identifier, unchanged.

    Raises:
        InvalidIdentifierError: Not a str, empty, with NUL or ``%``, or longer than 63 bytes.
    """
    if not isinstance(value, str):
        raise InvalidIdentifierError(field, f"must be a str, got {type(value).__name__}")
    if not value:
        raise InvalidIdentifierError(field, "must not be empty")
    if "\x00" in value:
        raise InvalidIdentifierError(field, "must not contain a NUL character")
    if "%" in value:
        # Rendered into statements that also carry %s parameters, a % would be read as one.
        raise InvalidIdentifierError(field, "must not contain '%'")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidIdentifierError(field, "must be valid Unicode") from None
    if size > MAX_IDENTIFIER_BYTES:
        raise InvalidIdentifierError(
            field, f"PostgreSQL would truncate it: {size} bytes, at most {MAX_IDENTIFIER_BYTES}"
        )
    return value


def qualified(table: str, schema: str | None) -> sql.Identifier:
    """Return the quoted ``schema.table`` (or ``table``) after validating both parts."""
    check_identifier("table", table)
    if schema is None:
        return sql.Identifier(table)
    return sql.Identifier(check_identifier("schema", schema), table)


def derived_name(table: str, suffix: str) -> str:
    """Return the name of a constraint or index of ``table``: ``{table}_{suffix}``.

    When that exceeds 63 bytes the table part is clipped (at a character boundary) and an
    8-hex-digit hash of the whole table name is added, so two long table names that share a
    prefix never get the same index names (``CREATE INDEX IF NOT EXISTS`` would silently skip the
    second table's indexes).

    Args:
        table: The validated table name.
        suffix: ``lock_key_key``, ``pkey``, ``code_created_at_idx``, ...

    Returns:
        The unquoted name, at most 63 bytes.
    """
    name = f"{table}_{suffix}"
    if len(name.encode("utf-8")) <= MAX_IDENTIFIER_BYTES:
        return name
    digest = hashlib.sha256(table.encode("utf-8")).hexdigest()[:8]
    room = MAX_IDENTIFIER_BYTES - len(suffix.encode("utf-8")) - len(digest) - 2
    base = table.encode("utf-8")[:room].decode("utf-8", "ignore")
    return f"{base}_{digest}_{suffix}"


# One hex digit of the variant field: 10xx (RFC 9562).
_VARIANT = str.maketrans("0123456789abcdef", "89ab89ab89ab89ab")


def random_uuids(count: int) -> list[str]:
    """``count`` random (version 4) UUIDs in their canonical text form.

    The same values as ``str(uuid.uuid4())`` (122 random bits from ``os.urandom``), made from
    one read of the OS's random source: about a seventh of the CPU per token, which matters
    when a burst hands out thousands of owner tokens.
    """
    digits = os.urandom(16 * count).hex()
    return [
        f"{digits[i : i + 8]}-{digits[i + 8 : i + 12]}-4{digits[i + 13 : i + 16]}-"
        f"{digits[i + 16].translate(_VARIANT)}{digits[i + 17 : i + 20]}-{digits[i + 20 : i + 32]}"
        for i in range(0, 32 * count, 32)
    ]


def random_uuid() -> str:
    """One random (version 4) UUID in its canonical text form (see :func:`random_uuids`).

    Formatted here rather than as ``random_uuids(1)[0]``: the single lease acquire makes one per
    call, on its hot path, and a list built and indexed per call would cost more than the
    formatting itself.
    """
    digits = os.urandom(16).hex()
    return (
        f"{digits[:8]}-{digits[8:12]}-4{digits[13:16]}-"
        f"{digits[16].translate(_VARIANT)}{digits[17:20]}-{digits[20:]}"
    )
