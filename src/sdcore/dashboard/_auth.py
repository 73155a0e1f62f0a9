"""Who may act on the dashboard: signed session cookies, operator tokens, CSRF tokens.

- The session is a cookie ``<payload>.<HMAC-SHA256>`` (HttpOnly, SameSite=Strict, Secure over
  HTTPS): a random session id, the operator's name once logged in, and an expiry. The key is
  derived from the operator token (every replica with the same token accepts the same cookie)
  or given as ``secret``.
- Every visitor gets a session (anonymous until login), so even the login form carries a CSRF
  token; logging in issues a new session id (no session fixation).
- The CSRF token of a session is ``HMAC(key, "csrf:" + session id)``: nothing to store, checked
  with :func:`hmac.compare_digest`, like the operator token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from sdcore.exceptions import SdcoreError

COOKIE = "sdcore_dashboard"
SESSION_TTL_S = 12 * 3600
MAX_ACTOR = 100


class DashboardError(SdcoreError, ValueError):
    """The dashboard cannot be built as configured (a bad token, secret or option)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Session:
    """A visitor's session."""

    sid: str
    actor: str | None
    expires: int


class Signer:
    """Signs and checks session cookies and CSRF tokens with one key.

    Args:
        key: At least 16 bytes.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise DashboardError("the dashboard's signing secret must hold at least 16 bytes")
        self._key = key

    @classmethod
    def for_token(cls, token: str) -> Signer:
        """The signer of a token-protected dashboard (same token → same key on every replica)."""
        digest = hmac.new(token.encode("utf-8"), b"sdcore-dashboard-session-v1", hashlib.sha256)
        return cls(digest.digest())

    def _mac(self, data: bytes) -> str:
        mac = hmac.new(self._key, data, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode("ascii").rstrip("=")

    def new_session(self, actor: str | None) -> Session:
        """A fresh session id (for an anonymous visitor, or at login)."""
        return Session(
            sid=secrets.token_urlsafe(18), actor=actor, expires=int(time.time()) + SESSION_TTL_S
        )

    def dump(self, session: Session) -> str:
        """The cookie value of ``session``."""
        payload = json.dumps(
            {"s": session.sid, "a": session.actor, "e": session.expires}, separators=(",", ":")
        ).encode("utf-8")
        body = base64.urlsafe_b64encode(payload).decode("ascii").rstrip("=")
        return f"{body}.{self._mac(body.encode('ascii'))}"

    def load(self, value: str | None) -> Session | None:
        """The session of a cookie value, or ``None`` when absent, forged or expired."""
        if not value or value.count(".") != 1 or len(value) > 4096:
            return None
        body, mac = value.split(".")
        if not hmac.compare_digest(self._mac(body.encode("ascii", "replace")), mac):
            return None
        try:
            data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            actor = data["a"]
            session = Session(sid=str(data["s"]), actor=actor, expires=int(data["e"]))
        except (ValueError, KeyError, TypeError):
            return None
        if (actor is not None and not isinstance(actor, str)) or session.expires < time.time():
            return None
        return session

    def csrf(self, session: Session) -> str:
        """The CSRF token of ``session``."""
        return self._mac(b"csrf:" + session.sid.encode("ascii"))

    def check_csrf(self, session: Session | None, token: str | None) -> bool:
        """Whether ``token`` is the CSRF token of ``session`` (constant time)."""
        if session is None or not token:
            return False
        return hmac.compare_digest(self.csrf(session), token)


def token_matches(expected: str | None, given: str | None) -> bool:
    """Whether ``given`` is the operator token (constant time; ``False`` without a token)."""
    if not expected or not given:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8"))


def check_token(token: object) -> str | None:
    """Validate an operator token: ``None``, or at least 16 characters.

    Raises:
        DashboardError: Too short, or not a str.
    """
    if token is None:
        return None
    if not isinstance(token, str) or len(token.strip()) < 16:
        raise DashboardError(
            "the dashboard token must be a str of at least 16 characters "
            "(generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def check_actor(name: str) -> str | None:
    """A login name as recorded with actions (``None``: empty or unusable)."""
    name = " ".join(name.split())
    if not name or len(name) > MAX_ACTOR or "\x00" in name:
        return None
    return name
