"""``acquire_many`` raced by real OS processes over overlapping key sets.

Every contender is a ``tests.acceptance._worker`` process with its own service and connection.
Each round, every process asks for its own random subset of a shared pool of keys, in its own
random order, and all send their statement at one barrier: each key must be won exactly once
(by the database's word and by the processes' answers), no process may raise (a deadlock
between two batches would abort one of them), and the keys nobody asked for have no row. Some
keys start as FAIL rows, expired RUNNING rows or SUCCESS rows, so takeovers race too.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.acceptance.test_lease_processes import (
    Fleet,
    FleetHolder,
    StormStats,
    WorkerError,
    _ensure_schema,
    _seed,
    _sql,
)

pytestmark = pytest.mark.slow

CONTENDERS = 12
KEYS = 60
ROUNDS = 8


@pytest.fixture(scope="module")
def many_fleet_holder() -> Iterator[FleetHolder]:
    holder = FleetHolder(CONTENDERS)
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture
def many_fleet(many_fleet_holder: FleetHolder, pg_dsn: str) -> Iterator[Fleet]:
    fleet = many_fleet_holder.get()
    try:
        yield fleet
    finally:
        if not fleet.broken:
            try:
                fleet.each({"op": "close"}, timeout=30)
            except WorkerError:
                fleet.broken = True


def test_overlapping_batches_win_every_key_exactly_once(many_fleet: Fleet, pg_dsn: str) -> None:
    _ensure_schema(pg_dsn)
    procs = many_fleet.procs[:CONTENDERS]
    assert len(procs) == CONTENDERS, "not enough server connections for the contenders"
    rng = random.Random(1414)
    many_fleet.each({"op": "open", "dsn": pg_dsn, "app": "lease-many"}, procs)
    stats = StormStats("acquire_many")
    try:
        for r in range(ROUNDS):
            code = f"many-{r}"
            keys = [f"k{i:03d}" for i in range(KEYS)]
            # A third of the pool already has a row: FAIL and expired RUNNING rows are takeable,
            # SUCCESS rows are not.
            seeded = {
                "FAIL": _seed(pg_dsn, code, keys[0:8], "FAIL"),
                "STALE": _seed(pg_dsn, code, keys[8:16], "STALE"),
                "ANCIENT_SUCCESS": _seed(pg_dsn, code, keys[16:20], "ANCIENT_SUCCESS"),
            }
            asked: list[list[str]] = []
            for _ in procs:
                subset = rng.sample(keys[:-5], rng.randint(KEYS // 3, KEYS - 5))
                asked.append(subset)  # random order: the statement must not rely on it
            cmds = [
                {
                    "op": "acquire_many",
                    "barrier": True,
                    "items": [{"code": code, "run_key": key, "lease_ms": 60_000} for key in subset],
                }
                for subset in asked
            ]
            replies = many_fleet.race(cmds, procs)
            errors = [reply for reply in replies if "error" in reply]
            assert not errors, f"round {r}: a contender raised: {errors[:2]}"
            winners: Counter[str] = Counter()
            owner: dict[str, str] = {}
            for subset, reply in zip(asked, replies, strict=True):
                results = reply["results"]
                assert len(results) == len(subset)
                stats.latencies.append(float(reply["ms"]))
                for key, result in zip(subset, results, strict=True):
                    if result["acquired"]:
                        winners[key] += 1
                        owner[key] = result["owner_token"]
            wanted = {key for subset in asked for key in subset}
            takeable = wanted - set(keys[16:20])
            assert set(winners) == takeable, (
                f"round {r}: keys won {sorted(set(winners) ^ takeable)}"
            )
            assert max(winners.values()) == 1, f"round {r}: {winners.most_common(3)} won twice"
            stats.runs += len(winners)
            stats.rounds += 1
            rows = _sql(
                pg_dsn,
                "SELECT run_key, status, owner_token::text, fencing_token FROM job_scheduler"
                " WHERE code = %s",
                (code,),
            )
            by_key = {row[0]: row for row in rows}
            assert set(by_key) == wanted | set(keys[:20]), "a key nobody asked for has a row"
            for key in takeable:
                _, status, token, fencing = by_key[key]
                assert status == "RUNNING"
                assert token == owner[key], f"round {r}: {key}'s row names another owner"
                old = seeded["FAIL"].get(key) or seeded["STALE"].get(key)
                if old is not None:
                    assert fencing > old["fencing_token"]
            for key in keys[16:20]:
                assert by_key[key][1] == "SUCCESS"
            fencing_tokens = [row[3] for row in rows]
            assert len(set(fencing_tokens)) == len(fencing_tokens), "a fencing token repeats"
    finally:
        stats.report()
