"""The dashboard's guards on a fake clock: the sign-in throttle's window and budgets, the bound of
the revoked sessions, the queue list's lifetime and SCAN budget, token entropy, Host parsing,
and the warning about a password on ``sdcore dashboard``'s command line."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest

from sdcore.cli._dashboard import _warn_secrets_in_argv
from sdcore.cli._main import main
from sdcore.dashboard import DashboardError
from sdcore.dashboard._auth import (
    LoginThrottle,
    Revocations,
    Session,
    check_token,
    token_bits,
)
from sdcore.dashboard._data import QueueNames, QueueRow, QueueView
from sdcore.dashboard._guard import host_name


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_client_is_throttled_until_its_oldest_failure_leaves_the_window() -> None:
    clock = Clock()
    throttle = LoginThrottle(per_client=3, overall=100, window_s=60, clock=clock)
    for n in range(3):
        assert throttle.retry_after("10.0.0.1") is None
        assert throttle.failed("10.0.0.1") == n + 1
        clock.now += 10
    assert throttle.retry_after("10.0.0.1") == 30  # the first failure is 30 s from leaving
    assert throttle.retry_after("10.0.0.2") is None, "another client is not held"
    clock.now += 30
    assert throttle.retry_after("10.0.0.1") is None
    assert throttle.failed("10.0.0.1") == 3, "two failures were still in the window"


def test_the_overall_budget_holds_every_client_that_failed() -> None:
    clock = Clock()
    throttle = LoginThrottle(per_client=10, overall=5, window_s=60, clock=clock)
    for n in range(5):
        throttle.failed(f"10.0.0.{n}")
    assert throttle.retry_after("10.0.0.0") == 60
    assert throttle.retry_after("10.0.0.4") == 60
    assert throttle.retry_after("192.0.2.1") is None, "a client without failures gets its try"
    throttle.failed("192.0.2.1")
    assert throttle.retry_after("192.0.2.1") == 60, "then is held too"
    clock.now += 60
    assert throttle.retry_after("10.0.0.0") is None


def test_revocations_are_bounded_and_drop_the_expired_first() -> None:
    clock = Clock()
    revoked = Revocations(limit=3, clock=clock)
    sessions = [Session(sid=f"s{n}", actor="a", expires=int(clock.now) + n) for n in range(4)]
    old = Session(sid="old", actor="a", expires=int(clock.now) - 1)
    revoked.revoke(old)
    for session in sessions[:3]:
        revoked.revoke(session)
    assert old not in revoked, "the expired one went first"
    assert all(session in revoked for session in sessions[:3])
    revoked.revoke(sessions[3])
    assert sessions[0] not in revoked, "then the one expiring soonest"
    assert all(session in revoked for session in sessions[1:])


class FakeRedis:
    """SCAN over a fixed key list, ``count`` keys per call."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.calls = 0

    async def scan(self, *, cursor: int, match: str, count: int) -> tuple[int, list[Any]]:
        self.calls += 1
        page = self.keys[cursor : cursor + count]
        following = cursor + count
        return (0 if following >= len(self.keys) else following), [k.encode() for k in page]


async def test_the_queue_list_is_walked_once_per_lifetime() -> None:
    clock = Clock()
    keys = [f"bull:jobs:{n}" for n in range(95)] + ["bull:mails:meta", "bull:a:b:wait"]
    redis = FakeRedis(keys)
    names = QueueNames(ttl_s=60, count=10, clock=clock)
    assert await names.get(redis, "bull") == ["a:b", "mails"]
    assert (redis.calls, names.partial) == (10, False)
    clock.now += 59
    await names.get(redis, "bull")
    assert redis.calls == 10, "kept"
    clock.now += 1
    await names.get(redis, "bull")
    assert redis.calls == 20, "walked again"


async def test_the_walk_stops_at_its_budget() -> None:
    redis = FakeRedis([*(f"bull:jobs:{n}" for n in range(1000)), "bull:late:meta"])
    names = QueueNames(max_calls=5, count=10)
    assert await names.get(redis, "bull") == []
    assert (redis.calls, names.partial) == (5, True)


@pytest.mark.parametrize(
    "token", ["a" * 16, " " * 20 + "b" * 16, "password12345678", "changemechangeme"]
)
def test_predictable_tokens_are_refused(token: str) -> None:
    with pytest.raises(DashboardError, match=r"too predictable|at least 16"):
        check_token(token)


