"""Pool settings, reconnect backoff, pooler error wording and the CLI's pooling switch."""

from __future__ import annotations

import pytest
from psycopg import errors as pg_errors

from sdcore.cli._parser import UsageError, parse_args, transaction_pooling
from sdcore.postgres import PoolSettings, create_pool
from sdcore.postgres._pool import _CappedBackoff
from sdcore.postgres._pooling import pooler_error


def test_defaults_recover_in_about_a_second() -> None:
    settings = PoolSettings()
    assert (settings.reconnect_min_delay_ms, settings.reconnect_max_delay_ms) == (100, 1_000)
    attempt = _CappedBackoff(timeout=300, first=0.1, cap=1.0)
    delays = []
    for step in range(8):
        attempt.update_delay(float(step))
        delays.append(attempt.delay)
    assert 0.09 <= delays[0] <= 0.11
    assert delays[1] == pytest.approx(2 * delays[0])
    assert all(0.9 <= d <= 1.0 for d in delays[4:])  # capped, with a little jitter below
    assert max(delays) <= 1.0
    assert sum(delays) < 6  # psycopg_pool's own 1, 2, 4 … steps: 255 s for 8 attempts


def test_backoff_stops_at_the_reconnect_timeout() -> None:
    attempt = _CappedBackoff(timeout=0.5, first=0.1, cap=1.0)
    attempt.update_delay(0.0)
    attempt.update_delay(0.45)
    assert attempt.delay == pytest.approx(0.05)
    assert attempt.time_to_give_up(0.6)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("min_size", -1, ValueError),
        ("max_size", 0, ValueError),
        ("min_size", True, TypeError),
        ("connect_timeout", 0, ValueError),
        ("open_timeout_ms", 1.5, TypeError),
        ("reconnect_min_delay_ms", 0, ValueError),
        ("reconnect_max_delay_ms", 10**7, ValueError),
        ("transaction_pooling", "yes", TypeError),
    ],
    ids=lambda v: repr(v),
)
def test_bad_settings_are_refused(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=field):
        PoolSettings(**{field: value})  # type: ignore[arg-type]


def test_min_delay_above_max_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="reconnect_min_delay_ms"):
        PoolSettings(reconnect_min_delay_ms=2_000, reconnect_max_delay_ms=1_000)


def test_connection_kwargs() -> None:
    pooled = PoolSettings(transaction_pooling=True).connection_kwargs("dbname=x")
    assert pooled["prepare_threshold"] is None
    assert pooled["connect_timeout"] == 10
    direct = PoolSettings(connect_timeout=3).connection_kwargs("dbname=x connect_timeout=7")
    assert "prepare_threshold" not in direct
    assert direct["connect_timeout"] == 3
    assert "connect_timeout" not in PoolSettings().connection_kwargs("dbname=x connect_timeout=7")


def test_a_bad_dsn_is_refused_without_repeating_it() -> None:
    with pytest.raises(ValueError, match="not a valid") as caught:
        create_pool("host=x password='s3cret")
    assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize(
    "error",
    [
        pg_errors.ProtocolViolation("bind message supplies 8 parameters"),
        pg_errors.InvalidSqlStatementName('prepared statement "_pg3_0" does not exist'),
        pg_errors.DuplicatePreparedStatement('prepared statement "_pg3_0" already exists'),
    ],
    ids=["08P01", "26000", "42P05"],
)
def test_pooler_errors_name_the_cause_and_the_switch(error: pg_errors.Error) -> None:
    better = pooler_error(error, transaction_pooling=False)
    assert better is not None
    assert type(better) is type(error)
    assert better.sqlstate == error.sqlstate
    assert "transaction_pooling=True" in str(better)
    assert "SDCORE_TRANSACTION_POOLING=1" in str(better)
    assert str(error) in str(better)
    pooled = pooler_error(error, transaction_pooling=True)
    assert pooled is not None
    assert "another client" in str(pooled)


def test_other_errors_are_left_alone() -> None:
    assert pooler_error(pg_errors.UniqueViolation("dup"), transaction_pooling=False) is None


@pytest.mark.parametrize(
    ("option", "env", "expected"),
    [
        (None, {}, False),
        (True, {}, True),
        (None, {"SDCORE_TRANSACTION_POOLING": "1"}, True),
        (None, {"SDCORE_TRANSACTION_POOLING": "TRUE"}, True),
        (None, {"SDCORE_TRANSACTION_POOLING": "0"}, False),
        (True, {"SDCORE_TRANSACTION_POOLING": "0"}, True),
    ],
)
def test_cli_transaction_pooling_switch(
    option: bool | None, env: dict[str, str], expected: bool
) -> None:
    assert transaction_pooling(option, env) is expected


def test_cli_transaction_pooling_env_typo_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="SDCORE_TRANSACTION_POOLING"):
        transaction_pooling(None, {"SDCORE_TRANSACTION_POOLING": "ja"})


def test_cli_relay_accepts_the_flag() -> None:
    args = parse_args(["relay", "--transaction-pooling", "--redis-url", "redis://x"])
    assert args.transaction_pooling is True
    assert parse_args(["relay"]).transaction_pooling is None
