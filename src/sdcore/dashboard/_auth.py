"""Who may act on the dashboard: signed session cookies, operator tokens, CSRF tokens.

- The session is a cookie ``<payload>.<HMAC-SHA256>`` (HttpOnly, SameSite=Strict, Secure over
  HTTPS): a random session id, the operator's name once logged in, and an expiry. The key is
  derived from the operator token (every replica with the same token accepts the same cookie),
  from ``secret`` and the token when both are given, or is ``secret`` alone.
- Every visitor gets a session (anonymous until login), so even the login form carries a CSRF
  token; logging in issues a new session id (no session fixation).
- The CSRF token of a session is ``HMAC(key, "csrf:" + session id)``: nothing to store, checked
  with :func:`hmac.compare_digest`, like the operator token.
- Signing out revokes the session id in this process (:class:`Revocations`) until it expires; a
  copy of the cookie no longer acts here. Signing in again revokes the signed-in session it
  replaces, which the browser no longer holds and a later sign-out could not name. Other
  processes serving the same dashboard do not know it: rotating the token (or ``secret``)
  ends every session everywhere.
- Wrong sign-ins are rationed per client address and in all (:class:`LoginThrottle`), so a
  token cannot be guessed online at the server's speed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from sdcore.exceptions import SdcoreError

COOKIE = "sdcore_dashboard"
SESSION_TTL_S = 12 * 3600
MAX_ACTOR = 100
MIN_TOKEN_CHARS = 16
# Estimated by token_bits: "a"*16 and "\U0001f600"*16 are 0 bits, "password"*5 is 22,
# "abcdefghijklmnopqrstuvwxyz" 9, "password12345678" 39; secrets.token_urlsafe(16) scores 92 at
# the median and under 70 in about 1 of 200,000 draws (runs like "cccc"), token_hex(16) above
# 78 in 400,000 draws, token_urlsafe(32) above 170.
MIN_TOKEN_BITS = 70
MIN_COPY_CHARS = 4  # shorter repeats occur by chance in random tokens
_GENERATE = "generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


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
    def for_token(cls, token: str, secret: bytes | None = None) -> Signer:
        """The signer of a token-protected dashboard (same token and secret → same key on every
        replica). The key depends on the token even when ``secret`` is given: rotating a leaked
        token must end the sessions signed in with it."""
        if secret is not None:
            Signer(secret)  # the same length check as a secret used alone
            data = b"sdcore-dashboard-session-v1:" + token.encode("utf-8")
            return cls(hmac.new(secret, data, hashlib.sha256).digest())
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


def token_bits(token: str) -> float:
    """Estimate the entropy of ``token`` in bits: the Shannon entropy of its characters times
    the number of characters that add something.

    A character adds nothing when it starts a copy of 4 or more characters seen earlier in the
    token (``"password" * 5`` counts as one ``"password"``) or continues a run of 3 with a step
    of -1, 0 or +1 (``"abcdef"``, ``"4321"``, ``"aaa"``). Characters, not bytes: a repeated
    emoji's four UTF-8 bytes are one character. An overestimate for structured text, but it
    catches what length alone accepts.
    """
    total = len(token)
    if not total:
        return 0.0
    per_char = -sum(n / total * math.log2(n / total) for n in Counter(token).values())
    adding, at = 0, 0
    while at < total:
        copied = 0  # the longest earlier copy (it may overlap) of the text starting here
        while at + copied < total and token.find(token[at : at + copied + 1], 0, at + copied) >= 0:
            copied += 1
        if copied >= MIN_COPY_CHARS:
            at += copied
            continue
        if at >= 2:
            step = ord(token[at]) - ord(token[at - 1])
            if abs(step) <= 1 and step == ord(token[at - 1]) - ord(token[at - 2]):
                at += 1
                continue
        adding += 1
        at += 1
    return abs(per_char * adding)  # abs: one distinct character gives -0.0


def check_token(token: object) -> str | None:
    """Validate an operator token: ``None``, or at least 16 characters and about 70 bits
    (:func:`token_bits`).

    Raises:
        DashboardError: Too short, too predictable, or not a str.
    """
    if token is None:
        return None
    if not isinstance(token, str) or len(token.strip()) < MIN_TOKEN_CHARS:
        raise DashboardError(
            f"the dashboard token must be a str of at least {MIN_TOKEN_CHARS} characters "
            f"({_GENERATE})"
        )
    bits = token_bits(token.strip())
    if bits < MIN_TOKEN_BITS:
        raise DashboardError(
            f"the dashboard token is too predictable (about {bits:.0f} bits of entropy, at least "
            f"{MIN_TOKEN_BITS} needed: repeats, sequences or few distinct characters; {_GENERATE})"
        )
    return token


def check_actor(name: str) -> str | None:
    """A login name as recorded with actions (``None``: empty or unusable)."""
    name = " ".join(name.split())
    if not name or len(name) > MAX_ACTOR or "\x00" in name:
        return None
    return name


class Revocations:
    """Session ids signed out in this process, each kept until its cookie would expire anyway.

    At most ``limit`` ids: past it the expired ones go first, then those expiring soonest (their
    cookies have the least time left to be misused).
    """

    def __init__(self, *, limit: int = 10_000, clock: Callable[[], float] = time.time) -> None:
        self._limit = limit
        self._clock = clock
        self._ids: dict[str, int] = {}

    def revoke(self, session: Session) -> None:
        """Refuse ``session`` from now on."""
        self._ids[session.sid] = session.expires
        if len(self._ids) > self._limit:
            now = self._clock()
            self._ids = {sid: end for sid, end in self._ids.items() if end >= now}
            while len(self._ids) > self._limit:
                del self._ids[min(self._ids, key=self._ids.__getitem__)]

    def __contains__(self, session: Session) -> bool:
        return session.sid in self._ids


class LoginThrottle:
    """Ration wrong sign-ins within any ``window_s``: ``per_client`` per client address, and
    ``overall`` in all. Past its own budget a client is refused every sign-in (even a right
    one) until its oldest failure leaves the window; past the overall budget, so is every client
    with a failure in the window.

    The overall budget holds when the addresses vary: each new address then gets one guess per
    window. A client without failures always gets its try, so a flood of wrong guesses from
    elsewhere cannot lock an operator out. Memory is bounded by the failures kept (``overall``).
    """

    def __init__(
        self,
        *,
        per_client: int = 10,
        overall: int = 100,
        window_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._per_client = per_client
        self._window_s = window_s
        self._clock = clock
        self._failures: deque[tuple[float, str]] = deque(maxlen=overall)
        self._overall = overall
        self._counts: Counter[str] = Counter()

    def _expire(self) -> float:
        now = self._clock()
        while self._failures and self._failures[0][0] <= now - self._window_s:
            _, client = self._failures.popleft()
            self._forget(client)
        return now

    def _forget(self, client: str) -> None:
        self._counts[client] -= 1
        if self._counts[client] <= 0:
            del self._counts[client]

    def retry_after(self, client: str) -> int | None:
        """Seconds until ``client`` may try again, or ``None`` when it may now."""
        now = self._expire()
        if self._counts[client] == 0:
            return None
        if len(self._failures) >= self._overall:
            oldest = self._failures[0][0]
        elif self._counts[client] >= self._per_client:
            oldest = next(at for at, who in self._failures if who == client)
        else:
            return None
        return max(1, math.ceil(oldest + self._window_s - now))

    def failed(self, client: str) -> int:
        """Count a wrong sign-in of ``client``; return its failures within the window."""
        now = self._expire()
        if len(self._failures) == self._overall:
            self._forget(self._failures[0][1])  # the deque drops it on append
        self._failures.append((now, client))
        self._counts[client] += 1
        return self._counts[client]
