"""Strict JSON for ``jsonb`` columns: validated in Python before any SQL.

PostgreSQL rejects NaN/Infinity and ``"\\u0000"`` in jsonb with a server error that aborts the
caller's transaction, and silently merges ``{1: …, "1": …}``. Checking here keeps the caller's
transaction usable and names the offending path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from sdcore.exceptions import SdcoreError

MAX_JSON_DEPTH = 100
MAX_JSON_BYTES = 1024 * 1024


class JsonValueError(SdcoreError, ValueError):
    """A JSON value that PostgreSQL's jsonb (or JSON itself) cannot hold.

    Attributes:
        field: The argument being checked (e.g. ``"data"``).
        path: Where in the value, e.g. ``$.items[3].price``.
        problem: What is wrong.
    """

    def __init__(self, field: str, path: str, problem: str) -> None:
        self.field = field
        self.path = path
        self.problem = problem
        shown = path if len(path) <= 120 else "…" + path[-119:]
        super().__init__(f"{field} at {shown}: {problem}")


class JsonTypeError(SdcoreError, TypeError):
    """A value of a type that has no JSON form (datetime, bytes, set, custom objects, …).

    Attributes:
        field: The argument being checked.
        path: Where in the value.
        problem: What is wrong.
    """

    def __init__(self, field: str, path: str, problem: str) -> None:
        self.field = field
        self.path = path
        self.problem = problem
        shown = path if len(path) <= 120 else "…" + path[-119:]
        super().__init__(f"{field} at {shown}: {problem}")


def _check_str(field: str, path: list[str], value: str) -> None:
    if "\x00" in value:
        raise JsonValueError(field, _where(path), "NUL character (\\u0000) is not allowed in jsonb")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonValueError(field, _where(path), "lone surrogate: not valid Unicode") from None


def _where(path: list[str]) -> str:
    return "$" + "".join(path)


def _walk(field: str, value: object, path: list[str], depth: int, active: set[int]) -> None:
    # ``path`` is a stack of segments, joined only when an error is raised: building the text
    # of every key's path for valid data would dominate enqueue_once's Python time.
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        _check_str(field, path, value)
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise JsonValueError(field, _where(path), f"{value!r} is not a JSON number")
        return
    if depth >= MAX_JSON_DEPTH:
        raise JsonValueError(field, _where(path), f"nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, Mapping | list | tuple):
        marker = id(value)
        if marker in active:
            raise JsonValueError(field, _where(path), "circular reference")
        active.add(marker)
        try:
            if isinstance(value, Mapping):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise JsonTypeError(
                            field,
                            _where(path),
                            f"object keys must be str, got {type(key).__name__} "
                            "(keys that collide once stringified would be lost)",
                        )
                    path.append(f".{key[:40]}")
                    _check_str(field, path, key)
                    _walk(field, item, path, depth + 1, active)
                    path.pop()
            else:
                for index, item in enumerate(value):
                    path.append(f"[{index}]")
                    _walk(field, item, path, depth + 1, active)
                    path.pop()
        finally:
            active.discard(marker)
        return
    raise JsonTypeError(field, _where(path), f"{type(value).__name__} is not JSON serializable")


def _as_object(value: object) -> dict[str, Any]:
    """``json.dumps``'s ``default``: a ``Mapping`` that is not a ``dict`` becomes one."""
    if isinstance(value, Mapping):
        return dict(value)
    # _walk refused every other type before serialization.
    raise JsonTypeError("value", "$", f"{type(value).__name__} is not JSON serializable")


def published_json_size(value: Mapping[str, Any], text: str) -> int:
    """Return the bytes of ``value`` as the outbox relay sends it to BullMQ.

    The unit is the compact JSON with every non-ASCII character escaped (``\\u00e9``; an
    astral character as two escapes), which is ``json.dumps``'s default and what BullMQ stores
    and the publisher measures against ``max_job_bytes``, of the payload as it comes back from
    jsonb: a float of magnitude 1e16 or more comes back as an int written in full (``1e+300``
    becomes 301 digits).

    Args:
        value: The payload, already validated.
        text: Its compact JSON from :func:`dump_json_object` (``ensure_ascii=False``).
    """
    if text.isascii() and "\x7f" not in text:
        size = len(text)
    else:
        size = len(json.dumps(value, allow_nan=False, separators=(",", ":"), default=_as_object))
    if "e+" in text:
        size += _big_float_growth(value)
    return size


def _big_float_growth(value: object) -> int:
    """How many bytes the floats ≥ 1e16 in ``value`` grow by on their way through jsonb."""
    growth = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if abs(item) >= 1e16:
                written = repr(item)
                growth += len(str(int(Decimal(written)))) - len(written)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return growth


def dump_json_object(
    value: Mapping[str, Any] | None,
    *,
    field: str = "data",
    max_bytes: int = MAX_JSON_BYTES,
    published: bool = False,
) -> str | None:
    """Validate a JSON object and serialize it for a ``jsonb`` parameter.

    Tuples become arrays, and a ``Mapping`` that is not a ``dict`` (``MappingProxyType``, …)
    an object. Strings are stored as given (no Unicode normalization).

    Args:
        value: A mapping with str keys and JSON values, or ``None``.
        field: The argument's name, used in error messages.
        max_bytes: Largest accepted serialized size in bytes.
        published: Measure the size as the outbox relay sends it (:func:`published_json_size`)
            instead of as UTF-8.

    Returns:
        The compact JSON text, or ``None`` for ``None``.

    Raises:
        JsonTypeError: Not a mapping, a non-str key, or a non-JSON type.
        JsonValueError: NaN/Infinity, NUL, lone surrogate, circular or too deep, too large.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise JsonTypeError(
            field, "$", f"must be a JSON object (a mapping) or None, got {type(value).__name__}"
        )
    _walk(field, value, [], 0, set())
    text = json.dumps(
        value, allow_nan=False, ensure_ascii=False, separators=(",", ":"), default=_as_object
    )
    if published:
        size = published_json_size(value, text)
        if size > max_bytes:
            raise JsonValueError(
                field,
                "$",
                f"{size} bytes as the relay sends it (compact JSON, non-ASCII escaped as"
                f" \\uXXXX), more than {max_bytes}",
            )
        return text
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise JsonValueError(field, "$", f"{size} bytes serialized, more than {max_bytes}")
    return text
