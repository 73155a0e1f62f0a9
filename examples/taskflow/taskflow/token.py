"""``python -m taskflow.token --user-id UUID [--email E] [--hours H]``: sign a Bearer token.

Uses ``TASKFLOW_JWT_SECRET``, ``TASKFLOW_JWT_ISSUER``, ``TASKFLOW_JWT_AUDIENCE`` and
``TASKFLOW_JWT_MAX_AGE_S`` like the server. For trying the API with curl::

    TOKEN=$(python -m taskflow.token --user-id 7b0c7f4e-0d1c-4a55-9a7c-1f0e2a0c0001)
    curl -H "Authorization: Bearer $TOKEN" http://127.0.0.1:8000/v1/tasks/...
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Sequence
from datetime import timedelta

from taskflow.auth import encode_token
from taskflow.clock import utc_now
from taskflow.settings import (
    DEFAULT_AUDIENCE,
    DEFAULT_ISSUER,
    DEFAULT_MAX_TOKEN_AGE_S,
    SettingsError,
    check_secret,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Print a token; return the exit status (2: no usable secret)."""
    parser = argparse.ArgumentParser(prog="python -m taskflow.token", description=__doc__)
    parser.add_argument("--user-id", type=uuid.UUID, default=None, help="default: a new UUID")
    parser.add_argument("--email", default=None, help="the e-mail claim (notification address)")
    parser.add_argument("--hours", type=float, default=12.0, help="validity (default 12)")
    args = parser.parse_args(argv)
    secret = os.environ.get("TASKFLOW_JWT_SECRET", "")
    try:
        check_secret(secret)
        max_age = int(
            os.environ.get("TASKFLOW_JWT_MAX_AGE_S", "").strip() or DEFAULT_MAX_TOKEN_AGE_S
        )
    except (SettingsError, ValueError) as exc:
        print(f"taskflow.token: {exc} (the same secret as the server's)", file=sys.stderr)
        return 2
    if not 0 < args.hours * 3600 <= max_age:
        print(
            f"taskflow.token: --hours must be above 0 and at most {max_age / 3600:g}",
            file=sys.stderr,
        )
        return 2
    user_id = args.user_id or uuid.uuid4()
    token = encode_token(
        user_id,
        secret,
        now=utc_now(),
        ttl=timedelta(hours=args.hours),
        email=args.email,
        issuer=os.environ.get("TASKFLOW_JWT_ISSUER", "").strip() or DEFAULT_ISSUER,
        audience=os.environ.get("TASKFLOW_JWT_AUDIENCE", "").strip() or DEFAULT_AUDIENCE,
    )
    print(token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
