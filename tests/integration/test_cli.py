"""The ``sdcore`` command line against a real PostgreSQL.

The tests are plain (sync) functions: ``main()`` runs ``asyncio.run`` for ``db upgrade``, which
cannot run inside a running loop. Rows are set up with the real service (its own ``asyncio.run``)
and aged with a direct ``UPDATE … modified_at``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import psycopg
import pytest

from sdcore.cli import main
from sdcore.cli._parser import parse_duration
from sdcore.job_scheduler import JobAcquired, JobExecutionLease, JobSchedulerService
from sdcore.postgres import migrations, schema_sql

SQL_INJECTION = "'; DROP TABLE job_scheduler;--"
SECRET = "s3cretpw"


@dataclass(frozen=True, slots=True)
class Outcome:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()


@dataclass(frozen=True, slots=True)
class Run:
    code: str
    run_key: str | None = "2026-07-20T03:00:00Z"
    status: str = "SUCCESS"
    name: str | None = None

    @property
    def options(self) -> dict[str, Any]:
        kind = "INITIAL" if self.run_key is None else "SCHEDULE"
        return {"code": self.code, "type": kind, "run_key": self.run_key, "name": self.name}


class Cli(Protocol):
    """Runs ``main(argv)`` in-process."""

    def __call__(self, *argv: str) -> Outcome: ...


@pytest.fixture
def dsn(pg_dsn: str) -> str:
    """A fresh database with the job scheduler table."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(schema_sql().encode())
    return pg_dsn


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """Call ``main(argv)`` in-process and capture its exit status, stdout and stderr."""

    def call(*argv: str) -> Outcome:
        capsys.readouterr()
        code = main(list(argv))
        captured = capsys.readouterr()
        return Outcome(code, captured.out, captured.err)

    return call


def seed(dsn: str, *runs: Run) -> list[JobAcquired]:
    """Acquire each run through the service and finalize it as its ``status`` says."""

    async def go() -> list[JobAcquired]:
        results = []
        async with JobSchedulerService.connect(dsn) as jobs:
            for run in runs:
                result = await jobs.acquire(run.options)
                assert result.acquired
                if run.status == "SUCCESS":
                    assert await jobs.complete(result.lease, {"ok": True})
                elif run.status == "FAIL":
                    assert await jobs.fail(result.lease, {"error": "boom"})
                results.append(result)
        return results

    return asyncio.run(go())


def age(dsn: str, results: list[JobAcquired], by: timedelta) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            # A row last changed `by` ago was also created at least that long ago.
            "UPDATE job_scheduler SET modified_at = clock_timestamp() - %s,"
            " created_at = least(created_at, clock_timestamp() - %s) WHERE id = ANY(%s)",
            (by, by, [r.id for r in results]),
        )


