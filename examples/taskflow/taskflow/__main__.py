"""``python -m taskflow [--host H] [--port P]``: one TaskFlow replica under uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from taskflow.settings import Settings, SettingsError

LOG_FORMAT = "%(asctime)s %(levelname)-7s [{replica}] %(name)s: %(message)s"


def check_database(url: str, timeout_s: int = 5) -> str | None:
    """Connect once; return a one-line reason (password masked) if the database is unusable."""
    from urllib.parse import urlsplit

    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=timeout_s, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        password = urlsplit(url).password
        if password:
            reason = reason.replace(password, "***")
        return f"cannot connect to the database: {reason}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; return the exit status (2: bad settings, 1: no DB)."""
    parser = argparse.ArgumentParser(prog="python -m taskflow", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"taskflow: {exc}", file=sys.stderr)
        return 2

    # Checked before uvicorn starts: its lifespan would print a 170-line traceback instead.
    problem = check_database(settings.libpq_url)
    if problem is not None:
        print(f"taskflow: {problem}", file=sys.stderr)
        return 1

    # Imported after the settings check, so a misconfiguration fails fast and clearly.
    import uvicorn

    from taskflow.app import create_app

    logging.basicConfig(
        level=args.log_level.upper(),
        format=LOG_FORMAT.format(replica=settings.replica_name),
        stream=sys.stderr,
    )
    # log_config=None: uvicorn's own loggers go through the format above.
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_config=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
