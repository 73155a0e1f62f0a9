"""The README's main command: ``sdcore demo``, and a verdict that can say FAIL.

Real runs: a takeover with fencing token 2, nothing printed after the verdict, a partial verdict
on Ctrl-C, no password on any command line, and an embedded PostgreSQL that is private and
leaves nothing behind, not even after ``kill -9``.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sdcore.demo import compute_verdict
from sdcore.demo._embedded import PREFIX, remove_stale
from sdcore.demo._server import SERVER_USER
from sdcore.demo._verdict import JOBS_TABLE, LEDGER_TABLE, prepare, report

PASSWORD = "S3cretDemoPw0rd"
TMP = Path("/tmp")  # noqa: S108 - where the demo must put its folder when TMPDIR is too long
TICK = re.compile(r"tick (\S+)\s+ran on")
# Its verdict counts every per-second tick: a busy neighbour once made one miss.
pytestmark = pytest.mark.alone


def _env_without_database() -> dict[str, str]:
    drop = ("DATABASE_URL", "PGHOST", "PGDATABASE", "PGPORT", "PGUSER", "PGPASSWORD")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _with_password(dsn: str) -> str:
    # The shared test server trusts local TCP, so the password is sent nowhere, but it is in
    # the URL the demo gets: exactly what must not reach a command line.
    params = conninfo_to_dict(dsn)
    params["password"] = PASSWORD
    return make_conninfo(**params)  # type: ignore[arg-type]


def _cmdlines() -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            found[int(entry.name)] = raw.replace(b"\0", b" ").decode(errors="replace")
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class _Demo:
    """``sdcore demo`` as a child process, its output collected line by line."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str],
        new_session: bool = False,
        sigint: signal.Handlers = signal.SIG_DFL,
    ) -> None:
        # The demo's SIGINT disposition is set here, never inherited from whatever started pytest
        # (`nohup pytest &` hands it over ignored).
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sdcore.cli", "demo", *args],
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=new_session,
            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
        )
        self.lines: list[str] = []
        self.err = ""
        # Both pipes are read while the demo runs: a pipe nobody reads fills up (64 KiB) and
        # blocks the demo on its next write, so it never exits.
        self._errors: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def _read_err(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._errors.append(line)

    def wait_for(self, predicate: str | re.Pattern[str], timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if (predicate in line) if isinstance(predicate, str) else predicate.search(line):
                    return line
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {predicate!r} in:\n" + self.text)

    def finish(self, timeout: float = 120) -> int:
        hung = False
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            hung = True
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self._reader.join(10)
        self._err_reader.join(10)
        assert self.process.stdout is not None
        assert self.process.stderr is not None
        self.process.stdout.close()
        self.err = "".join(self._errors)
        self.process.stderr.close()
        if hung:  # the pipes are closed first: a failure here leaks nothing into later tests
            raise AssertionError(
                f"the demo did not exit within {timeout} s (killed); its output:\n{self.text}"
                f"\nstderr (last 4000 characters):\n{self.err[-4000:]}"
            )
        return self.process.returncode

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def stderr(self) -> str:
        return self.err


def _embedded_root(demo: _Demo) -> Path:
    line = demo.wait_for("database: embedded PostgreSQL in /")
    return Path(line.split("embedded PostgreSQL in ", 1)[1].split(" ", 1)[0])


def _verdict_section(text: str) -> tuple[list[str], list[str]]:
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "verdict over" in line)
    return lines[:at], lines[at:]


def _check_window(text: str) -> None:
    """Every printed tick is inside the judged window, and none comes after the verdict."""
    before, after = _verdict_section(text)
    header = after[0]
    match = re.search(r"over (\d\d:\d\d:\d\d)–(\d\d:\d\d:\d\d) UTC", header)
    assert match, header
    first, end = match.groups()
    keys = [m.group(1) for line in before if (m := TICK.search(line))]
    assert keys, text
    assert all(first <= key[11:19] <= end for key in keys), (first, end, keys)
    assert not [line for line in after if TICK.search(line)], after


def _demo_processes() -> set[int]:
    # Only this venv's: other checkouts on the machine may run their own demos meanwhile.
    venv = str(Path(sys.executable).parent)
    return {pid for pid, line in _cmdlines().items() if "sdcore.demo." in line and venv in line}


@pytest.fixture
def leftovers() -> Iterator[None]:
    """Fail if a keeper or a replica started by this test outlives it."""
    before = _demo_processes()
    yield
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = _demo_processes() - before
        if not [pid for pid in now if _alive(pid)]:
            return
        time.sleep(0.2)
    raise AssertionError(f"demo processes left: {now}")


@pytest.mark.slow
@pytest.mark.usefixtures("leftovers")
def test_demo_shows_a_takeover_with_fencing_token_2_and_keeps_the_password_off_argv(
    pg_dsn: str,
) -> None:
    dsn = _with_password(pg_dsn)
    demo = _Demo("--duration", "10", "--replicas", "3", env={**os.environ, "DATABASE_URL": dsn})
    seen_replicas: set[int] = set()
    leaked: list[str] = []
    while demo.process.poll() is None:
        for pid, line in _cmdlines().items():
            if "sdcore.demo._replica" in line:
                seen_replicas.add(pid)
            if PASSWORD in line:
                leaked.append(line)
        time.sleep(0.2)
    status = demo.finish()
    text = demo.text
    assert status == 0, text + demo.stderr
    assert len(seen_replicas) >= 4, seen_replicas  # 3, and the restarted one
    assert leaked == []
    assert PASSWORD not in text
    assert "killed replica" in text
    assert "in the middle of tick" in text
    assert "restarted replica" in text
    assert "doubled=0 missed=0" in text
    _, verdict = _verdict_section(text)
    takeover = [line for line in verdict if "takeover: tick" in line]
    assert len(takeover) == 1, text
    # The taker's token is above the dead owner's (tokens come from the table's sequence).
    tokens = [int(t) for t in re.findall(r"fencing_token=(\d+)", takeover[0])]
    assert len(tokens) == 2, takeover[0]
    assert tokens[1] > tokens[0], takeover[0]
    assert verdict[-1] == "  PASS: every tick ran exactly once.", text
    _check_window(text)


@pytest.mark.slow
@pytest.mark.usefixtures("leftovers")
@pytest.mark.parametrize(
    "sigint",
    [
        pytest.param(signal.SIG_DFL, id="sigint-default"),
        pytest.param(signal.SIG_IGN, id="sigint-ignored-by-the-parent"),
    ],
)
def test_ctrl_c_gives_a_partial_verdict(pg_dsn: str, sigint: signal.Handlers) -> None:
    """Ctrl-C works whatever SIGINT disposition the demo inherits (``nohup … &`` ignores it)."""
    demo = _Demo(
        "--duration",
        "60",
        "--replicas",
        "2",
        "--no-kill",
        env={**os.environ, "DATABASE_URL": pg_dsn},
        new_session=True,
        sigint=sigint,
    )
    demo.wait_for("all replicas ready")
    deadline = time.monotonic() + 30
    while len([line for line in demo.lines if TICK.search(line)]) < 3:
        assert time.monotonic() < deadline, demo.text
        time.sleep(0.1)
    os.killpg(demo.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    status = demo.finish(60)
    text = demo.text
    assert status == 130, text
    assert "partial verdict (interrupted) over" in text
    assert "doubled=0 missed=0" in text
    assert text.splitlines()[-1].startswith("  PARTIAL: every finished tick so far ran exactly")
    assert "interrupted" in demo.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("leftovers")
def test_embedded_postgres_is_private_and_removed(tmp_path: Path) -> None:
    # A TMPDIR too long for a socket path, and a private XDG_RUNTIME_DIR, which embedded-postgres
    # left to itself would open to everyone (0777 socket, trust auth).
    long_tmp = tmp_path / ("t" * 60) / ("m" * 60)
    long_tmp.mkdir(parents=True, mode=0o700)
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    venv = Path(sys.executable).parent
    watched = [long_tmp, runtime, TMP, *list(venv.parents)[:4]]
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in watched}
    env = {**_env_without_database(), "TMPDIR": str(long_tmp), "XDG_RUNTIME_DIR": str(runtime)}
    demo = _Demo("--duration", "10", "--replicas", "2", env=env)
    root = _embedded_root(demo)
    demo.wait_for("all replicas ready")
    assert root.parent == TMP, root  # the long TMPDIR would not fit a socket path
    run = root / "run"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE((run / ".s.PGSQL.5432").stat().st_mode) == 0o700
    assert stat.S_IMODE(root.stat().st_mode) & 0o007 == 0
    hba = (root / "data" / "pg_hba.conf").read_text()
    rules = [line.split() for line in hba.splitlines() if line.strip() and line[0] != "#"]
    assert rules
    assert all(rule[-1] in ("scram-sha-256", "reject") for rule in rules), rules
    postmaster = int((root / "data" / "postmaster.pid").read_text().split()[0])
    status_lines = Path(f"/proc/{postmaster}/status").read_text().splitlines()
    ids = {line.split(":")[0]: line.split(":")[1].split() for line in status_lines if ":" in line}
    if os.geteuid() == 0:
        import pwd

        user = pwd.getpwnam(SERVER_USER)
        assert ids["Uid"][0] == str(user.pw_uid)
        assert ids["Gid"][0] == str(user.pw_gid) != "0"
        assert ids["Groups"] == []
    assert list(runtime.iterdir()) == []
    status = demo.finish()
    text = demo.text
    assert status == 0, text + demo.stderr
    assert "PASS: every tick ran exactly once." in text
    assert "took it over with fencing_token=" in text
    assert not root.exists()
    assert not _alive(postmaster)
    assert {path: stat.S_IMODE(path.stat().st_mode) for path in watched} == modes


@pytest.mark.slow
@pytest.mark.usefixtures("leftovers")
def test_kill_9_of_the_demo_leaves_nothing_behind() -> None:
    demo = _Demo("--duration", "120", "--replicas", "2", env=_env_without_database())
    root = _embedded_root(demo)
    demo.wait_for("all replicas ready")
    postmaster = int((root / "data" / "postmaster.pid").read_text().split()[0])
    keeper = int((root / "keeper.pid").read_text())
    replicas = [pid for pid in _demo_processes() if "_replica" in _cmdlines().get(pid, "")]
    assert replicas
    demo.process.kill()  # SIGKILL: no finally, no atexit
    demo.finish()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not root.exists() and not any(map(_alive, [postmaster, keeper, *replicas])):
            break
        time.sleep(0.2)
    assert not root.exists()
    assert [pid for pid in [postmaster, keeper, *replicas] if _alive(pid)] == []


@pytest.mark.slow
@pytest.mark.usefixtures("leftovers")
def test_a_server_whose_keeper_was_killed_is_removed_at_the_next_start() -> None:
    demo = _Demo("--duration", "120", "--replicas", "2", env=_env_without_database())
    root = _embedded_root(demo)
    demo.wait_for("all replicas ready")
    postmaster = int((root / "data" / "postmaster.pid").read_text().split()[0])
    os.kill(int((root / "keeper.pid").read_text()), signal.SIGKILL)
    demo.process.kill()
    demo.finish()
    time.sleep(0.5)
    assert root.exists()
    assert _alive(postmaster)
    removed = remove_stale([root.parent])
    assert root in removed
    assert not root.exists()
    deadline = time.monotonic() + 15
    while _alive(postmaster) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(postmaster)


def test_stale_cleanup_leaves_new_and_foreign_folders_alone(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}dead"
    dead.mkdir()
    (dead / "keeper.pid").write_text(str(os.getpid()))  # a live pid, but not a keeper: stale
    fresh = tmp_path / f"{PREFIX}fresh"
    fresh.mkdir()  # no keeper.pid yet: a demo being set up right now
    other = tmp_path / "something-else"
    other.mkdir()
    assert remove_stale([tmp_path]) == [dead]
    assert fresh.exists()
    assert other.exists()


def test_verdict_detects_doubles_and_misses(pg_dsn: str) -> None:
    prepare(pg_dsn)
    start = datetime(2026, 7, 20, 3, 0, 0, 500_000, tzinfo=UTC)
    keys = [
        (start.replace(microsecond=0) + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ")
        for s in range(1, 5)
    ]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for key, replicas in zip(keys, [[1], [1, 2], [], [3]], strict=True):
            for replica in replicas:
                conn.execute(
                    f"INSERT INTO {LEDGER_TABLE} (run_key, replica, pid, fencing_token)"
                    " VALUES (%s, %s, 1, 1)",
                    (key, replica),
                )
    verdict = compute_verdict(pg_dsn, start, start + timedelta(seconds=4.5))
    assert verdict.expected == 4
    assert verdict.doubled == [keys[1]]
    assert verdict.missed == [keys[2]]
    assert verdict.ran_once == 2
    assert not verdict.ok


def test_verdict_says_why_a_missed_tick_was_skipped(pg_dsn: str) -> None:
    # A replica that skips a second on purpose (overlap) leaves a FAIL row saying so: the
    # verdict still counts the second missed (nobody ran it), and names the reason.
    prepare(pg_dsn)
    start = datetime(2026, 7, 20, 3, 0, 0, 500_000, tzinfo=UTC)
    ran, skipped = "2026-07-20T03:00:01Z", "2026-07-20T03:00:02Z"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {LEDGER_TABLE} (run_key, replica, pid, fencing_token)"
            " VALUES (%s, 1, 1, 1)",
            (ran,),
        )
        conn.execute(
            f"INSERT INTO {JOBS_TABLE} (lock_key, idempotency_key, code, type, run_key, status,"
            " owner_token, fencing_token, data, attempts) VALUES (%s, %s, 'demo-tick', 'SCHEDULE',"
            " %s, 'FAIL', gen_random_uuid(), 2, '{\"skipped\": \"overlap\"}', 0)",
            (f"demo-tick:{skipped}", f"k-{skipped}", skipped),
        )
    verdict = compute_verdict(pg_dsn, start, start + timedelta(seconds=2.5))
    assert verdict.missed == [skipped]
    assert verdict.skipped == {skipped: "overlap"}
    assert not verdict.ok
    lines: list[str] = []
    report(verdict, lines.append)
    assert f"  missed: {skipped} (recorded as skipped: overlap)" in lines
    assert lines[-1] == "  FAIL: see above."


def test_verdict_names_a_takeover(pg_dsn: str) -> None:
    prepare(pg_dsn)
    start = datetime(2026, 7, 20, 3, 0, 0, 500_000, tzinfo=UTC)
    key = "2026-07-20T03:00:01Z"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        runs = [(1, 11, 1, "started"), (2, 22, 2, "started"), (2, 22, 2, "done")]
        for replica, pid, token, phase in runs:
            conn.execute(
                f"INSERT INTO {LEDGER_TABLE} (run_key, replica, pid, fencing_token, phase)"
                " VALUES (%s, %s, %s, %s, %s)",
                (key, replica, pid, token, phase),
            )
    verdict = compute_verdict(pg_dsn, start, start + timedelta(seconds=1))
    assert verdict.ok
    [takeover] = verdict.takeovers
    assert takeover.started_by == [(1, 11, 1)]
    assert takeover.finished_by == (2, 22)
    assert takeover.fencing_token == 2
