"""A throw-away PostgreSQL for the demo when no database is configured (``sdcore[embedded]``).

The server is kept by a separate process (:mod:`sdcore.demo._server`) that removes it when this
process goes away, even by ``kill -9``; folders left by a keeper that was itself killed are
removed the next time the demo starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

from sdcore.demo._server import PASSWORD_ENV, READY_TIMEOUT_S, bin_path, folders
from sdcore.exceptions import SdcoreError

PREFIX = "sdcore-demo-"
# A Unix socket path holds at most 107 bytes (Linux; 103 on macOS): keep ours far below.
_MAX_SOCKET_PATH = 90
_SOCKET_SUFFIX = f"/{PREFIX}XXXXXXXX/run/.s.PGSQL.5432"
_STALE_AFTER_S = 120.0


class EmbeddedUnavailableError(SdcoreError, RuntimeError):
    """The ``embedded-postgres`` package is missing or its server did not start."""


def _others_may_enter(path: Path) -> bool:
    current = path.resolve()
    while True:
        try:
            if not current.stat().st_mode & 0o001:
                return False
        except OSError:
            return False
        if current.parent == current:
            return True
        current = current.parent


def base_folder() -> Path:
    """Where the demo's folder goes: the temporary directory if short (and, as root, enterable).

    Falls back to ``/tmp``: a socket path that does not fit would make embedded-postgres-style
    tools move the socket somewhere shared; this one never moves it.
    """
    candidate = Path(tempfile.gettempdir())
    fits = len(str(candidate)) + len(_SOCKET_SUFFIX) <= _MAX_SOCKET_PATH
    if fits and (os.geteuid() != 0 or _others_may_enter(candidate)):
        return candidate
    return Path("/tmp")  # noqa: S108 - sticky and short; the folder itself is mkdtemp's 0700


def _cmdline(pid: int) -> str | None:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except FileNotFoundError:
        return None
    except OSError:
        pass
    result = subprocess.run(  # noqa: S603 - fixed program, argument list
        ["ps", "-o", "command=", "-p", str(pid)],  # noqa: S607
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip() or None


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def remove_stale(bases: list[Path] | None = None) -> list[Path]:
    """Remove the demo folders (and their servers) whose keeper is gone; return what went.

    Only folders owned by this user and named ``sdcore-demo-*`` are considered; a folder whose
    keeper still runs is someone's live demo and is left alone.
    """
    removed: list[Path] = []
    chosen = bases if bases is not None else sorted({base_folder(), Path(tempfile.gettempdir())})
    for base in chosen:
        with contextlib.suppress(OSError):
            for root in base.glob(f"{PREFIX}*"):
                if _is_stale(root):
                    _kill_server(root)
                    shutil.rmtree(root, ignore_errors=True)
                    removed.append(root)
    return removed


def _is_stale(root: Path) -> bool:
    try:
        info = root.lstat()
    except OSError:
        return False
    if not root.is_dir() or root.is_symlink() or info.st_uid != os.geteuid():
        return False
    keeper = _pid_in(root / "keeper.pid")
    if keeper is None:
        return time.time() - info.st_mtime > _STALE_AFTER_S
    command = _cmdline(keeper)
    return command is None or "sdcore.demo._server" not in command


def _kill_server(root: Path) -> None:
    data, _ = folders(root)
    pid = _pid_in(data / "postmaster.pid")
    if pid is None:
        return
    command = _cmdline(pid)
    if command is None or str(data) not in command:
        return  # not our server (the pid was reused)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGQUIT)  # immediate shutdown; its children follow
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _cmdline(pid) is not None:
            time.sleep(0.05)
        if _cmdline(pid) is not None:
            os.kill(pid, signal.SIGKILL)


def _check_installed() -> None:
    if bin_path() is None:
        raise EmbeddedUnavailableError(
            "no database configured and the embedded PostgreSQL is not installed: set "
            "DATABASE_URL / --database-url, or pip install 'sdcore[embedded]'"
        )


@contextlib.contextmanager
def embedded_postgres(*, out: Callable[[str], None] | None = None) -> Iterator[str]:
    """Start a private PostgreSQL in a fresh folder; yield its URL; stop and delete it after.

    The URL carries a random password: pass it to other processes in their environment, never
    on their command line. The server listens on a Unix socket only, in a 0700 folder under a
    short temporary path; run as root, it runs as the OS user ``sdcore-demo``. A keeper process
    removes everything when this process exits, even by ``kill -9``.

    Args:
        out: Told the folder, once the server is up.

    Raises:
        EmbeddedUnavailableError: The extra is not installed or the server failed to start.
    """
    _check_installed()
    remove_stale()
    root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base_folder()))
    password = secrets.token_urlsafe(24)
    keeper = subprocess.Popen(  # noqa: S603 - our own module, argument list
        [sys.executable, "-m", "sdcore.demo._server", str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, PASSWORD_ENV: password},
        start_new_session=True,
    )
    try:
        ready = _read_ready(keeper)
        _, run = folders(root)
        if out is not None:
            out(f"embedded PostgreSQL in {root} (Unix socket only, password auth)")
        host = quote(str(ready.get("host", run)), safe="/")
        yield f"postgresql://postgres:{password}@/postgres?host={host}&port={ready.get('port')}"
    finally:
        _close(keeper, root)


def _read_ready(keeper: subprocess.Popen[bytes]) -> dict[str, object]:
    assert keeper.stdout is not None  # noqa: S101
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.append(keeper.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(READY_TIMEOUT_S + 90)  # initdb, then the server's own start-up deadline
    try:
        message = json.loads(lines[0]) if lines and lines[0] else {}
    except ValueError:
        message = {}
    if not isinstance(message, dict) or not message.get("ready"):
        detail = message.get("error") if isinstance(message, dict) else None
        raise EmbeddedUnavailableError(
            f"the embedded PostgreSQL did not start: {detail or 'no answer from its keeper'}"
        )
    return message


def _close(keeper: subprocess.Popen[bytes], root: Path) -> None:
    with contextlib.suppress(OSError):
        if keeper.stdin is not None:
            keeper.stdin.close()  # the keeper's signal to stop the server and delete the folder
    try:
        keeper.wait(30)
    except subprocess.TimeoutExpired:
        keeper.kill()
        keeper.wait()
    if keeper.stdout is not None:
        keeper.stdout.close()
    if root.exists():
        _kill_server(root)
        shutil.rmtree(root, ignore_errors=True)
