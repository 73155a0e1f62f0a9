"""The commands: refusing to start without a secret, the token helper, the separate worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from taskflow.app import create_app
from taskflow.auth import decode_token

from taskflow import token
from tests.taskflow._support import EXAMPLE, REDIS_URL, SECRET, Api, SettingsFactory, wait_for


def _env(**values: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("TASKFLOW_") and key not in ("DATABASE_URL", "REDIS_URL")
    }
    env["PYTHONPATH"] = str(EXAMPLE)
    env.update(values)
    return env


@pytest.mark.parametrize(
    "module", ["taskflow", "taskflow.replicas", "taskflow.worker"], ids=lambda m: m
)
def test_refuses_to_start_without_the_jwt_secret(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module],
        env=_env(DATABASE_URL="postgresql://postgres@127.0.0.1:5432/postgres"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "TASKFLOW_JWT_SECRET is not set" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_worker_needs_redis() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "taskflow.worker"],
        env=_env(DATABASE_URL="postgresql://db/x", TASKFLOW_JWT_SECRET=SECRET),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "REDIS_URL is not set" in done.stderr


def test_the_token_helper(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    user = uuid.uuid4()
    monkeypatch.setenv("TASKFLOW_JWT_SECRET", SECRET)
    assert token.main(["--user-id", str(user), "--email", "ada@example.com"]) == 0
    printed = capsys.readouterr().out.strip()
    claims = decode_token(printed, SECRET)
    assert (claims.id, claims.email) == (user, "ada@example.com")
    monkeypatch.setenv("TASKFLOW_JWT_SECRET", "short")
    assert token.main(["--user-id", str(user)]) == 2


def test_a_separate_worker_processes_the_jobs(
    make_settings: SettingsFactory, database_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    """API with ``TASKFLOW_RUN_WORKERS=0`` (relay only) + ``python -m taskflow.worker``."""
    settings = make_settings(redis_url=REDIS_URL, queue_prefix=redis_prefix, run_workers=False)
    env = _env(
        DATABASE_URL=database_url,
        TASKFLOW_JWT_SECRET=SECRET,
        REDIS_URL=REDIS_URL,
        TASKFLOW_QUEUE_PREFIX=redis_prefix,
    )
    log = tmp_path / "worker.log"
    with log.open("w") as stderr:
        worker = subprocess.Popen([sys.executable, "-m", "taskflow.worker"], env=env, stderr=stderr)
        try:
            # ``python -m taskflow.worker`` is ``sdcore run taskflow.worker:runtime``.
            assert wait_for(lambda: "sdcore started" in log.read_text(), 30), log.read_text()
            app = create_app(settings)
            assert app.state.taskflow.sd.workers is None
            with TestClient(app) as client:
                user = uuid.uuid4()
                api = Api(client)
                task = api.task(user, api.project(user, email="ada@example.com"))
                assert api.set_status(user, task, "DONE").status_code == 200
                line = f"Email to ada@example.com: task {task} is now DONE (attempt 1)"
                assert wait_for(lambda: line in log.read_text(), 15), log.read_text()
                assert app.state.taskflow.sd.workers is None  # not processed in the API
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(20) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(10)
