"""Acceptance tests of retries, overlap and shutdown with real OS processes (RELIABILITY.md §5.5).

The replicas, cluster and ledger are ``_scheduling_fleet.py``'s. Scenarios: SC-12 (a failed tick
retried by another replica), SC-11 (overlap policies), shutdown mid-run (the tick's row ends
``FAIL``, not ``RUNNING``), SC-13 (a failing tick runs at most retries + 1 times) and SC-14
(kill -9 mid-run: the abandoned tick reruns once its lease expires).

Nothing here asserts speed; the few time bounds are generous deadlines for things that must
happen at all (a process exits instead of waiting for its 30 s handler).
"""

from __future__ import annotations

import signal
import time
from collections import Counter

import psycopg
import pytest

from tests.acceptance._scheduling_fleet import (  # noqa: F401 - cluster_fixture: `cluster`
    Cluster,
    Replica,
    _by_key,
    _create_ledger,
    _expected,
    _instant,
    _jobs,
    _ledger,
    _max_concurrency,
    _report,
    _require_faketime,
    _sleep_until,
    cluster_fixture,
)

# --------------------------------------------------------------------------- SC-12


@pytest.mark.slow
def test_sc12_failed_tick_is_retried_by_another_replica(pg_dsn: str, cluster: Cluster) -> None:
    """Three replicas on ``*/3 * * * * *`` with ``retries=3, retry_backoff_ms=200``; replica 0's
    handler always raises. Replicas 1 and 2 run their scheduler clock 150 ms late
    (``Scheduler(clock=...)``), so replica 0 takes each tick first and fails it; the ``FAIL`` row
    is then taken (fencing token + 1) and completed by another replica. Every tick ends SUCCESS."""
    _create_ledger(pg_dsn)
    name, cron = "retry", "*/3 * * * * *"
    base = ["--cron", cron, "--retries", "3", "--retry-backoff-ms", "200"]
    replicas = [
        cluster.spawn(0, name, [*base, "--fail"]),
        cluster.spawn(1, name, [*base, "--clock-offset-ms", "-150"]),
        cluster.spawn(2, name, [*base, "--clock-offset-ms", "-150"]),
    ]
    for replica in replicas:
        replica.wait_for("started")
    t_start = time.time()
    _sleep_until(t_start + 16)
    t_end = time.time()
    cluster.stop(replicas)

    keys = _expected(t_start + 3, t_end - 3, cron=cron)
    by_key = _by_key(_ledger(pg_dsn, name))
    jobs = _jobs(pg_dsn, name)
    first_by_failing = 0
    attempts = []
    for key in keys:
        job = jobs.get(key)
        rows = by_key.get(key, [])
        assert job is not None, f"{key}: never acquired"
        assert job.status == "SUCCESS", f"{key}: {job} ledger={rows}"
        succeeded = [r for r in rows if r.outcome == "ok"]
        assert len(succeeded) == 1, f"{key}: {len(succeeded)} successful runs: {rows}"
        assert succeeded[0].replica_id != 0
        assert rows[-1] is succeeded[0], f"{key}: a run after the success: {rows}"
        assert all(r.outcome == "failed" for r in rows if r.replica_id == 0), rows
        assert sum(r.replica_id == 0 for r in rows) <= 4, "more attempts than retries=3 allow"
        # Each acquisition (first or takeover of the FAIL row) draws a higher fencing token.
        tokens = [r.fencing_token for r in rows if r.fencing_token is not None]
        assert len(tokens) == len(rows), rows
        assert tokens == sorted(set(tokens)), rows
        assert job.fencing_token == tokens[-1]
        if rows[0].replica_id == 0:
            first_by_failing += 1
            assert len(rows) >= 2
        attempts.append(len(rows))
    _report(
        f"SC-12 retry: ticks={len(keys)} first_attempt_by_failing_replica={first_by_failing}"
        f" completed_by_another={first_by_failing} runs_per_tick={Counter(attempts)}"
    )
    assert len(keys) >= 3
    assert first_by_failing >= 1, "replica 0 never took a tick first: the scenario did not happen"


# --------------------------------------------------------------------------- SC-11


