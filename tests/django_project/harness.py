"""Run the test project's ``manage.py`` (or another project's: ``project=``) in a child process
against one test database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parent
SRC = PROJECT.parents[1] / "src"


def environment(dsn: str, **extra: str) -> dict[str, str]:
    """The child's environment: this sdcore and the project on the path, the database."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(PROJECT)])
    env["SDCORE_DJANGO_DSN"] = dsn
    env["DJANGO_SETTINGS_MODULE"] = "project.settings"
    env["SDCORE_DJANGO_LOG_STDERR"] = "1"
    env.pop("DATABASE_URL", None)
    env.update(extra)
    return env


def manage(
    dsn: str, *args: str, env: dict[str, str] | None = None, project: Path = PROJECT
) -> subprocess.CompletedProcess[str]:
    """``python manage.py ARGS`` to completion (60 s at most)."""
    return subprocess.run(
        [sys.executable, str(project / "manage.py"), *args],
        env=env or environment(dsn),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def start(
    dsn: str, *args: str, env: dict[str, str] | None = None, project: Path = PROJECT
) -> subprocess.Popen[Any]:
    """``python manage.py ARGS`` in the background (stderr and stdout to pipes)."""
    return subprocess.Popen(
        [sys.executable, str(project / "manage.py"), *args],
        env=env or environment(dsn),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(proc: subprocess.Popen[Any], timeout: float = 15) -> None:
    """SIGTERM a background ``manage.py`` and wait for it; kill it after ``timeout`` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
