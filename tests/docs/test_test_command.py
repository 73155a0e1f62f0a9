"""The README's test command is what CI runs, and it names every step the suite needs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_test_command() -> str:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    commands = [
        line for line in lines if line.startswith("python3 -m venv") and "bin/pytest" in line
    ]
    assert len(commands) == 1, f"expected one test command in README.md, found {commands}"
    return commands[0]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8").rstrip("\n").splitlines()
    assert script[-1] == _readme_test_command()


def test_the_test_command_checks_format_and_runs_both_pytest_steps() -> None:
    steps = _readme_test_command().split(" && ")
    assert ".venv/bin/ruff format --check ." in steps
    # The acceptance modules marked alone first, one at a time; then everything else, the other
    # acceptance modules in two lanes beside the rest (tests/_lanes.py). The Django 6 tests run
    # among the rest, in their own venv (tests/integration/test_django6.py).
    assert steps[-2:] == [
        '.venv/bin/pytest -m "acceptance and alone" -n 0',
        '.venv/bin/pytest -m "not (acceptance and alone)" -n 4 --dist loadgroup',
    ]