@pytest.mark.parametrize(
    "token",
    [
        "password" * 5,
        "changeme" * 4,
        "passw0rd!" * 3,
        "\U0001f600" * 16,
        "".join(chr(0x1F600 + n) for n in range(16)),
        "abcdefghijklmnopqrstuvwxyz",
        "0123456789abcdefghij",
        "zyxwvutsrqponmlkjihgfedcba9876543210",
    ],
    ids=[
        "password-x5",
        "changeme-x4",
        "passw0rd!-x3",
        "one-emoji",
        "emoji-run",
        "alphabet",
        "digits-letters",
        "backwards",
    ],
)
def test_long_repeats_runs_and_multibyte_characters_are_predictable(token: str) -> None:
    assert token_bits(token) < 40
    with pytest.raises(DashboardError, match="too predictable"):
        check_token(token)


def test_random_tokens_pass() -> None:
    import secrets

    for _ in range(200):
        assert check_token(secrets.token_urlsafe(32)) is not None
        assert check_token(secrets.token_hex(16)) is not None
    # Fixed draws of token_urlsafe(16), including ones with chance repeats of 3 characters.
    for token in ("Zq8v3XkP0aLmTT9wq1rXXb", "gAvXhxq6lqALmq6lgqh-6A", "xnkONjTC6kONfjrJXXkfNg"):
        assert check_token(token) == token
    assert token_bits("a" * 40) == 0


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:8089", "127.0.0.1"),
        ("LocalHost", "localhost"),
        ("[::1]:8089", "::1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("dash.example.com:443", "dash.example.com"),
        ("", ""),
    ],
)
def test_host_names(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize(
    ("option", "url"),
    [
        ("--redis-url", "redis://127.0.0.1:6379/0?password=S3cret-redis"),
        ("--redis-url", "rediss://cache.internal:6380?ssl_cert_reqs=none&password=S3cret-redis"),
        ("--redis-url", "unix:///run/redis.sock?db=1&password=S3cret-redis"),
        ("--redis-url", "redis://:S3cret-redis@127.0.0.1:6379"),
        ("--database-url", "postgresql://127.0.0.1/app?password=S3cret-pg"),
        ("--database-url", "host=127.0.0.1 dbname=app password=S3cret-pg"),
    ],
)
def test_a_password_anywhere_in_a_url_argument_is_warned_about(
    option: str, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(database_url=None, redis_url=None)
    setattr(args, option.removeprefix("--").replace("-", "_"), url)
    _warn_secrets_in_argv(args)
    err = capsys.readouterr().err
    assert f"warning: {option} holds a password" in err
    assert "S3cret" not in err


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0?db=2&password=", "redis://x@h"]
)
def test_a_redis_url_without_a_password_is_not_warned_about(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _warn_secrets_in_argv(argparse.Namespace(database_url=None, redis_url=url))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--allowed-host", ""], "--allowed-host"),
        (["--allowed-host", "dash example"], "--allowed-host"),
        (["--allowed-host", "http://dash.example.com/"], "--allowed-host"),
        (["--queue-prefix", ""], "--queue-prefix"),
        # The default prefix "bull" on a cluster: no queue can live there.
        (["--redis-url", "redis+cluster://127.0.0.1:1"], "--queue-prefix: on Redis Cluster"),
    ],
)
def test_bad_dashboard_options_are_usage_errors_naming_the_option(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # No database is reached: the options are refused while parsing.
    status = main(["dashboard", "--database-url", "postgresql://127.0.0.1:1/x", *args])
    err = capsys.readouterr().err
    assert status == 2, err
    assert named in err
    assert "SDCORE_DASHBOARD_TOKEN" not in err


async def test_queue_rows_and_errors_are_shared_for_their_lifetime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sdcore.dashboard._data as data

    reads: list[str] = []
    outcome: list[object] = [ConnectionError("Redis is down")]

    async def counts(url: str, prefix: str, *, names: QueueNames) -> list[QueueRow]:
        reads.append(url)
        await asyncio.sleep(0.01)  # the other views queue up meanwhile
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return [QueueRow(name="mails", counts={})]

    monkeypatch.setattr(data, "queue_counts", counts)
    clock = Clock()
    view = QueueView(QueueNames(), ttl_s=2.0, clock=clock)
    failed = await asyncio.gather(
        *(view.get("redis://x", "bull") for _ in range(20)), return_exceptions=True
    )
    assert all(isinstance(f, ConnectionError) for f in failed)
    assert len(reads) == 1, "a Redis that is down is tried once, not once per waiting view"
    outcome[0] = "up"
    clock.now += 1.9
    with pytest.raises(ConnectionError):
        await view.get("redis://x", "bull")
    clock.now += 0.2
    rows = await asyncio.gather(*(view.get("redis://x", "bull") for _ in range(20)))
    assert [r[0].name for r in rows] == ["mails"] * 20
    assert len(reads) == 2