def rows(dsn: str) -> dict[str, str]:
    """Map id -> status of every row (also proves the table still exists)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute("SELECT id::text, status FROM job_scheduler").fetchall())


def ids_in(outcome: Outcome) -> list[str]:
    return [line.split()[0] for line in outcome.lines[1:] if not line.startswith("(")]


# --- db sql / db upgrade -----------------------------------------------------------------------


def test_db_sql_prints_ddl_without_a_database(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    result = cli("db", "sql")
    assert result.code == 0
    assert 'CREATE TABLE IF NOT EXISTS "job_scheduler"' in result.out
    assert result.out.strip() == schema_sql().strip()

    result = cli("--schema", "ops", "db", "sql", "--table", "leases")
    assert result.code == 0
    assert 'CREATE SCHEMA IF NOT EXISTS "ops"' in result.out
    assert 'CREATE TABLE IF NOT EXISTS "ops"."leases"' in result.out


@pytest.mark.parametrize(
    "option",
    [("--table", "x" * 64), ("--table", "a\x00b"), ("--schema", "")],
    ids=["too-long", "nul", "empty-schema"],
)
def test_bad_identifiers_are_usage_errors(cli: Cli, option: tuple[str, str]) -> None:
    result = cli(*option, "db", "sql")
    assert result.code == 2
    assert result.out == ""
    assert result.err.startswith("sdcore: error: argument")


def test_db_upgrade_creates_the_table_then_is_idempotent(cli: Cli, pg_dsn: str) -> None:
    first = cli("--database-url", pg_dsn, "db", "upgrade")
    assert first.code == 0, first.err
    assert first.lines[0].startswith('created table "job_scheduler" with ')
    assert first.lines[1:] == [
        f'applied lease migration {m.name} to "job_scheduler"' for m in migrations("lease")
    ]

    second = cli("--database-url", pg_dsn, "db", "upgrade")
    assert second.code == 0, second.err
    assert "nothing to do" in second.out
    assert rows(pg_dsn) == {}


def test_db_upgrade_in_a_schema_then_list(cli: Cli, pg_dsn: str) -> None:
    names = ["--database-url", pg_dsn, "--schema", "ops", "--table", "leases"]
    result = cli(*names, "db", "upgrade")
    assert result.code == 0, result.err
    assert result.lines[0] == 'created schema "ops"'
    assert result.lines[1].startswith('created table "ops"."leases" with ')
    assert result.lines[2:] == [
        f'applied lease migration {m.name} to "ops"."leases"' for m in migrations("lease")
    ]
    listed = cli(*names, "jobs", "list")
    assert (listed.code, listed.out) == (0, "no jobs found\n")


def test_db_upgrade_races_safely_across_processes(pg_dsn: str) -> None:
    command = [sys.executable, "-m", "sdcore.cli", "--database-url", pg_dsn, "db", "upgrade"]
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    procs = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(4)
    ]
    outputs = [proc.communicate(timeout=60) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0, 0], outputs
    reports = sorted(out for out, _ in outputs)
    assert reports[0].startswith("created table")
    assert all("nothing to do" in out for out in reports[1:])


def test_console_script_runs(dsn: str) -> None:
    script = Path(sys.executable).parent / "sdcore"
    env = {**os.environ, "DATABASE_URL": dsn}
    done = subprocess.run(
        [str(script), "jobs", "list"], capture_output=True, text=True, env=env, timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "no jobs found\n", "")


# --- jobs list ---------------------------------------------------------------------------------


def test_list_without_the_table_hints_at_upgrade(cli: Cli, pg_dsn: str) -> None:
    result = cli("--database-url", pg_dsn, "jobs", "list")
    assert result.code == 1
    assert result.err == (
        'sdcore: error: table "job_scheduler" does not exist; run `sdcore db upgrade`\n'
    )
    custom = cli("--database-url", pg_dsn, "--table", "t1", "--schema", "s1", "jobs", "list")
    assert custom.code == 1
    assert "run `sdcore --table t1 --schema s1 db upgrade`" in custom.err


def test_list_is_newest_first_and_filters_by_exact_code_and_status(cli: Cli, dsn: str) -> None:
    a, b, c, d = seed(
        dsn,
        Run("alpha", status="SUCCESS"),
        Run("beta", status="RUNNING", name="Beta job"),
        Run("alpha", run_key="2026-07-21T03:00:00Z", status="FAIL"),
        Run("alpha%", status="SUCCESS"),
    )
    base = ("--database-url", dsn, "jobs", "list")

    listed = cli(*base)
    assert listed.code == 0, listed.err
    assert listed.lines[0].split() == [
        "id", "code", "type", "run_key", "status", "fencing_token", "modified_at", "age", "name",
    ]  # fmt: skip
    assert ids_in(listed) == [d.id, c.id, b.id, a.id]
    beta = listed.lines[3].split()
    token = str(b.fencing_token)  # from the table's sequence: not 1 for the second row
    assert beta[1:6] == ["beta", "SCHEDULE", "2026-07-20T03:00:00Z", "RUNNING", token]
    assert beta[6].endswith("Z")
    assert beta[7].endswith("s")
    assert beta[8:] == ["Beta", "job"]

    assert ids_in(cli(*base, "--code", "alpha")) == [c.id, a.id]
    assert ids_in(cli(*base, "--code", "  alpha  ")) == [c.id, a.id]  # trimmed like the core
    assert ids_in(cli(*base, "--code", "alpha%")) == [d.id]  # equality, not LIKE
    assert cli(*base, "--code", "alp%").out == "no jobs found\n"
    assert ids_in(cli(*base, "--status", "fail")) == [c.id]
    assert ids_in(cli(*base, "--code", "alpha", "--status", "SUCCESS")) == [a.id]

    limited = cli(*base, "--limit", "2")
    assert ids_in(limited) == [d.id, c.id]
    assert limited.lines[-1].startswith("(limit 2 reached")


def test_list_json_has_full_values_and_never_the_owner_token(cli: Cli, dsn: str) -> None:
    long_name = "N" * 256
    (done, running) = seed(
        dsn,
        Run("report", status="SUCCESS", name=long_name),
        Run("report", run_key="k2", status="RUNNING"),
    )
    table = cli("--database-url", dsn, "jobs", "list")
    assert long_name not in table.out
    assert "NNN…" in table.out

    result = cli("--database-url", dsn, "jobs", "list", "--json")
    assert result.code == 0, result.err
    objects = [json.loads(line) for line in result.lines]
    assert [o["id"] for o in objects] == [running.id, done.id]
    assert objects[1]["name"] == long_name
    assert objects[1]["data"] == {"ok": True}
    assert objects[1]["idempotency_key"] == done.idempotency_key
    assert objects[0]["status"] == "RUNNING"
    assert objects[0]["fencing_token"] == running.fencing_token
    assert objects[0]["created_at"].endswith("Z")
    assert objects[0]["age_seconds"] >= 0
    assert all("owner_token" not in o for o in objects)
    for output in (table.out, result.out):
        assert done.owner_token not in output
        assert running.owner_token not in output


def test_list_escapes_hostile_strings(cli: Cli, dsn: str) -> None:
    hostile_code = "e\n\x1b[31m\u202ex"
    hostile_name = "a\r\nb\x07\u2028\\n"
    (evil, injected) = seed(
        dsn,
        Run(hostile_code, run_key=SQL_INJECTION, name=hostile_name),
        Run(SQL_INJECTION, run_key="k"),
    )
    table = cli("--database-url", dsn, "jobs", "list")
    assert table.code == 0, table.err
    assert len(table.lines) == 3  # header + 2 rows: no forged lines
    for raw in ("\x1b", "\u202e", "\r", "\x07", "\u2028"):
        assert raw not in table.out
    assert "e\\n\\x1b[31m\\u202ex" in table.out
    assert "a\\r\\nb\\x07\\u2028\\\\n" in table.out

    as_json = cli("--database-url", dsn, "jobs", "list", "--json")
    assert as_json.out.isascii()
    assert len(as_json.lines) == 2
    assert json.loads(as_json.lines[1])["code"] == hostile_code
    assert json.loads(as_json.lines[1])["run_key"] == SQL_INJECTION

    by_code = cli("--database-url", dsn, "jobs", "list", "--code", SQL_INJECTION)
    assert ids_in(by_code) == [injected.id]
    assert set(rows(dsn)) == {evil.id, injected.id}  # the table is intact


@pytest.mark.parametrize(
    "argv",
    [("--limit", "0"), ("--limit", "10001"), ("--limit", "x"), ("--status", "DONE")],
    ids=["limit-0", "limit-too-big", "limit-nan", "bad-status"],
)
def test_list_rejects_bad_options(cli: Cli, argv: tuple[str, str]) -> None:
    result = cli("--database-url", "postgresql://unused", "jobs", "list", *argv)
    assert result.code == 2
    assert result.err.startswith("sdcore: error: argument")


# --- jobs release ------------------------------------------------------------------------------


def test_release_fences_out_the_owner_and_frees_the_run(cli: Cli, dsn: str) -> None:
    (owner,) = seed(dsn, Run("stuck", status="RUNNING"))
    result = cli("--database-url", dsn, "jobs", "release", owner.id, "--reason", "deploy hung")
    assert result.code == 0, result.err
    assert result.out.startswith(f"released job {owner.id} (code stuck")

    listed = json.loads(cli("--database-url", dsn, "jobs", "list", "--json").out)
    assert listed["status"] == "FAIL"
    assert listed["data"] == {"released_by": "operator", "reason": "deploy hung"}

    async def afterwards(lease: JobExecutionLease) -> tuple[bool, bool, Any]:
        async with JobSchedulerService.connect(dsn) as jobs:
            beat = await jobs.heartbeat(lease)
            finished = await jobs.complete(lease)
            return beat, finished, await jobs.acquire(Run("stuck").options)

    beat, finished, again = asyncio.run(afterwards(owner.lease))
    assert (beat, finished) == (False, False)
    assert again.acquired
    assert again.id == owner.id
    assert again.fencing_token == 2


def test_release_refuses_a_finished_run(cli: Cli, dsn: str) -> None:
    (done,) = seed(dsn, Run("finished", status="SUCCESS"))
    result = cli("--database-url", dsn, "jobs", "release", done.id.upper())
    assert result.code == 1
    assert result.err == (
        f"sdcore: error: job {done.id} is not RUNNING (status SUCCESS); nothing released\n"
    )
    assert rows(dsn) == {done.id: "SUCCESS"}


def test_release_of_an_unknown_job(cli: Cli, dsn: str) -> None:
    result = cli("--database-url", dsn, "jobs", "release", "00000000-0000-4000-8000-000000000000")
    assert result.code == 1
    assert "no such job 00000000-0000-4000-8000-000000000000" in result.err


@pytest.mark.parametrize(
    "job_id",
    [
        "nope",
        "",
        "1234",
        SQL_INJECTION,
        "{00000000-0000-4000-8000-000000000000}",
        "0000000000004000800000000000000_",
    ],
    ids=["word", "empty", "short", "sql", "braces", "underscore"],
)
def test_release_rejects_a_bad_id_before_connecting(cli: Cli, job_id: str) -> None:
    result = cli(
        "--database-url", f"postgresql://u:{SECRET}@127.0.0.1:1/x", "jobs", "release", "--", job_id
    )
    assert result.code == 2
    assert "invalid job id" in result.err
    assert SECRET not in result.err


# --- jobs prune --------------------------------------------------------------------------------


def test_prune_deletes_only_old_finished_rows(cli: Cli, dsn: str) -> None:
    old_ok, old_fail, new_ok, stale_running, initial = seed(
        dsn,
        Run("a", status="SUCCESS"),
        Run("b", status="FAIL"),
        Run("c", status="SUCCESS"),
        Run("d", status="RUNNING"),
        Run("boot", run_key=None, status="SUCCESS"),
    )
    age(dsn, [old_ok, old_fail, stale_running, initial], timedelta(days=40))
    age(dsn, [new_ok], timedelta(days=29))

    dry = cli("--database-url", dsn, "jobs", "prune", "--older-than", "30d", "--dry-run")
    assert dry.code == 0, dry.err
    assert dry.lines[0].startswith("dry run: would delete 2 rows (SUCCESS/FAIL rows modified")
    assert dry.lines[1].startswith("kept 1 INITIAL row:")
    assert len(rows(dsn)) == 5

    pruned = cli("--database-url", dsn, "jobs", "prune", "--older-than", "30d")
    assert pruned.code == 0, pruned.err
    assert pruned.lines[0].startswith("deleted 2 rows")
    assert set(rows(dsn)) == {new_ok.id, stale_running.id, initial.id}

    with_initial = cli(
        "--database-url", dsn, "jobs", "prune", "--older-than", "30d", "--include-initial"
    )
    assert with_initial.lines == [with_initial.lines[0]]
    assert "deleted 1 row " in with_initial.out
    assert rows(dsn) == {new_ok.id: "SUCCESS", stale_running.id: "RUNNING"}


def test_prune_skips_a_row_an_acquire_is_taking_over(cli: Cli, dsn: str) -> None:
    (failed,) = seed(dsn, Run("retry", status="FAIL"))
    age(dsn, [failed], timedelta(days=40))
    with psycopg.connect(dsn) as contender:
        # What acquire's ON CONFLICT DO UPDATE does to a FAIL row, left uncommitted.
        contender.execute(
            "UPDATE job_scheduler SET status = 'RUNNING', modified_at = clock_timestamp(),"
            " fencing_token = fencing_token + 1 WHERE id = %s",
            (failed.id,),
        )
        result = cli("--database-url", dsn, "jobs", "prune", "--older-than", "30d")
        assert result.code == 0, result.err
        assert result.lines[0].startswith("deleted 0 rows")
        contender.commit()
    assert rows(dsn) == {failed.id: "RUNNING"}


def test_prune_by_status_in_small_batches(cli: Cli, dsn: str) -> None:
    finished = seed(dsn, *(Run(f"job{i}", status=("SUCCESS", "FAIL")[i % 2]) for i in range(7)))
    age(dsn, finished, timedelta(hours=2))
    argv = ("--database-url", dsn, "jobs", "prune", "--older-than", "1h30m", "--batch-size", "2")
    result = cli(*argv, "--status", "success")
    assert result.code == 0, result.err
    assert result.lines[0].startswith("deleted 4 rows (SUCCESS rows")
    assert sorted(rows(dsn).values()) == ["FAIL"] * 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30d", timedelta(days=30)),
        ("12h", timedelta(hours=12)),
        ("90m", timedelta(minutes=90)),
        ("45s", timedelta(seconds=45)),
        ("1d12h", timedelta(days=1, hours=12)),
        ("1d2h3m4s", timedelta(days=1, hours=2, minutes=3, seconds=4)),
    ],
    ids=["days", "hours", "minutes", "seconds", "day-hours", "all-units"],
)
def test_durations(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text",
    ["0", "0d", "0h0m", "-1d", "", "30", "1x", "1.5h", "d", "1h1d", "1d1d", "1 d", "٣d", "99999d"],
    ids=[
        "zero", "zero-days", "zero-sum", "negative", "empty", "no-unit", "bad-unit", "fraction",
        "no-number", "wrong-order", "repeated", "space", "non-ascii-digit", "too-long",
    ],
)  # fmt: skip
def test_prune_rejects_bad_durations(cli: Cli, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    result = cli("jobs", "prune", f"--older-than={text}")
    assert result.code == 2
    assert result.err.startswith(f"sdcore: error: argument --older-than: invalid duration {text!r}")


# --- connection strings and errors -------------------------------------------------------------


def test_missing_database_url(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    result = cli("jobs", "list")
    assert result.code == 2
    assert result.err.startswith("sdcore: error: no database: pass --database-url URL or set")


def test_database_url_from_the_environment(
    cli: Cli, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATABASE_URL", dsn)
    assert cli("jobs", "list").out == "no jobs found\n"
    monkeypatch.setenv("DATABASE_URL", "postgresql://127.0.0.1:1/x")
    assert cli("jobs", "list", "--database-url", dsn).out == "no jobs found\n"  # option wins


@pytest.mark.parametrize(
    ("argv", "env", "exit_code"),
    [
        (["--database-url", f"postgresql://u:{SECRET}@127.0.0.1:1/x", "jobs", "list"], None, 1),
        (["jobs", "prune", "--older-than", "1d"], f"postgresql://u:{SECRET}@127.0.0.1:1/x", 1),
        (["jobs", "list", f"--database-url=host=127.0.0.1 port=1 password={SECRET}"], None, 1),
        (["db", "upgrade", "--database-url", f"postgresql://u:{SECRET}@127.0.0.1:1/x"], None, 1),
        (["--database-url", f"host=x password={SECRET} b", "jobs", "list"], None, 2),
        (
            ["--database-url", f"postgresql://u:{SECRET}@127.0.0.1:notaport/x", "jobs", "list"],
            None,
            1,
        ),
        (["jobs", "list", f"postgresql://u:{SECRET}@127.0.0.1/x"], None, 2),
        (["--database-url", "postgresql://u:s3c@retpw@127.0.0.1:1/x", "jobs", "list"], None, 2),
    ],
    ids=[
        "url",
        "env",
        "key-value",
        "upgrade",
        "unparsable",
        "bad-port",
        "stray-argument",
        "unencoded-at",
    ],
)
def test_passwords_never_appear(
    cli: Cli,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: str | None,
    exit_code: int,
) -> None:
    if env is None:
        monkeypatch.delenv("DATABASE_URL", raising=False)
    else:
        monkeypatch.setenv("DATABASE_URL", env)
    result = cli(*argv)
    assert result.code == exit_code
    assert SECRET not in result.out + result.err
    assert "retpw" not in result.out + result.err
    assert result.err.startswith("sdcore: error: ")
    assert result.err.count("\n") == 1
    assert "Traceback" not in result.err


def test_password_hidden_when_the_server_answers(cli: Cli, pg_dsn: str) -> None:
    with_secret = f"{pg_dsn} password={SECRET}"  # trust auth ignores the password
    result = cli(
        "--database-url", with_secret, "jobs", "release", "00000000-0000-4000-8000-000000000000"
    )
    assert result.code == 1
    assert "does not exist; run `sdcore db upgrade`" in result.err
    assert SECRET not in result.out + result.err


def test_help_and_missing_command(cli: Cli) -> None:
    helped = cli("--help")
    assert helped.code == 0
    assert helped.out.startswith("usage: sdcore")
    assert cli("jobs", "prune", "--help").out.startswith("usage: sdcore jobs prune")
    missing = cli()
    assert missing.code == 2
    assert missing.err.startswith("usage: sdcore")  # no command: the help, on stderr
    assert "completion" in missing.err
    assert missing.out == ""
    assert "required: COMMAND" in cli("jobs").err


# -- --version, completion, logging -----------------------------------------------------------


def test_version(cli: Cli) -> None:
    import sdcore

    shown = cli("--version")
    assert shown.code == 0
    assert shown.out == f"sdcore {sdcore.__version__}\n"


def test_version_matches_the_package_metadata() -> None:
    from importlib.metadata import version

    import sdcore

    assert version("sdcore") == sdcore.__version__


def _complete(script: str, *words: str) -> list[str]:
    driver = (
        f"{script}\n"
        f"COMP_WORDS=({' '.join(repr(w) for w in words)}); "
        "COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); _sdcore; printf '%s\\n' \"${COMPREPLY[@]}\""
    )
    done = subprocess.run(
        ["bash", "--norc", "-c", driver], capture_output=True, text=True, timeout=30, check=True
    )
    return [line for line in done.stdout.splitlines() if line]


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (("sdcore", "d"), ["db", "demo"]),
        (("sdcore", "db", ""), ["sql", "upgrade", "status", "-h", "--help"]),
        (("sdcore", "--database-url", "x", "jobs", "l"), ["list"]),
        (("sdcore", "jobs", "list", "--status", ""), ["RUNNING", "SUCCESS", "FAIL"]),
        (("sdcore", "jobs", "prune", "--status", ""), ["SUCCESS", "FAIL"]),
        (("sdcore", "outbox", "list", "--status", "P"), ["PENDING", "PUBLISHED"]),
        (("sdcore", "schedules", "missed", "--j"), ["--json"]),
        (("sdcore", "--log-level", "W"), ["WARNING"]),
        (("sdcore", "completion", "z"), ["zsh"]),
    ],
    ids=["command", "subcommand", "after-option", "jobs-status", "prune-status",
         "outbox-status", "json-flag", "log-level", "shell"],
)
def test_bash_completion(cli: Cli, words: tuple[str, ...], expected: list[str]) -> None:
    script = cli("completion", "bash")
    assert script.code == 0
    assert script.out.rstrip().endswith("complete -o default -F _sdcore sdcore")
    assert _complete(script.out, *words) == expected


def test_zsh_completion_loads_the_bash_function(cli: Cli) -> None:
    script = cli("completion", "zsh")
    assert script.code == 0
    assert "bashcompinit" in script.out
    assert "_sdcore()" in script.out
    assert cli("completion", "fish").code == 2


def _log_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    (tmp_path / f"{name}.py").write_text(
        "import logging\n"
        "from sdcore.scheduling import Scheduler\n"
        "log = logging.getLogger('myapp')\n"
        "log.info('connecting to %s', 'postgresql://app:hunter2@db/app',\n"
        "         extra={'action': 'boot'})\n"
        "log.warning('clock is %s', 'odd')\n"
        "scheduler = Scheduler()\n"
    )
    monkeypatch.chdir(tmp_path)
    return f"{name}:scheduler"


def test_log_level_and_json_logs(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _log_app(tmp_path, monkeypatch, "sdcore_cli_log_app_json")
    shown = cli("--log-level", "info", "--log-json", "schedules", "list", "--app", app)
    assert shown.code == 0, shown.err
    records = [json.loads(line) for line in shown.err.splitlines()]
    assert [r["level"] for r in records] == ["INFO", "WARNING"]
    info = records[0]
    assert info["logger"] == "myapp"
    assert info["action"] == "boot"
    assert info["time"].endswith("Z")
    assert "hunter2" not in shown.err
    assert "***" in info["message"]


def test_default_log_level_is_warning_as_text(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _log_app(tmp_path, monkeypatch, "sdcore_cli_log_app_text")
    shown = cli("schedules", "list", "--app", app)
    assert shown.code == 0, shown.err
    [line] = shown.err.splitlines()
    assert line.endswith(" WARNING myapp: clock is odd")
    assert line.split(" ")[0].endswith("Z")


def test_json_log_records_with_exceptions_and_odd_extras(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import logging
    from datetime import UTC, datetime

    from sdcore.cli._logging import cli_logging

    log = logging.getLogger("sdcore.test.cli_logging")
    with cli_logging("INFO", as_json=True, secrets=["postgresql://u:s3cr3t@h/db"]):
        try:
            raise ValueError("boom with s3cr3t")
        except ValueError:
            log.exception(
                "failed", extra={"when": datetime(2026, 7, 20, tzinfo=UTC), "schedule": "nightly"}
            )
        log.debug("not shown")
    log.warning("after the block: not ours")
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("{")]
    record = json.loads(line)
    assert record["level"] == "ERROR"
    assert record["schedule"] == "nightly"
    assert record["when"].startswith("2026-07-20")  # not JSON: shown as its str()
    assert "ValueError: boom with ***" in record["message"]
    assert "s3cr3t" not in err
