"""``python -m taskflow.token --user-id UUID [--email E] [--hours H]``: sign a Bearer token.

Uses ``TASKFLOW_JWT_SECRET`` like the server. For trying the API with curl::

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
from taskflow.settings import MIN_SECRET_BYTES


def main(argv: Sequence[str] | None = None) -> int:
    """Print a token; return the exit status (2: no usable secret)."""
    parser = argparse.ArgumentParser(prog="python -m taskflow.token", description=__doc__)
    parser.add_argument("--user-id", type=uuid.UUID, default=None, help="default: a new UUID")
    parser.add_argument("--email", default=None, help="the e-mail claim (notification address)")
    parser.add_argument("--hours", type=float, default=12.0, help="validity (default 12)")
    args = parser.parse_args(argv)
    secret = os.environ.get("TASKFLOW_JWT_SECRET", "")
    if len(secret.encode()) < MIN_SECRET_BYTES:
        print(
            f"taskflow.token: set TASKFLOW_JWT_SECRET (at least {MIN_SECRET_BYTES} bytes), "
            "the same as the server's",
            file=sys.stderr,
        )
        return 2
    user_id = args.user_id or uuid.uuid4()
    token = encode_token(
        user_id, secret, now=utc_now(), ttl=timedelta(hours=args.hours), email=args.email
    )
    print(token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
