"""Fixtures of the Node interop tests: Node's BullMQ installed outside the repo (the shared-Redis
``redis`` client and key ``prefix`` come from tests/conftest.py).

``npm install`` runs once per ``package.json``/``package-lock.json`` content into
``$SDCORE_INTEROP_CACHE`` (default ``~/.cache/sdcore-interop``)/<hash>/node_modules; the scripts
find it through ``NODE_PATH``. Without ``node``/``npm`` the tests fail when ``CI`` is set (a
missing service is a failure in CI) and are skipped on a developer machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
_MANIFESTS = ("package.json", "package-lock.json")


def _missing(what: str) -> None:
    message = f"{what}; the Node interop tests need Node.js 18+ and npm"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def node_env() -> dict[str, str]:
    """Environment for ``node interop.js …``: ``NODE_PATH`` points at the cached install."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        _missing("node or npm is not on PATH")
    assert node is not None
    assert npm is not None
    digest = hashlib.sha256(b"".join((HERE / name).read_bytes() for name in _MANIFESTS))
    cache = Path(os.environ.get("SDCORE_INTEROP_CACHE", Path.home() / ".cache/sdcore-interop"))
    target = cache / digest.hexdigest()[:16]
    if not (target / "node_modules" / "bullmq" / "package.json").exists():
        staging = cache / f"{target.name}.{uuid.uuid4().hex[:8]}.partial"
        staging.mkdir(parents=True)
        for name in _MANIFESTS:
            shutil.copy(HERE / name, staging / name)
        result = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=staging,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.fail(f"npm install failed:\n{result.stderr[-2000:]}", pytrace=False)
        try:
            staging.rename(target)  # atomic: concurrent sessions never see half an install
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # another session won the race
    return {**os.environ, "NODE_PATH": str(target / "node_modules")}
