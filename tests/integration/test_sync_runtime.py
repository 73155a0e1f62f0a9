"""``sdcore.sync.Runtime`` on a real PostgreSQL: start, stop, probes from other threads, plain
handlers in the bounded pool, failures that leave nothing running, and — in subprocesses —
SIGTERM, interpreter exit and fork."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sdcore.postgres import PoolSettings
from sdcore.runtime import RuntimeStateError
from sdcore.scheduling import Tick
from sdcore.sync import Runtime

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests.integration._sync_runtime_app"


def _threads() -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.name.startswith("sdcore-")}


def build(dsn: str, **kwargs: object) -> Runtime:
    kwargs.setdefault("stop_on_sigterm", False)
    return Runtime(
        dsn,
        pool=PoolSettings(max_size=2),
        control=None,
        grace_period_ms=2_000,
        **kwargs,  # type: ignore[arg-type]
    )


def wait_for(check: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def running(runtime: Runtime) -> tuple[bool, bool, bool]:
    return runtime.started, runtime.aio.started, runtime.portal.running


@pytest.fixture
def no_thread_left() -> Iterator[None]:
    before = _threads()
    yield
    wait_for(lambda: _threads() <= before, 10)  # a handler thread ends when its function does


def test_start_stop_and_with(schema_dsn: str, no_thread_left: None) -> None:
    runtime = build(schema_dsn)
    assert repr(runtime) == "<sdcore.sync.Runtime stopped>"
    assert _threads() == set()
    with runtime as entered:
        assert entered is runtime
        assert repr(runtime) == "<sdcore.sync.Runtime started>"
        assert running(runtime) == (True, True, True)
    assert running(runtime) == (False, False, False)
    runtime.stop()  # idempotent
    with pytest.raises(RuntimeStateError, match="was stopped"):
        runtime.start()


def test_start_twice_is_refused(schema_dsn: str, no_thread_left: None) -> None:
    with build(schema_dsn) as runtime, pytest.raises(RuntimeStateError, match="already started"):
        runtime.start()


def test_probes_answer_from_other_threads(schema_dsn: str, no_thread_left: None) -> None:
    runtime = build(schema_dsn)
    assert runtime.liveness().checks["runtime"].detail == "not started"
    assert not runtime.readiness().ok
    with pytest.raises(RuntimeStateError, match="not started"):
        runtime.health()
    answers: list[object] = []
    with runtime:

        def probe() -> None:
            answers.extend([runtime.health(), runtime.liveness(), runtime.readiness()])

        threads = [threading.Thread(target=probe) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(answers) == 12
    health = answers[0]
    assert isinstance(health, dict)
    assert health["database"].ok
    assert all(answer.ok for answer in answers[1:3])  # type: ignore[attr-defined]
    assert not runtime.liveness().ok


def test_a_failed_start_leaves_nothing_running(no_thread_left: None) -> None:
    runtime = build("postgresql://postgres@127.0.0.1:1/none")
    with pytest.raises(RuntimeStateError, match="cannot connect"):
        runtime.start()
    assert not runtime.started
    assert not runtime.portal.running
    assert _threads() == set()
    runtime.stop()


def test_plain_handlers_run_in_the_bounded_pool(schema_dsn: str, no_thread_left: None) -> None:
    runtime = build(schema_dsn, handler_threads=2)
    lock = threading.Lock()
    names: set[str] = set()
    running = 0
    most = 0

    def work(tick: Tick) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            names.add(threading.current_thread().name)
        time.sleep(0.3)
        with lock:
            running -= 1

    for index in range(6):
        runtime.scheduler.add_interval(f"busy-{index}", 100, work, exclusive=False)
    with runtime:
        wait_for(lambda: len(names) >= 2)
        time.sleep(0.5)
    assert most == 2
    assert names == {"sdcore-runtime-handler_0", "sdcore-runtime-handler_1"}


def test_stop_from_inside_the_runtime_is_refused(schema_dsn: str, no_thread_left: None) -> None:
    runtime = build(schema_dsn)
    errors: list[BaseException] = []
    done = threading.Event()

    @runtime.scheduler.timeout(0, name="stop-myself")
    def stop_myself(tick: Tick) -> None:
        try:
            runtime.stop()
        except RuntimeStateError as exc:
            errors.append(exc)
        done.set()

    async def on_the_loop() -> None:
        try:
            runtime.stop()
        except RuntimeStateError as exc:
            errors.append(exc)

    with runtime:
        assert done.wait(20)
        runtime.portal.call(on_the_loop)
        assert runtime.started
    assert [str(error).split(" would")[0] for error in errors] == [
        "runtime.stop() from one of the runtime's own handlers",
        "runtime.stop() from a running event loop",
    ]


def test_stop_from_inside_a_run_exclusive_function_is_refused_and_changes_nothing(
    schema_dsn: str, no_thread_left: None
) -> None:
    # The stop would close runtime.jobs, which waits for that very function.
    runtime = build(schema_dsn)
    errors: list[RuntimeStateError] = []

    def stop_inside(lease: object) -> int:
        try:
            runtime.stop()
        except RuntimeStateError as exc:
            errors.append(exc)
        return 1

    with runtime:
        result = runtime.jobs.run_exclusive({"code": "stop-inside", "run_key": "1"}, stop_inside)
        assert result.result == 1
        assert running(runtime) == (True, True, True)
    assert [str(error).split(" would")[0] for error in errors] == [
        "runtime.stop() from inside run_exclusive's function"
    ]
    assert running(runtime) == (False, False, False)


def test_stop_waits_for_a_stop_in_progress(schema_dsn: str, no_thread_left: None) -> None:
    runtime = build(schema_dsn)
    runtime.start()
    stoppers = [threading.Thread(target=runtime.stop) for _ in range(3)]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join()
    assert not runtime.started
    assert not runtime.portal.running


def test_two_runtimes_in_one_process(schema_dsn: str, no_thread_left: None) -> None:
    first, second = build(schema_dsn), build(schema_dsn)
    ran: dict[str, int] = {"a": 0, "b": 0}
    first.scheduler.add_interval("a", 100, lambda tick: ran.__setitem__("a", 1))
    second.scheduler.add_interval("b", 100, lambda tick: ran.__setitem__("b", 1))
    with first, second:
        wait_for(lambda: all(ran.values()))
        assert first.portal.loop is not second.portal.loop
    assert not first.started
    assert not second.started


# --- subprocesses ------------------------------------------------------------------------------


def spawn(mode: str, dsn: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "DATABASE_URL": dsn,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]),
        "PYTHONUNBUFFERED": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-m", SCRIPT, mode],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_line(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None
    for got in proc.stdout:
        if got.strip() == line:
            return
    _, err = proc.communicate()
    pytest.fail(f"no {line!r} (status {proc.returncode})\n{err}", pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sigterm", "two"])
def test_sigterm_stops_every_runtime_then_ends_as_killed(schema_dsn: str, mode: str) -> None:
    proc = spawn(mode, schema_dsn)
    wait_line(proc, "ready")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM, err
    assert err.count("sdcore stopped") == (2 if mode == "two" else 1), err
    assert "Traceback" not in err


@pytest.mark.slow
def test_sigterm_during_start_ends_the_process(no_thread_left: None) -> None:
    with socket.socket() as mute:  # accepts connections, never answers: start() waits
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        port = mute.getsockname()[1]
        proc = spawn("start", f"postgresql://postgres@127.0.0.1:{port}/none")
        wait_line(proc, "starting")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGTERM, err
    assert "started" not in out
    assert "Traceback" not in err


@pytest.mark.slow
def test_interpreter_exit_stops_a_runtime_nobody_stopped(schema_dsn: str) -> None:
    proc = spawn("exit", schema_dsn)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "ready" in out
    assert "sdcore stopped" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_runtime_started_before_fork_is_refused_in_the_child(schema_dsn: str) -> None:
    proc = spawn("fork-started", schema_dsn)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "child health refused: this sdcore.sync.Runtime was started in process" in out
    assert "post_fork" in out
    assert "child status 0" in out
    assert "parent still healthy: True" in out


@pytest.mark.slow
def test_a_runtime_built_before_fork_starts_in_the_child(schema_dsn: str) -> None:
    proc = spawn("fork-built", schema_dsn)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "child started: True" in out
    assert "child status 0" in out


def test_a_plain_handler_past_the_grace_period(schema_dsn: str, no_thread_left: None) -> None:
    runtime = build(schema_dsn, handler_threads=2)
    entered = {"exclusive": threading.Event(), "plain": threading.Event()}
    saw_lost = threading.Event()
    release = threading.Event()

    @runtime.scheduler.timeout(0, name="plain")
    def plain(tick: Tick) -> None:
        entered["plain"].set()
        release.wait(30)

    @runtime.scheduler.initial(name="exclusive")
    def exclusive(tick: Tick) -> None:
        assert tick.lease is not None
        entered["exclusive"].set()
        while tick.lease.is_held:  # told through the lease: a thread cannot be cancelled
            time.sleep(0.02)
        saw_lost.set()

    runtime.start()
    assert entered["plain"].wait(20)
    assert entered["exclusive"].wait(20)
    runtime.stop()
    # stop() waited for the exclusive function (its row is not handed over while it works)
    # and not for the non-exclusive one, which still runs.
    assert saw_lost.is_set()
    assert not release.is_set()
    assert any(t.name.startswith("sdcore-runtime-handler") for t in threading.enumerate())
    release.set()


def test_a_call_under_a_stop_returns(schema_dsn: str, no_thread_left: None) -> None:
    runtime = build(schema_dsn)
    outcomes: list[str] = []
    runtime.start()

    def probe() -> None:
        while True:
            try:
                runtime.health()
            except RuntimeStateError as exc:
                outcomes.append(str(exc))
                return

    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.3)
    runtime.stop()
    prober.join(10)
    assert not prober.is_alive()
    assert outcomes
    assert "not started" in outcomes[0] or "stopped while the call ran" in outcomes[0]
