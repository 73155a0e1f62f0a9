"""Event names and listener patterns: validation and segment matching (no regular expressions).

A name is split on ``.`` into *segments*. In a listener pattern a segment may be ``*`` (exactly one
segment) or ``**`` (zero or more segments, as in EventEmitter2); any other segment matches itself.
Emitted names are concrete: they may not contain ``*`` at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from sdcore.events._errors import InvalidEventNameError

MAX_EVENT_NAME_LENGTH = 255
ONE = "*"
ANY = "**"


def _check_text(name: object) -> str:
    if not isinstance(name, str):
        raise InvalidEventNameError(name, f"must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidEventNameError(name, "must not be empty")
    if len(name) > MAX_EVENT_NAME_LENGTH:
        raise InvalidEventNameError(
            name, f"is {len(name)} characters long, at most {MAX_EVENT_NAME_LENGTH} are allowed"
        )
    if "\x00" in name:
        raise InvalidEventNameError(name, "must not contain NUL")
    if "" in name.split("."):
        raise InvalidEventNameError(name, "has an empty segment (leading, trailing or doubled '.')")
    return name


def validate_name(name: object) -> str:
    """Return ``name`` if it is a valid emitted event name.

    Raises:
        InvalidEventNameError: Not a str, empty, longer than 255 characters, containing NUL or
            ``*``, or with an empty segment.
    """
    text = _check_text(name)
    if ONE in text:
        raise InvalidEventNameError(
            name, "wildcards ('*', '**') are for listener patterns; emit a concrete name"
        )
    return text


def parse_pattern(pattern: object) -> tuple[str, ...] | None:
    """Validate a listener pattern.

    Returns:
        The pattern's segments if it has a wildcard, ``None`` for a plain name (matched by ``==``).

    Raises:
        InvalidEventNameError: As :func:`validate_name`, or a ``*`` that is not a whole segment
            (``a.**b``, ``a*``, ``***``).
    """
    text = _check_text(pattern)
    if ONE not in text:
        return None
    segments = tuple(text.split("."))
    for position, segment in enumerate(segments, start=1):
        if ONE in segment and segment not in (ONE, ANY):
            raise InvalidEventNameError(
                pattern,
                f"segment {position} ({segment!r}): '*' and '**' must be a whole segment "
                "between dots",
            )
    return segments


def match_segments(pattern: Sequence[str], name: Sequence[str]) -> bool:
    """Return whether ``name``'s segments match ``pattern``'s (``*``: one, ``**``: zero or more).

    The classic linear wildcard walk: remember the last ``**`` and, on a mismatch, let it absorb
    one more segment. Exact because ``**`` is the only variable-width token.
    """
    p = n = 0
    star = -1
    resume = 0
    plen, nlen = len(pattern), len(name)
    while n < nlen:
        if p < plen and pattern[p] == ANY:
            star, resume = p, n
            p += 1
        elif p < plen and (pattern[p] == ONE or pattern[p] == name[n]):
            p += 1
            n += 1
        elif star >= 0:
            resume += 1
            p, n = star + 1, resume
        else:
            return False
    while p < plen and pattern[p] == ANY:
        p += 1
    return p == plen
