"""Bearer tokens: HS256 JWTs whose ``sub`` is the user's id (and, optionally, an ``email``).

TaskFlow does not issue tokens (a real deployment gets them from its identity provider); the
``python -m taskflow.token`` helper signs one for trying the API.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any

import jwt
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from taskflow.errors import UnauthorizedError
from taskflow.settings import DEFAULT_AUDIENCE, DEFAULT_ISSUER, DEFAULT_MAX_TOKEN_AGE_S

ALGORITHM = "HS256"
LEEWAY_S = 5  # clock skew between the identity provider and this server
MAX_EMAIL_CHARS = 320  # users.email varchar(320), RFC 5321's limit


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthUser:
    """The caller, as the token says."""

    id: uuid.UUID
    email: str | None = None


def encode_token(
    user_id: uuid.UUID,
    secret: str,
    *,
    now: datetime,
    ttl: timedelta = timedelta(hours=12),
    email: str | None = None,
    issuer: str = DEFAULT_ISSUER,
    audience: str = DEFAULT_AUDIENCE,
) -> str:
    """Sign a token for ``user_id`` valid from ``now`` for ``ttl``, for ``issuer``/``audience``."""
    claims: dict[str, Any] = {
        "sub": str(user_id),
        "iss": issuer,
        "aud": audience,
        "iat": now,
        "exp": now + ttl,
    }
    if email is not None:
        claims["email"] = email
    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def decode_token(
    token: str,
    secret: str,
    *,
    issuer: str = DEFAULT_ISSUER,
    audience: str = DEFAULT_AUDIENCE,
    max_age_s: int = DEFAULT_MAX_TOKEN_AGE_S,
) -> AuthUser:
    """Verify ``token`` and return its user.

    Only HS256 is accepted (never ``none``, never an algorithm named by the token); ``sub``,
    ``iss`` (must be ``issuer``), ``aud`` (must name ``audience``), ``iat`` and ``exp`` (numbers,
    not strings) are required, and ``exp - iat`` may not exceed ``max_age_s``. An ``email``
    claim, if present, must be an address that fits the users table.

    Raises:
        UnauthorizedError: Bad signature, expired, wrong issuer or audience, too long-lived,
            malformed, ``sub`` not a UUID, or an unusable ``email``.
    """
    try:
        claims = jwt.decode(
            token,
            secret,
            algorithms=[ALGORITHM],
            issuer=issuer,
            audience=audience,
            leeway=LEEWAY_S,
            options={"require": ["exp", "iat", "sub", "iss", "aud"]},
        )
    except jwt.ExpiredSignatureError:
        raise UnauthorizedError("The token has expired.") from None
    except (jwt.InvalidIssuerError, jwt.InvalidAudienceError):
        raise UnauthorizedError("The token was not issued for this service.") from None
    except jwt.InvalidTokenError:
        raise UnauthorizedError("The token is not valid.") from None
    issued, expires = claims["iat"], claims["exp"]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (issued, expires)):
        raise UnauthorizedError("The token is not valid.")
    if expires - issued > max_age_s:
        raise UnauthorizedError(
            f"The token lives longer than this service accepts ({max_age_s} s)."
        )
    try:
        user_id = uuid.UUID(str(claims["sub"]))
    except ValueError:
        raise UnauthorizedError("The token's subject is not a user id.") from None
    email = claims.get("email")
    if email is not None and not _usable_email(email):
        raise UnauthorizedError("The token's email claim is not a usable address.")
    return AuthUser(id=user_id, email=email or None)


def _usable_email(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) <= MAX_EMAIL_CHARS
        and not any(ord(c) < 32 or 0xD800 <= ord(c) <= 0xDFFF for c in value)
    )


_bearer = HTTPBearer(auto_error=False)


def current_user(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> AuthUser:
    """FastAPI dependency: the caller of this request.

    Raises:
        UnauthorizedError: No ``Authorization: Bearer`` header or an invalid token.
    """
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise UnauthorizedError("A Bearer token is required.")
    settings = request.app.state.taskflow.settings
    return decode_token(
        credentials.credentials,
        settings.jwt_secret,
        issuer=settings.jwt_issuer,
        audience=settings.jwt_audience,
        max_age_s=settings.jwt_max_age_s,
    )


CurrentUser = Annotated[AuthUser, Depends(current_user)]
