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

ALGORITHM = "HS256"


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
) -> str:
    """Sign a token for ``user_id`` valid from ``now`` for ``ttl``."""
    claims: dict[str, Any] = {"sub": str(user_id), "iat": now, "exp": now + ttl}
    if email is not None:
        claims["email"] = email
    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def decode_token(token: str, secret: str) -> AuthUser:
    """Verify ``token`` and return its user.

    Only HS256 is accepted (never ``none``, never an algorithm named by the token); ``exp`` and
    ``sub`` are required.

    Raises:
        UnauthorizedError: Bad signature, expired, malformed, or ``sub`` not a UUID.
    """
    try:
        claims = jwt.decode(
            token, secret, algorithms=[ALGORITHM], options={"require": ["exp", "sub"]}
        )
    except jwt.ExpiredSignatureError:
        raise UnauthorizedError("The token has expired.") from None
    except jwt.InvalidTokenError:
        raise UnauthorizedError("The token is not valid.") from None
    try:
        user_id = uuid.UUID(str(claims["sub"]))
    except ValueError:
        raise UnauthorizedError("The token's subject is not a user id.") from None
    email = claims.get("email")
    return AuthUser(id=user_id, email=email if isinstance(email, str) and email else None)


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
    secret: str = request.app.state.taskflow.settings.jwt_secret
    return decode_token(credentials.credentials, secret)


CurrentUser = Annotated[AuthUser, Depends(current_user)]
