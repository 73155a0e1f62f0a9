"""What a new user copies from the README and the docs works as written from a checkout."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.test_samples import ROOT, _documents, extract

# `pip install sdcore`, `pip install 'sdcore[x]'`, "sdcore[x]": a package sdcore is not on PyPI
# under, and a name anyone could take there.
_FROM_PYPI = re.compile(r"""pip install\s+(?:-U\s+)?["']?sdcore\b""")
README = ROOT / "README.md"
APP = "nightly:runtime"


def test_no_page_installs_sdcore_from_pypi() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _documents()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _FROM_PYPI.search(line)
    ]
    assert not found, "install from a checkout (pip install -e '.[extra]'):\n" + "\n".join(found)


def _runs_at_import(code: str) -> list[int]:
    """Lines of module-level ``asyncio.run(...)`` calls outside ``if __name__ == "__main__":``."""
    lines = []
    for statement in ast.parse(code).body:
        if isinstance(statement, ast.If) and "__main__" in ast.unparse(statement.test):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                break
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "asyncio.run":
                lines.append(node.lineno)
    return lines


def test_readme_programs_start_only_as_main() -> None:
    """The README's programs can be imported (``--app``, ``sdcore run``) without running."""
    programs = [sample for sample in extract(README) if not sample.fragment]
    assert programs
    for sample in programs:
        assert not _runs_at_import(sample.code), f"{sample.id}: guard asyncio.run with __main__"


def test_the_readme_scheduler_is_a_runtime_the_cli_can_name(tmp_path: Path) -> None:
    """``--app nightly:runtime`` on the README's first sample lists its schedule, at once."""
    first = next(sample for sample in extract(README) if not sample.fragment)
    (tmp_path / "nightly.py").write_text(first.code, encoding="utf-8")
    env = {**os.environ, "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"}
    done = subprocess.run(
        [sys.executable, "-m", "sdcore.cli", "schedules", "list", "--json", "--app", APP],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [row["name"] for row in rows] == ["mark-overdue-tasks"]
    assert "scheduler running" not in done.stdout


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        pytest.param("import asyncio\nasyncio.run(main())\n", [2], id="unguarded"),
        pytest.param(
            'import asyncio\nif __name__ == "__main__":\n    asyncio.run(main())\n',
            [],
            id="guarded",
        ),
        pytest.param("async def f():\n    asyncio.run(g())\n", [], id="in-a-function"),
    ],
)
def test_runs_at_import_detection(code: str, expected: list[int]) -> None:
    assert _runs_at_import(code) == expected


def _operate_commands() -> list[list[str]]:
    """The README's ``sdcore schedules …`` lines right after its first program, as argv lists."""
    text = README.read_text(encoding="utf-8")
    first = next(sample for sample in extract(README) if not sample.fragment)
    after = text.splitlines()[first.line + first.code.count("\n") + 1 :]
    opening = next(i for i, line in enumerate(after) if line.startswith("```"))
    assert after[opening] == "```bash", "the first program is followed by its sdcore commands"
    closing = after.index("```", opening + 1)
    return [
        shlex.split(line.split("#", 1)[0].replace(".venv/bin/sdcore", "sdcore"))
        for line in after[opening + 1 : closing]
    ]


@pytest.mark.slow
def test_the_readme_runtime_is_operated_by_the_commands_below_it(
    pg_dsn: str, tmp_path: Path
) -> None:
    """While the README's first program runs, each command shown under it works on its schedule."""
    first = next(sample for sample in extract(README) if not sample.fragment)
    (tmp_path / "nightly.py").write_text(first.code, encoding="utf-8")
    env = {**os.environ, "DATABASE_URL": pg_dsn, "PYTHONUNBUFFERED": "1"}
    replica = subprocess.Popen(
        [sys.executable, "nightly.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert replica.stdout is not None
        assert "Ctrl-C" in replica.stdout.readline()
        commands = _operate_commands()
        assert [command[:2] for command in commands] == [["sdcore", "schedules"]] * len(commands)
        assert {command[2] for command in commands} >= {"list", "pause", "resume", "trigger"}
        for command in commands:
            done = subprocess.run(
                [sys.executable, "-m", "sdcore.cli", *command[1:]],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, f"{shlex.join(command)}\n{done.stdout}{done.stderr}"
            if command[2] != "history":  # a table of runs, which may still be empty
                assert "mark-overdue-tasks" in done.stdout, shlex.join(command)
    finally:
        replica.send_signal(signal.SIGINT)
        _, errors = replica.communicate(timeout=60)
    assert replica.returncode == 0, errors
