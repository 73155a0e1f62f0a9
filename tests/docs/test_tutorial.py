"""The TaskFlow tutorial, followed as written from an empty folder: install, then three replicas.

The blocks marked ``<!-- tutorial: install -->`` and ``<!-- tutorial: run -->`` in
docs/tutorial/taskflow.md are extracted and run with bash, literally: a fresh venv, sdcore installed
from this checkout (``SDCORE``), the package copied in, then ``taskflow.replicas`` with no
``DATABASE_URL`` (the embedded PostgreSQL), watched until two ticks of the nightly job ran, and
stopped with Ctrl-C (SIGINT to the process group, as a terminal sends it). Meanwhile the block
``<!-- tutorial: curl -->`` runs in a second shell, as a second terminal would, and one replica
must mark its task due yesterday.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial" / "taskflow.md"
TICK = re.compile(r"\[replica-\d\] taskflow\.overdue: \d+ task\(s\) marked OVERDUE")


def block(name: str) -> str:
    """The fenced block right after ``<!-- tutorial: name -->``."""
    lines = TUTORIAL.read_text(encoding="utf-8").splitlines()
    start = lines.index(f"<!-- tutorial: {name} -->")
    assert lines[start + 1].startswith("```bash"), lines[start + 1]
    end = lines.index("```", start + 2)
    return "\n".join(lines[start + 2 : end]) + "\n"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.pop("VIRTUAL_ENV", None)
    env["SDCORE"] = str(ROOT)
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_tutorial_from_an_empty_folder(tmp_path: Path) -> None:
    env = _env()
    install = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block("install")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    service = tmp_path / "taskflow-service"
    assert (service / "taskflow" / "__main__.py").is_file()

    run = subprocess.Popen(
        ["bash", "-eu", "-c", block("run")],
        cwd=service,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    assert run.stdout is not None
    output = run.stdout

    def read() -> None:
        for text in output:
            lines.put(text)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ticks = 0
    deadline = time.monotonic() + 120
    try:
        while ticks < 2 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert run.poll() is None, "".join(seen)[-3000:]
                continue
            seen.append(line)
            ticks += bool(TICK.search(line))
        assert ticks >= 2, "".join(seen)[-3000:]
        assert any("3 replica(s) ready; Ctrl-C stops them" in line for line in seen)
        # The second terminal: a task due yesterday, created with the tutorial's curl block.
        curl = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block("curl")],
            cwd=service,
            env={k: v for k, v in env.items() if k != "TASKFLOW_JWT_SECRET"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert curl.returncode == 0, curl.stdout[-3000:] + curl.stderr[-3000:]
        marked = False
        deadline = time.monotonic() + 60
        while not marked and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            seen.append(line)
            marked = "1 task(s) marked OVERDUE" in line
        assert marked, "".join(seen)[-3000:]
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C
        assert run.wait(60) == 0, "".join(seen)[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
        reader.join(10)
        output.close()  # on a failure too: a pipe left open fails a later test as unraisable
    # Each tick was run by exactly one replica: one line per tick instant.
    instants = [line[:19] for line in seen if TICK.search(line)]
    assert len(instants) == len(set(instants)), instants
