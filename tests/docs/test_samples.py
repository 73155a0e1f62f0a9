"""Every ```python block of README.md and docs/**.md runs as written, or is marked a fragment.

The conventions a sample follows (documented in docs/index.md, "Code samples"):

- A block preceded, on the line just before its fence, by ``<!-- fragment -->`` is an excerpt
  (abridged, a signature, or using names defined elsewhere on the page) and is not run.
- Every other block is a complete program: it is saved to a file and run with ``python`` in an
  empty folder, exactly as a reader would paste it. A block with top-level ``await`` is written
  for ``python -m asyncio`` (the asyncio REPL) and runs as the body of ``asyncio.run(...)``.
  It reads the database from the
  ``DATABASE_URL`` environment variable (the test points it at a fresh, empty database) and Redis,
  if at all, from ``REDIS_URL``.
- A program that runs until stopped prints a line containing ``Ctrl-C`` once it is ready; the test
  then sends SIGINT and expects exit status 0 (a clean stop, no traceback).
- A block that defines ``test_…`` functions is a test module: it is saved as ``test_sample.py``
  and run with ``pytest`` (``asyncio_mode = "auto"``, as the testing how-to says to configure),
  and every test in it must pass.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRAGMENT = "<!-- fragment -->"
READY = "Ctrl-C"
RUN_TIMEOUT_S = 90
_TOP_LEVEL_AWAIT = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
# Runs a block with top-level await as `python -m asyncio` would: one event loop, one namespace.
_AWAIT_RUNNER = """\
import asyncio, sys
source = open(sys.argv[1], encoding="utf-8").read()
code = compile(source, sys.argv[1], "exec", flags={flags})
namespace = {{"__name__": "__main__"}}
result = eval(code, namespace)
if asyncio.iscoroutine(result):
    asyncio.run(result)
"""
REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
_TEST_FUNCTION = re.compile(r"^(async )?def test_", re.MULTILINE)
_FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[A-Za-z0-9_+-]*)\s*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One fenced Python block."""

    path: Path
    line: int
    code: str
    fragment: bool

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract(path: Path) -> list[Sample]:
    """Return the ```python blocks of a Markdown file, with their opening line numbers.

    Raises:
        ValueError: A fence is never closed.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    samples: list[Sample] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None or not opening["lang"]:
            index += 1
            continue
        indent = len(opening["indent"])
        body: list[str] = []
        end = index + 1
        while end < len(lines) and _FENCE.match(lines[end]) is None:
            body.append(lines[end][indent:])
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{index + 1}: a code fence is never closed")
        if opening["lang"] == "python":
            before = lines[index - 1].strip() if index > 0 else ""
            samples.append(
                Sample(
                    path=path,
                    line=index + 1,
                    code="\n".join(body) + "\n",
                    fragment=before == FRAGMENT,
                )
            )
        index = end + 1
    return samples


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


ALL = [sample for document in _documents() for sample in extract(document)]
PROGRAMS = [sample for sample in ALL if not sample.fragment]


def test_extraction_finds_the_readme_samples() -> None:
    readme = [sample for sample in ALL if sample.path.name == "README.md"]
    assert len(readme) >= 2
    assert all(not sample.fragment for sample in readme)


def test_extract_marks_fragments_and_reads_indented_fences(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nprint(1)\n```\n"
        f"{FRAGMENT}\n```python\nx = y\n```\n"
        "- item\n\n  ```python\n  print(2)\n  ```\n"
        "```bash\necho no\n```\n"
    )
    found = extract(page)
    assert [(s.line, s.fragment, s.code) for s in found] == [
        (3, False, "print(1)\n"),
        (7, True, "x = y\n"),
        (12, False, "print(2)\n"),
    ]
    (tmp_path / "open.md").write_text("```python\nprint(1)\n")
    with pytest.raises(ValueError, match="never closed"):
        extract(tmp_path / "open.md")


@pytest.mark.parametrize("sample", PROGRAMS, ids=[sample.id for sample in PROGRAMS])
def test_every_program_is_valid_python(sample: Sample) -> None:
    try:
        compile(sample.code, sample.id, "exec", flags=ast.PyCF_ONLY_AST | _TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        pytest.fail(
            f"{sample.id}: not valid Python ({exc}); fix it, or mark it with {FRAGMENT!r} on "
            "the line before the fence",
            pytrace=False,
        )


@pytest.mark.slow
@pytest.mark.parametrize("sample", PROGRAMS, ids=[sample.id for sample in PROGRAMS])
def test_program_runs_as_written(sample: Sample, pg_dsn: str, tmp_path: Path) -> None:
    tests = _TEST_FUNCTION.search(sample.code) is not None
    script = tmp_path / ("test_sample.py" if tests else "sample.py")
    script.write_text(sample.code, encoding="utf-8")
    command = [sys.executable, str(script)]
    if tests:
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "-c",
            os.devnull,
            "-o",
            "asyncio_mode=auto",
            "-o",
            "asyncio_default_fixture_loop_scope=function",
            "-W",
            "error",
            str(script),
        ]
    elif _has_top_level_await(sample.code):
        runner = tmp_path / "_await_runner.py"
        runner.write_text(_AWAIT_RUNNER.format(flags=int(_TOP_LEVEL_AWAIT)), encoding="utf-8")
        command = [sys.executable, str(runner), str(script)]
    env = {
        **os.environ,
        "DATABASE_URL": pg_dsn,
        "REDIS_URL": REDIS_URL,
        "PYTHONUNBUFFERED": "1",
    }
    errors = tmp_path / "stderr.txt"
    with errors.open("w", encoding="utf-8") as stderr:
        proc = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    out: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        interrupted = False
        for line in proc.stdout:
            out.append(line)
            if READY in line and not interrupted:
                interrupted = True
                proc.send_signal(signal.SIGINT)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(timeout=10)
        _close(proc)
        pytest.fail(
            f"{sample.id}: still running after {RUN_TIMEOUT_S} s (a program that runs until "
            f"stopped must print a line with {READY!r} when ready)\n{''.join(out)}"
            f"{errors.read_text(encoding='utf-8')}",
            pytrace=False,
        )
    reader.join(timeout=10)
    _close(proc)
    if proc.returncode != 0:
        pytest.fail(
            f"{sample.id}: exit status {proc.returncode}\n--- stdout\n{''.join(out)}"
            f"--- stderr\n{errors.read_text(encoding='utf-8')}",
            pytrace=False,
        )


def _close(proc: subprocess.Popen[str]) -> None:
    if proc.stdout is not None:
        proc.stdout.close()


def _has_top_level_await(code: str) -> bool:
    # The parser accepts a module-level await; the compiler refuses it unless allowed.
    try:
        compile(code, "<sample>", "exec", dont_inherit=True)
    except SyntaxError:
        try:
            compile(code, "<sample>", "exec", flags=_TOP_LEVEL_AWAIT, dont_inherit=True)
        except SyntaxError:
            return False  # not Python at all: running it reports the error
        return True
    return False


def test_top_level_await_detection() -> None:
    assert _has_top_level_await("import asyncio\nawait asyncio.sleep(0)\n")
    assert not _has_top_level_await("import asyncio\nasyncio.run(asyncio.sleep(0))\n")
