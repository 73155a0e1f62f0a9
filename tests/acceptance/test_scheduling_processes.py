"""Acceptance tests of cluster-safe scheduling with real OS processes (RELIABILITY.md §5.5).

The replicas, cluster and ledger are ``_scheduling_fleet.py``'s. Scenarios: SC-01 + SC-08/SC-10
(three replicas per second, kill -9 and restart one of them mid-run), SC-02/SC-03 (clock skew
with faketime and different ``TZ``), SC-09 (catch-up after every replica was down). Retries,
overlap and shutdown: ``test_scheduling_retries.py``. DST is covered by unit tests.

Nothing here asserts speed; the few time bounds are generous deadlines for things that must
happen at all.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter
from datetime import datetime, timedelta

import pytest

from sdcore.job_scheduler import JobSchedulerStatus
from sdcore.scheduling import format_run_key
from tests.acceptance._scheduling_fleet import (  # noqa: F401 - cluster_fixture: `cluster`
    STARTUP_S,
    WHOLE_SECOND_KEY,
    Cluster,
    Replica,
    _by_key,
    _create_ledger,
    _expected,
    _instant,
    _jobs,
    _ledger,
    _missed_via_api,
    _report,
    _require_faketime,
    _sleep_until,
    _utc,
    cluster_fixture,
)

# --------------------------------------------------------------------------- SC-01 / SC-08 / SC-10


@pytest.mark.slow
def test_sc01_three_replicas_per_second_kill9_and_restart(pg_dsn: str, cluster: Cluster) -> None:
    """SC-01: three replicas on ``* * * * * *`` for 22 s; each tick runs exactly once. Half-way,
    one replica is killed with SIGKILL while it runs a tick (SC-10) and started again (SC-08).

    The only tick allowed to be missing is the one in flight on the killed replica: its row stays
    ``RUNNING`` until the lease expires, and ``missed_ticks`` reports it (never silent). Apart
    from it, only a tick that the surviving replicas each logged as missed (the database or
    their loops more than a second late: a loaded machine) may have no row.
    """
    _create_ledger(pg_dsn)
    name, cron = "sc01", "* * * * * *"
    args = ["--cron", cron, "--sleep-ms", "500"]
    replicas = [cluster.spawn(i, name, args) for i in range(3)]
    for replica in replicas:
        replica.wait_for("started")
    t_start = time.time()

    _sleep_until(t_start + 10)
    # Kill the replica that starts the next run, while that run is in flight (the handler sleeps
    # 0.5 s after its ledger row).
    marks = [r.mark() for r in replicas]
    victim: Replica | None = None
    deadline = time.monotonic() + 5
    while victim is None and time.monotonic() < deadline:
        for replica, mark in zip(replicas, marks, strict=True):
            if replica.try_wait_for("ran", 0.005, start=mark) is not None:
                victim = replica
                break
    killed_mid_run = victim is not None
    if victim is None:
        victim = replicas[2]
    victim_id = replicas.index(victim)
    victim_pid = victim.pid
    victim.kill9()
    t_kill = time.time()
    replacement = cluster.spawn(victim_id, name, args, label=f"{name}#{victim_id}-restarted")
    replacement.wait_for("started")
    survivors = [r for r in replicas if r is not victim]

    _sleep_until(t_start + 22)
    t_end = time.time()
    cluster.stop([*survivors, replacement])

    keys = _expected(t_start + 3, t_end - 3, cron=cron)
    ledger = _ledger(pg_dsn, name)
    by_key = _by_key(ledger)
    jobs = _jobs(pg_dsn, name)
    doubled = [k for k in keys if len(by_key.get(k, [])) >= 2]
    missed = [k for k in keys if k not in jobs or jobs[k].status != "SUCCESS"]
    unrun = [k for k in keys if not by_key.get(k)]
    cut_short = [r for r in ledger if r.pid == victim_pid and r.finished_at is None]
    _report(
        f"SC-01: replicas=3 ticks={len(keys)} doubled={len(doubled)} missed={len(missed)}"
        f" killed_mid_run={killed_mid_run} runs_cut_by_kill={len(cut_short)}"
        f" runs_per_replica={dict(sorted(Counter(r.replica_id for r in ledger).items()))}"
    )
    _report(f"ticks={len(keys)} doubled={len(doubled)} missed={len(missed)}")

    assert len(keys) >= 15
    assert all(WHOLE_SECOND_KEY.match(r.run_key) for r in ledger), "a run key is not canonical"
    assert not doubled, {k: [(r.replica_id, r.pid) for r in by_key[k]] for k in doubled}
    assert set(unrun) <= set(missed)
    # A tick that every replica alive throughout left without a row and logged why (its previous
    # run waited on the database until the next tick was due, or the loop was a second late: a
    # machine loaded past what this test is about) is a documented missed tick, the catch-up
    # policy's (off here), and not what this test looks for.
    excused = [k for k in missed if k not in jobs and all(_logged_missed(r, k) for r in survivors)]
    missed = [k for k in missed if k not in excused]
    if excused:
        _report(f"SC-01: missed ticks each replica logged (a loaded machine): {excused}")
    assert len(missed) <= 1, f"missed ticks: {[(k, jobs.get(k)) for k in missed]}"
    for key in missed:
        # Lost only because its owner was killed during it: still RUNNING under the dead owner's
        # lease, scheduled just before the kill, and run (if at all) by the killed process only.
        job = jobs.get(key)
        assert job is not None, f"{key}: no row at all, nobody even acquired it"
        assert job.status == "RUNNING", f"{key}: {job}"
        assert {r.pid for r in by_key.get(key, [])} <= {victim_pid}
        assert t_kill - 2.5 <= _instant(key).timestamp() <= t_kill, (key, t_kill)
    for key in keys:
        if key in missed:
            continue
        (row,) = by_key[key]
        # One acquisition, never taken over: the run's token is the row's (tokens come from the
        # table's sequence, so not 1 for every key).
        assert row.fencing_token == jobs[key].fencing_token, (key, row, jobs[key])
        assert row.outcome == "ok"
    for row in cut_short:
        assert row.run_key in missed or row.run_key not in keys, (row, missed)
    stuck = sorted(k for k, job in jobs.items() if job.status == "RUNNING")
    assert set(stuck) <= set(missed), f"RUNNING rows left by graceful stops: {stuck}"

    reported = asyncio.run(_missed_via_api(pg_dsn, name, cron, t_start + 3, t_end - 3))
    assert [(m.run_key, m.status) for m in reported] == [
        (k, JobSchedulerStatus.RUNNING) for k in missed
    ]


def _logged_missed(replica: Replica, run_key: str) -> bool:
    """Whether ``replica`` logged that it left the per-second tick ``run_key`` without a row:
    by name (``a missed tick``), or as one of the ticks its late loop coalesced (``n tick(s)
    passed while the loop was late``: the ``n`` seconds before the one due at the line's time)."""
    text = replica.stderr_tail(10**8)
    if f"run {run_key!r}: a missed tick" in text:
        return True
    instant = _instant(run_key).timestamp()
    for line in text.splitlines():
        found = COALESCED.search(line)
        if found is None:
            continue
        at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()
        if math.floor(at) - int(found[1]) <= instant < math.floor(at):
            return True
    return False


COALESCED = re.compile(r": (\d+) tick\(s\) passed while the loop was late")


# --------------------------------------------------------------------------- SC-02 / SC-03


@pytest.mark.slow
def test_sc02_clock_skew_same_run_keys_each_tick_once(pg_dsn: str, cluster: Cluster) -> None:
    """SC-02/SC-03: ``*/5 * * * * *`` on three replicas whose wall clocks are 0, +2 s and -2 s
    (faketime; less than half the period) and whose ``TZ`` differ. Every replica computes the same
    run key for every tick; the fast one fires 2 s early and wins; each tick runs once."""
    faketime = _require_faketime()
    _create_ledger(pg_dsn)
    name, cron = "sc02", "*/5 * * * * *"
    specs = [(0, 0.0, "UTC"), (1, 2.0, "Asia/Kolkata"), (2, -2.0, "America/New_York")]
    replicas: list[Replica] = []
    for replica_id, skew, tz in specs:
        prefix = [] if skew == 0 else [faketime, "-f", f"{skew:+g}"]
        env = {"TZ": tz, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        replicas.append(
            cluster.spawn(replica_id, name, ["--cron", cron], prefix=prefix, extra_env=env)
        )
    offsets = []
    for (replica_id, skew, tz), replica in zip(specs, replicas, strict=True):
        ready = replica.wait_for("ready")
        offset = float(ready["offset_s"])
        offsets.append(offset)
        _report(
            f"SC-02: replica {replica_id} TZ={tz} wall={ready['wall_iso']}"
            f" offset_vs_db={offset:+.2f}s expected={skew:+.1f}s"
        )
        assert abs(offset - skew) < 0.5, f"replica {replica_id}: faketime not effective?"
    for replica in replicas:
        replica.wait_for("started")
    t_start = time.time()
    _sleep_until(t_start + 21)
    t_end = time.time()
    cluster.stop(replicas)

    keys = _expected(t_start + 3, t_end - 3, cron=cron)
    ledger = _ledger(pg_dsn, name)
    by_key = _by_key(ledger)
    jobs = _jobs(pg_dsn, name)
    fired: dict[int, Counter[str]] = {}
    for (replica_id, _, _), replica in zip(specs, replicas, strict=True):
        seen = Counter(e["run_key"] for e in replica.events("ran"))
        seen.update(
            e["run_key"] for e in replica.events("log") if e.get("action") == "tick_skipped"
        )
        fired[replica_id] = seen
    doubled = [k for k in keys if len(by_key.get(k, [])) > 1]
    lost = [k for k in keys if len(by_key.get(k, [])) == 0 or jobs[k].status != "SUCCESS"]
    early = [
        (_instant(r.run_key) - (r.app_now - timedelta(seconds=offsets[1]))).total_seconds()
        for k in keys
        for r in by_key.get(k, [])
        if r.replica_id == 1
    ]
    distinct = {k: len({rid for rid, seen in fired.items() if seen[k] == 1}) for k in keys}
    _report(
        f"SC-02: ticks={len(keys)} doubled={len(doubled)} lost={len(lost)}"
        f" replicas_with_same_key_per_tick={min(distinct.values(), default=0)}/3"
        f" max_early_s={max(early, default=0.0):.2f}"
    )

    assert len(keys) >= 2
    assert not doubled
    assert not lost
    all_keys = set(fired[0]) | set(fired[1]) | set(fired[2]) | {r.run_key for r in ledger}
    all_keys |= set(jobs)
    off_grid = sorted(
        k for k in all_keys if not WHOLE_SECOND_KEY.match(k) or _instant(k).second % 5
    )
    assert not off_grid, f"run keys off the */5 grid (derived from now?): {off_grid}"
    for key in keys:
        for replica_id, seen in fired.items():
            assert seen[key] == 1, f"replica {replica_id} fired {key} {seen[key]} times"
        (row,) = by_key[key]
        assert row.replica_id == 1, f"{key} ran on replica {row.replica_id}, not the fast one"
        # The fast replica fires by its own clock: 2 s before the scheduled instant. When its
        # handler began in real time is its own clock less its measured offset (the ledger row's
        # database time also counts the insert's wait for the server: reported, not judged).
        began = row.app_now - timedelta(seconds=offsets[1])
        ahead = (_instant(key) - began).total_seconds()
        landed = (_instant(key) - row.started_at).total_seconds()
        assert 1.5 <= ahead <= 2.5, (
            f"{key}: the fast replica's handler began {ahead:+.2f} s before the instant (its"
            f" clock {row.app_now.isoformat()}, offset {offsets[1]:+.2f} s); its ledger row"
            f" landed {landed:+.2f} s before it by the database's clock"
        )


# --------------------------------------------------------------------------- SC-09


def _next_odd_second(after: float) -> float:
    second = math.floor(after) + 1
    return float(second if second % 2 else second + 1)


@pytest.mark.slow
def test_sc09_catch_up_after_every_replica_was_down(pg_dsn: str, cluster: Cluster) -> None:
    """SC-09: an interval of 2 s; run, stop every replica, stay down over 3 ticks, start again
    with ``catch_up_window_ms=10_000``. ``latest``: only the most recent missed tick before the
    start runs; ``all`` (two replicas started at once): each missed tick in the window runs once.
    Ticks that succeeded before the stop and ticks older than the window never run again."""
    _create_ledger(pg_dsn)
    names = {"latest": "cu-latest", "all": "cu-all"}
    base = ["--interval-ms", "2000"]
    first = [
        cluster.spawn(0, names["latest"], base, label="latest-before"),
        cluster.spawn(1, names["all"], base, label="all-before"),
    ]
    for replica in first:
        replica.wait_for("started")
    # Ticks are on even seconds: stop and restart on odd seconds, 1 s away from any tick. The
    # first replicas run the two ticks of the catch-up window that precede the stop.
    t_stop = _next_odd_second(time.time() + 4.5)
    t_restart = t_stop + 6  # odd too; down over the ticks at t_stop + 1, + 3, + 5
    down = _expected(t_stop, t_restart, interval_ms=2000)
    assert len(down) == 3

    # The restarted replicas connect now and enter their scheduler at t_restart, together.
    window = ["--catch-up-window-ms", "10000", "--start-at", repr(t_restart)]
    second = {
        "latest": [
            cluster.spawn(2, names["latest"], [*base, "--catch-up", "latest", *window]),
        ],
        "all": [
            cluster.spawn(3, names["all"], [*base, "--catch-up", "all", *window]),
            cluster.spawn(4, names["all"], [*base, "--catch-up", "all", *window]),
        ],
    }
    restarted = [r for group in second.values() for r in group]
    _sleep_until(t_stop)
    cluster.stop(first)
    assert time.time() < t_restart - 3, "stopping took too long for the scenario"
    for replica in first:
        assert replica.events("ran"), f"{replica.label} ran nothing before the stop"
    before = {mode: _jobs(pg_dsn, name) for mode, name in names.items()}
    for replica in restarted:
        started = replica.wait_for("started", timeout=t_restart - time.time() + STARTUP_S)
        assert abs(float(started["entered"]) - t_restart) < 0.5, f"{replica.label} started late"
    _sleep_until(t_restart + 4.5)  # two regular ticks after the restart
    t_end = time.time()
    cluster.stop(restarted)

    in_window = _expected(t_restart - 10, t_restart, interval_ms=2000)
    after_restart = _expected(t_restart, t_end - 0.5, interval_ms=2000)
    results: dict[str, list[str]] = {}
    for mode, name in names.items():
        missed = [
            k for k in in_window if k not in before[mode] or before[mode][k].status != "SUCCESS"
        ]
        # The first replicas ran the window's ticks before the stop: only the downtime is missing.
        assert missed == down, (mode, down, missed)
        pids = {r.pid for r in second[mode]}
        ledger = _ledger(pg_dsn, name)
        caught_up = sorted(
            r.run_key
            for r in ledger
            if r.pid in pids and _instant(r.run_key).timestamp() < t_restart
        )
        beyond = [k for k in caught_up if _instant(k).timestamp() < t_restart - 10]
        counts = Counter(r.run_key for r in ledger)
        doubled = sorted(k for k, n in counts.items() if n > 1)
        results[mode] = caught_up
        _report(
            f"SC-09 catch_up={mode}: down_ticks={len(down)} missed_in_window={len(missed)}"
            f" ran={len(caught_up)} coalesced={len(missed) - len(caught_up)}"
            f" beyond_window_ran={len(beyond)} doubled={len(doubled)}"
        )
        assert not doubled, f"{mode}: ticks run twice: {doubled}"
        assert not beyond, f"{mode}: ticks older than the window ran: {beyond}"
        said = [
            e for r in second[mode] for e in r.events() if e.get("action", "").startswith("catch")
        ]
        if mode == "latest":
            assert caught_up == [max(missed)], (caught_up, missed, said, ledger)
        else:
            assert caught_up == sorted(missed), (caught_up, missed, said, ledger)
        # Ticks that had succeeded before the stop were not run again.
        succeeded = [k for k in in_window if k not in missed]
        assert all(counts[k] == 1 for k in succeeded), succeeded
        jobs = _jobs(pg_dsn, name)
        for key in [*caught_up, *after_restart]:
            assert counts[key] == 1, (mode, key, counts[key])
            assert jobs[key].status == "SUCCESS", (mode, key, jobs[key])
    assert results["latest"][0] < format_run_key(_utc(t_restart))