@pytest.mark.slow
def test_sc11_overlap_policies(pg_dsn: str, cluster: Cluster) -> None:
    """SC-11: a per-second schedule whose handler takes 2.5 s. ``skip`` (default) on one replica
    and ``skip_cluster`` on two replicas never run two ticks at once. Controls prove the check
    can see overlap: ``allow`` on one replica, and per-process ``skip`` on two replicas, do."""
    _create_ledger(pg_dsn)
    base = ["--cron", "* * * * * *", "--sleep-ms", "2500"]
    setups = {
        "ov-skip": ("skip", 1),
        "ov-cluster": ("skip_cluster", 2),
        "ov-allow": ("allow", 1),
        "ov-local": ("skip", 2),
    }
    groups: dict[str, list[Replica]] = {}
    for name, (overlap, count) in setups.items():
        groups[name] = [cluster.spawn(i, name, [*base, "--overlap", overlap]) for i in range(count)]
    everyone = [r for group in groups.values() for r in group]
    for replica in everyone:
        replica.wait_for("started")
    t_start = time.time()
    _sleep_until(t_start + 9)
    cluster.stop(everyone)

    peak: dict[str, int] = {}
    runs: dict[str, int] = {}
    for name in setups:
        ledger = _ledger(pg_dsn, name)
        counts = Counter(r.run_key for r in ledger)
        assert all(n == 1 for n in counts.values()), f"{name}: a tick ran twice: {counts}"
        peak[name] = _max_concurrency(ledger)
        runs[name] = len(ledger)
        stuck = [k for k, job in _jobs(pg_dsn, name).items() if job.status == "RUNNING"]
        assert not stuck, f"{name}: RUNNING rows after a graceful stop: {stuck}"
    skipped = {
        name: sum(
            1 for r in group for e in r.events("log") if e.get("action") == "tick_overlap_skipped"
        )
        for name, group in groups.items()
    }
    _report(
        "SC-11: max_concurrent "
        + " ".join(
            f"{name}={peak[name]}(runs={runs[name]},skipped={skipped[name]})" for name in setups
        )
    )
    assert peak["ov-skip"] == 1
    assert peak["ov-cluster"] == 1
    assert runs["ov-skip"] >= 2
    assert runs["ov-cluster"] >= 2
    assert skipped["ov-skip"] >= 1
    assert skipped["ov-cluster"] >= 1
    assert peak["ov-allow"] >= 2, "control: overlap='allow' should overlap"
    assert peak["ov-local"] >= 2, "control: per-process skip does not guard the cluster"


# --------------------------------------------------------------------------- shutdown


@pytest.mark.slow
def test_shutdown_mid_run_leaves_fail_not_running(pg_dsn: str, cluster: Cluster) -> None:
    """SIGTERM while a 30 s handler runs, with ``grace_period_ms=500``: the process exits
    without waiting for the handler, and the tick's row is ``FAIL`` (not stuck ``RUNNING``)."""
    _create_ledger(pg_dsn)
    name = "slow"
    replica = cluster.spawn(
        0, name, ["--cron", "* * * * * *", "--sleep-ms", "30000", "--grace-period-ms", "500"]
    )
    replica.wait_for("started")
    ran = replica.wait_for("ran", timeout=10)
    time.sleep(0.3)
    t0 = time.monotonic()
    replica.send_signal(signal.SIGTERM)
    rc = replica.wait_exit(15)
    exit_s = time.monotonic() - t0
    assert rc == 0, f"rc={rc} after SIGTERM\n{replica.stderr_tail()}"
    replica.wait_for("stopped", timeout=5)

    jobs = _jobs(pg_dsn, name)
    ledger = _ledger(pg_dsn, name)
    job = jobs[ran["run_key"]]
    _report(f"shutdown: exit_s={exit_s:.2f} row={job.status} data={job.data} runs={len(ledger)}")
    assert exit_s < 10, "the process waited for its handler instead of cancelling it"
    assert job.status == "FAIL", job
    assert [k for k, j in jobs.items() if j.status == "RUNNING"] == []
    assert [(r.run_key, r.outcome) for r in ledger] == [(ran["run_key"], "cancelled")]


# --------------------------------------------------------------------------- SC-13 / SC-14


def _attempts(dsn: str, code: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT run_key, attempts FROM job_scheduler WHERE code = %s AND run_key IS NOT NULL",
            (code,),
        ).fetchall()
    return {row[0]: row[1] for row in rows}


