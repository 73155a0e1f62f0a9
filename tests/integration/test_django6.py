"""The Django 6 tests (``django.tasks``) in a venv of Python 3.12, from the main suite.

Django 6 needs Python 3.12 or newer while the main venv may be 3.11 (with Django 5.2). This
test makes ``.venv-django6`` at the repository's root (Python 3.12 from ``PATH``, else pyenv's;
the ``django6-test`` extra; installed again when ``pyproject.toml`` changes) and runs
``tests/integration/test_django_tasks.py`` there with a pytest of its own. It runs among the
other tests, so it adds no step of its own to the suite. Without a Python 3.12 it is skipped,
and fails under ``CI=true`` (the CI machine has one).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-django6"
MODULE = "tests/integration/test_django_tasks.py"


def _runs(python: str) -> bool:
    try:
        done = subprocess.run(
            [python, "-c", "import sys; assert sys.version_info >= (3, 12)"],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def python_3_12() -> str | None:
    """A Python 3.12 or newer that runs: this one, ``python3.12`` on ``PATH`` (a pyenv shim may
    be there without its version selected), or the newest of pyenv's 3.12 versions."""
    if sys.version_info >= (3, 12):
        return sys.executable
    found = shutil.which("python3.12")
    if found is not None and _runs(found):
        return found
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(pyenv.glob("3.12*/bin/python3.12"), reverse=True):
        if _runs(str(candidate)):
            return str(candidate)
    return None


def _venv(python: str) -> Path:
    """``.venv-django6`` with sdcore and the ``django6-test`` extra, up to date."""
    stamp = VENV / ".sdcore-installed"
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest() + python
    VENV.parent.mkdir(exist_ok=True)
    with (ROOT / ".venv-django6.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one suite at a time makes or updates it
        if stamp.is_file() and stamp.read_text(encoding="utf-8") == wanted:
            return VENV / "bin" / "python"
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(VENV)], check=True, timeout=120)
        installed = subprocess.run(
            [str(VENV / "bin" / "pip"), "install", "-q", "-e", ".[django6-test]"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert installed.returncode == 0, installed.stdout + installed.stderr
        stamp.write_text(wanted, encoding="utf-8")
    return VENV / "bin" / "python"


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_django_6_tests_pass_in_a_python_3_12_venv() -> None:
    python = python_3_12()
    if python is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no Python 3.12 found (PATH, pyenv): the Django 6 tests need one")
        pytest.skip("no Python 3.12 found (PATH, pyenv): the Django 6 tests need one")
    venv_python = _venv(python)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        [str(venv_python), "-m", "pytest", MODULE, "-n", "0", "-p", "no:cacheprovider", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    output = done.stdout[-6000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    assert " passed" in done.stdout, output
    assert "django.tasks needs Django 6" not in done.stdout, output  # ran on Django 6
