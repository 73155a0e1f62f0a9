"""The rules by which a test run sweeps test databases: never another live run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

from tests.conftest import OWNER, PREFIX, RUN_ID, RUN_STARTED, STALE_AFTER, is_stale, unique_name

NOW = RUN_STARTED + timedelta(minutes=5)


def _name(started: datetime, rand: str = "abc123") -> str:
    return f"{PREFIX}{started:%y%m%d%H%M%S}_{rand}_7"


def _comment(**owner: object) -> str:
    return json.dumps({**OWNER, **owner})


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel reuses it)


def test_names_carry_the_run_id_and_are_unique() -> None:
    names = {unique_name() for _ in range(100)}
    assert len(names) == 100
    assert all(name.startswith(f"{PREFIX}{RUN_ID}_") for name in names)
    assert all(len(name.encode()) <= 63 for name in names)


def test_this_runs_databases_are_never_stale() -> None:
    later = NOW + STALE_AFTER * 10
    assert not is_stale(unique_name(), _comment(pid=_dead_pid()), later)


def test_a_live_run_on_this_host_is_kept_until_its_id_is_old() -> None:
    name = _name(NOW - timedelta(hours=1))
    assert not is_stale(name, _comment(pid=os.getpid()), NOW)
    assert not is_stale(name, None, NOW)  # no owner recorded: only its age can tell
    assert is_stale(_name(NOW - STALE_AFTER - timedelta(minutes=1)), _comment(), NOW)


def test_a_run_whose_process_is_gone_is_stale_at_once() -> None:
    assert is_stale(_name(NOW - timedelta(minutes=1)), _comment(pid=_dead_pid()), NOW)


def test_a_dead_pid_of_another_host_or_container_proves_nothing() -> None:
    name = _name(NOW - timedelta(minutes=1))
    pid = _dead_pid()
    assert not is_stale(name, _comment(pid=pid, host="other-host"), NOW)
    assert not is_stale(name, _comment(pid=pid, pidns="pid:[1]"), NOW)


def test_foreign_and_malformed_names_are_left_alone() -> None:
    old = datetime(2000, 1, 1, tzinfo=UTC)
    for name in ("sdcore_tmpl_123", f"{PREFIX}x", f"{PREFIX}{old:%Y%m%d}_abc123", "postgres"):
        assert not is_stale(name, _comment(pid=_dead_pid()), NOW)
    for comment in ("sdcore test run created 2000-01-01", "[]", "{}"):
        assert not is_stale(_name(NOW - timedelta(minutes=1)), comment, NOW)


def test_databases_of_the_scheme_before_are_swept_by_their_stamp_only() -> None:
    name = f"{PREFIX}0123456789_4"
    old = (NOW - STALE_AFTER - timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")
    fresh = (NOW - timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")
    assert is_stale(name, f"sdcore test run created {old}", NOW)
    assert not is_stale(name, f"sdcore test run created {fresh}", NOW)
    assert not is_stale(name, None, NOW)