@pytest.mark.slow
def test_sc13_failing_tick_runs_at_most_retries_plus_one_times(
    pg_dsn: str, cluster: Cluster
) -> None:
    """SC-13: a cluster of three replicas per setting, all six at once; in each, the wall clocks
    are 0, +300 and +600 ms apart (faketime), ``*/2 * * * * *``, a handler that always fails
    after 100 ms. ``retries=0``: each tick runs exactly once in the cluster, not once per
    replica. ``retries=2``: at most 3 times, never two at once, and the retries do happen."""
    faketime = _require_faketime()
    _create_ledger(pg_dsn)
    cron = "*/2 * * * * *"
    fleets: dict[int, list[Replica]] = {}
    for retries in (0, 2):
        base = ["--cron", cron, "--fail", "--sleep-ms", "100", "--retries", str(retries)]
        base += ["--retry-backoff-ms", "200"]
        fleets[retries] = []
        for replica_id, skew in enumerate((0.0, 0.3, 0.6)):
            prefix = [] if skew == 0 else [faketime, "-f", f"{skew:+g}"]
            env = {"FAKETIME_DONT_FAKE_MONOTONIC": "1"}
            fleets[retries].append(
                cluster.spawn(replica_id, f"sc13-{retries}", base, prefix=prefix, extra_env=env)
            )
    everyone = [r for fleet in fleets.values() for r in fleet]
    for fleet in fleets.values():
        for replica_id, replica in enumerate(fleet):
            offset = float(replica.wait_for("ready")["offset_s"])
            assert abs(offset - 0.3 * replica_id) < 0.25, f"{replica.label}: offset {offset}"
    for replica in everyone:
        replica.wait_for("started")
    t_start = time.time()
    _sleep_until(t_start + 14)
    t_end = time.time()
    cluster.stop(everyone)

    keys = _expected(t_start + 2, t_end - 3, cron=cron)
    assert len(keys) >= 4
    for retries in fleets:
        name = f"sc13-{retries}"
        by_key = _by_key(_ledger(pg_dsn, name))
        attempts = _attempts(pg_dsn, name)
        jobs = _jobs(pg_dsn, name)
        runs = Counter({key: len(by_key.get(key, [])) for key in keys})
        peaks = {key: _max_concurrency(by_key[key]) for key in keys if key in by_key}
        _report(
            f"SC-13 retries={retries}: ticks={len(keys)} runs_per_tick={Counter(runs.values())}"
        )
        for key in keys:
            assert jobs[key].status == "FAIL", (retries, key, jobs[key])
            assert 1 <= runs[key] <= retries + 1, (retries, key, by_key.get(key))
            assert attempts[key] == runs[key], (retries, key, attempts[key], by_key.get(key))
            assert peaks[key] == 1, f"retries={retries} {key}: two runs at once: {by_key[key]}"
            assert [r.attempt for r in by_key[key]] == list(range(1, runs[key] + 1))
        if retries == 0:
            assert set(runs.values()) == {1}
        else:
            assert max(runs.values()) == retries + 1, "the retries never happened"


@pytest.mark.slow
def test_sc14_sigkill_mid_run_the_abandoned_tick_reruns_once_its_lease_expires(
    pg_dsn: str, cluster: Cluster
) -> None:
    """SC-14: a 1 s schedule, the default 1 h catch-up window,
    ``catch_up="all"`` and a 3 s lease; replica 0's handler takes 5 s. While it runs a tick it is
    killed with SIGKILL: another replica's sweep re-runs that tick once its lease has expired, and
    no tick from before the replicas started runs (the window's 3,600 ticks must not hide the
    abandoned one from the sweep)."""
    _create_ledger(pg_dsn)
    name = "sc14"
    common = ["--cron", "* * * * * *", "--catch-up", "all", "--lease-ms", "3000"]
    start_at = time.time() + 4
    replicas = [
        cluster.spawn(0, name, [*common, "--sleep-ms", "5000", "--start-at", str(start_at)]),
        cluster.spawn(1, name, [*common, "--sleep-ms", "100", "--start-at", str(start_at)]),
        cluster.spawn(2, name, [*common, "--sleep-ms", "100", "--start-at", str(start_at)]),
    ]
    entered = [float(r.wait_for("started")["entered"]) for r in replicas]
    victim = replicas[0]
    # The victim must win a tick first; the three race for each one, so that is a matter of luck
    # (it may lose many in a row): give it room rather than rig the race.
    ran = victim.wait_for("ran", timeout=45)
    time.sleep(0.5)
    victim.kill9()
    t_kill = time.time()
    abandoned = ran["run_key"]
    # Wait (9 s at most) for the rerun to finish, then 3 s more: a second rerun, or any other
    # tick run twice, would have to start meanwhile, as the survivors race for every tick.
    deadline = t_kill + 9
    while time.time() < deadline:
        if any(r.outcome == "ok" for r in _ledger(pg_dsn, name) if r.run_key == abandoned):
            _sleep_until(min(deadline, time.time() + 3))
            break
        time.sleep(0.2)
    cluster.stop(replicas[1:])

    by_key = _by_key(_ledger(pg_dsn, name))
    rows = by_key[abandoned]
    jobs = _jobs(pg_dsn, name)
    _report(
        f"SC-14: abandoned={abandoned} runs={[(r.replica_id, r.outcome) for r in rows]}"
        f" rerun_after_kill_s="
        f"{(rows[-1].started_at.timestamp() - t_kill) if len(rows) > 1 else float('nan'):.2f}"
    )
    assert rows[0].replica_id == 0
    assert rows[0].outcome is None, "the victim's run cannot have finished"
    assert len(rows) == 2, f"the abandoned tick ran {len(rows)} times: {rows}"
    assert rows[1].replica_id != 0
    assert rows[1].outcome == "ok"
    # Not before the lease ran out: 3 s after the victim's last heartbeat (every 1 s).
    assert rows[1].started_at.timestamp() >= t_kill + 3 - 1.0 - 0.5
    assert jobs[abandoned].status == "SUCCESS"
    first = min(entered)
    before = sorted(k for k in by_key if _instant(k).timestamp() < first - 0.001)
    assert before == [], f"ticks from before the start ran: {before}"
    doubled = [k for k, group in by_key.items() if len(group) > 1 and k != abandoned]
    assert doubled == [], doubled
