"""Connection strings and messages with their passwords masked (``***``)."""

from __future__ import annotations

import re

from psycopg.conninfo import conninfo_to_dict, make_conninfo

MASK = "***"

# ``scheme://user:SECRET@host``: the secret runs to the *last* "@" of the authority, so a
# password holding a raw "@" (``u:p@ss@h``) is masked whole, whichever "@" a parser splits at.
_URL_PASSWORD = re.compile(
    r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)(?P<secret>[^\s/?#]*)(?=@)", re.IGNORECASE
)
# ``password=SECRET``: quoted ('…' with \' escapes) or unquoted, where libpq lets a backslash
# escape a space (``password=a\ b`` is the password "a b"); a Redis Sentinel URL's
# ``sentinel_password=`` too.
_KV_PASSWORD = re.compile(
    r"(?P<head>\b(?:sentinel_)?password\s*=\s*)(?P<secret>'(?:[^'\\]|\\.)*'?|(?:\\.|[^\s\\])+\\?)",
    re.IGNORECASE,
)


def redact_dsn(dsn: str) -> str:
    """Return the DSN with its password replaced by ``***``.

    Works for URLs and ``key=value`` strings, and for strings psycopg cannot parse.

    Args:
        dsn: A libpq connection string.

    Returns:
        The same connection string without the secret.
    """
    try:
        params = conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001 - a malformed DSN must still be shown safely
        return redact_text(dsn, dsn)
    if "password" in params:
        params["password"] = MASK
    return make_conninfo(**{k: str(v) for k, v in params.items()})


def redact_text(text: str, dsn: str | None = None) -> str:
    """Remove passwords (from ``dsn``, and any DSN-shaped ones) from an arbitrary message.

    Args:
        text: A message, for example a driver error.
        dsn: The connection string whose password must not appear.

    Returns:
        The message with secrets masked.
    """
    if dsn:
        try:
            secret = conninfo_to_dict(dsn).get("password")
        except Exception:  # noqa: BLE001 - an unparsable DSN has no password to look for
            secret = None
        if secret:
            text = text.replace(str(secret), MASK)
    text = _URL_PASSWORD.sub(rf"\g<head>{MASK}", text)
    return _KV_PASSWORD.sub(rf"\g<head>{MASK}", text)
