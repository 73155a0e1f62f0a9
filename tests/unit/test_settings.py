"""The settings objects of Runtime and JobSchedulerService.connect, and the 0.1 keywords' path."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import pytest

import sdcore.job_scheduler._service as service_module
from sdcore.fastapi import Sdcore
from sdcore.job_scheduler import JobSchedulerService
from sdcore.outbox import DEFAULT_RELAY_BATCH_BYTES, DEFAULT_RELAY_BATCH_SIZE, RelaySettings
from sdcore.postgres import PoolSettings
from sdcore.probes import DEFAULT_RELAY_STUCK_AFTER_S
from sdcore.runtime import Runtime
from sdcore.scheduling import ControlSettings, SchedulingSettings

DSN = "postgresql://app@127.0.0.1:1/app"
SETTINGS = (PoolSettings, RelaySettings, SchedulingSettings, ControlSettings)


def _configuration(runtime: Runtime) -> dict[str, object]:
    return {
        "pool": runtime.pool_settings,
        "relay": runtime.relay_settings,
        "scheduling": runtime.scheduling_settings,
        "control": runtime.control_settings,
        "listen": runtime.relay_listen_url,
        "stuck": runtime.relay_stuck_after_s,
        "runs": (runtime.run_relay, runtime.run_scheduler, runtime.run_schedule_control),
        "max_connections": runtime.jobs.max_connections,
    }


# --- defaults -------------------------------------------------------------------------------


def test_the_defaults_are_the_runtimes_defaults_of_0_1() -> None:
    assert dataclasses.asdict(PoolSettings()) == {
        "min_size": 1,
        "max_size": 10,
        "application_name": "sdcore",
        "transaction_pooling": False,
        "connect_timeout": None,
        "open_timeout_ms": 30_000,
        "reconnect_min_delay_ms": 100,
        "reconnect_max_delay_ms": 1_000,
        "reconnect_timeout_ms": 300_000,
    }
    assert RelaySettings() == RelaySettings(
        batch_size=DEFAULT_RELAY_BATCH_SIZE,
        batch_bytes=DEFAULT_RELAY_BATCH_BYTES,
        listen_url=None,
        stuck_after_s=DEFAULT_RELAY_STUCK_AFTER_S,
    )
    assert dataclasses.asdict(SchedulingSettings()) == {"time_zone": "UTC", "lease_ms": 300_000}
    assert dataclasses.asdict(ControlSettings()) == {
        "listen": True,
        "poll_interval_ms": 1_000,
        "heartbeat_ms": 5_000,
    }


def test_a_default_runtime_runs_everything_with_the_default_settings() -> None:
    runtime = Runtime(DSN, redis_url="redis://127.0.0.1:1/0")
    assert runtime.pool_settings == PoolSettings()
    assert runtime.relay_settings == RelaySettings()
    assert runtime.scheduling_settings == SchedulingSettings()
    assert runtime.control_settings == ControlSettings()
    assert (runtime.run_relay, runtime.run_scheduler, runtime.run_schedule_control) == (
        True,
        True,
        True,
    )
    assert runtime.jobs.max_connections == 5
    assert runtime.relay_stuck_after_s == DEFAULT_RELAY_STUCK_AFTER_S


def test_none_turns_a_component_off() -> None:
    runtime = Runtime(DSN, relay=None, scheduling=None, control=None)
    assert (runtime.relay_settings, runtime.scheduling_settings, runtime.control_settings) == (
        None,
        None,
        None,
    )
    assert (runtime.run_relay, runtime.run_scheduler, runtime.run_schedule_control) == (
        False,
        False,
        False,
    )


def test_settings_are_reported_only_for_what_runs() -> None:
    # The control plane controls this process's scheduler; the relay needs a Redis to relay to.
    runtime = Runtime(DSN, scheduling=None, control=ControlSettings(poll_interval_ms=50))
    assert runtime.control_settings is None
    assert not runtime.run_scheduler
    assert Runtime(DSN, relay=RelaySettings(batch_size=10)).relay_settings is None
    with_redis = Runtime(DSN, redis_url="redis://127.0.0.1:1/0", relay=RelaySettings(batch_size=9))
    assert with_redis.relay_settings == RelaySettings(batch_size=9)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"database_url": 5}, TypeError, "database_url must be a non-blank str, got 5"),
        ({"database_url": " "}, ValueError, "database_url must be a non-blank str, got ' '"),
        ({"redis_url": 5}, TypeError, "redis_url must be a str, got 5"),
        ({"ensure_schema": "no"}, TypeError, "ensure_schema must be a bool, got 'no'"),
        ({"queue_prefix": ""}, ValueError, "queue_prefix must be a non-empty str, got ''"),
        ({"grace_period_ms": True}, TypeError, "grace_period_ms must be an int from 0 to"),
        ({"grace_period_ms": -1}, ValueError, "grace_period_ms must be an int from 0 to"),
        ({"outbox": "x"}, TypeError, "outbox must be an Outbox or None, got 'x'"),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, dict) else None,
)
def test_the_runtimes_own_keywords_are_checked_before_anything_opens(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        Runtime(**{"database_url": DSN, **kwargs})


def test_the_settings_reach_the_components() -> None:
    runtime = Runtime(
        DSN,
        pool=PoolSettings(max_size=6, transaction_pooling=True, application_name="billing"),
        relay=RelaySettings(listen_url="postgresql://app@db/app", stuck_after_s=5),
        scheduling=SchedulingSettings(time_zone="Europe/Paris"),
    )
    assert runtime.jobs.max_connections == 3
    assert runtime.transaction_pooling is True
    assert runtime.relay_listen_url == "postgresql://app@db/app"
    assert runtime.relay_stuck_after_s == 5.0
    assert runtime.schedule_store.transaction_pooling is True  # a pooler implies polling


# --- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", SETTINGS, ids=lambda k: k.__name__)
def test_settings_are_frozen_slotted_keyword_only_values(kind: type[Any]) -> None:
    value = kind()
    field = dataclasses.fields(value)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field, getattr(value, field))
    assert not hasattr(value, "__dict__")
    assert value == kind()
    assert hash(value) == hash(kind())
    with pytest.raises(TypeError):
        kind(getattr(value, field))


REFUSED: list[tuple[type[Any], str, object]] = [
    (PoolSettings, "min_size", -1),
    (PoolSettings, "min_size", True),
    (PoolSettings, "max_size", 0),
    (PoolSettings, "max_size", "10"),
    (PoolSettings, "application_name", 7),
    (PoolSettings, "transaction_pooling", "yes"),
    (PoolSettings, "connect_timeout", 0),
    (PoolSettings, "open_timeout_ms", 1.5),
    (PoolSettings, "reconnect_min_delay_ms", 0),
    (PoolSettings, "reconnect_max_delay_ms", 10**7),
    (PoolSettings, "reconnect_timeout_ms", 0),
    (RelaySettings, "batch_size", 0),
    (RelaySettings, "batch_size", False),
    (RelaySettings, "batch_bytes", -5),
    (RelaySettings, "listen_url", ""),
    (RelaySettings, "listen_url", b"postgresql://x"),
    (RelaySettings, "stuck_after_s", 0),
    (RelaySettings, "stuck_after_s", float("nan")),
    (RelaySettings, "stuck_after_s", True),
    (SchedulingSettings, "time_zone", "Mars/Olympus"),
    (SchedulingSettings, "time_zone", ""),
    (SchedulingSettings, "time_zone", None),
    (SchedulingSettings, "lease_ms", 2),
    (ControlSettings, "listen", 1),
    (ControlSettings, "poll_interval_ms", 9),
    (ControlSettings, "heartbeat_ms", 3_600_001),
]


@pytest.mark.parametrize(("kind", "field", "value"), REFUSED, ids=lambda v: repr(v)[:30])
def test_every_refusal_names_the_field_and_the_value(
    kind: type[Any], field: str, value: object
) -> None:
    with pytest.raises((ValueError, TypeError)) as caught:
        kind(**{field: value})
    message = str(caught.value)
    assert message.startswith(f"{field} must be "), message
    assert f"got {value!r:.40}" in message or f"got {type(value).__name__} {value!r:.40}" in (
        message
    ), message


def test_related_fields_are_checked_together() -> None:
    with pytest.raises(ValueError, match=r"^min_size must be at most max_size \(2\), got 3$"):
        PoolSettings(min_size=3, max_size=2)
    with pytest.raises(ValueError, match=r"^reconnect_min_delay_ms must be at most"):
        PoolSettings(reconnect_min_delay_ms=2_000, reconnect_max_delay_ms=1_000)


def test_the_runtime_refuses_a_pool_it_would_exhaust_and_a_wrong_settings_type() -> None:
    with pytest.raises(ValueError, match=r"pool\.max_size must be at least 2, got 1"):
        Runtime(DSN, pool=PoolSettings(max_size=1))
    with pytest.raises(TypeError, match="pool must be a PoolSettings"):
        Runtime(DSN, pool={"max_size": 4})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scheduling must be a SchedulingSettings or None"):
        Runtime(DSN, scheduling="UTC")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="relay must be a RelaySettings or None"):
        Runtime(DSN, relay=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'pool_size'"):
        Runtime(DSN, pool_size=4)  # type: ignore[call-arg]


# --- the 0.1 keywords -----------------------------------------------------------------------

# old keyword, its value, the new spelling the warning names, the same configuration spelled anew
MOVED: list[tuple[str, object, str, dict[str, Any]]] = [
    ("pool_min_size", 2, "pool=PoolSettings(min_size=…)", {"pool": PoolSettings(min_size=2)}),
    ("pool_max_size", 4, "pool=PoolSettings(max_size=…)", {"pool": PoolSettings(max_size=4)}),
    (
        "transaction_pooling",
        True,
        "pool=PoolSettings(transaction_pooling=…)",
        {"pool": PoolSettings(transaction_pooling=True)},
    ),
    (
        "connect_timeout",
        3,
        "pool=PoolSettings(connect_timeout=…)",
        {"pool": PoolSettings(connect_timeout=3)},
    ),
    (
        "reconnect_min_delay_ms",
        50,
        "pool=PoolSettings(reconnect_min_delay_ms=…)",
        {"pool": PoolSettings(reconnect_min_delay_ms=50)},
    ),
    (
        "reconnect_max_delay_ms",
        2_000,
        "pool=PoolSettings(reconnect_max_delay_ms=…)",
        {"pool": PoolSettings(reconnect_max_delay_ms=2_000)},
    ),
    (
        "reconnect_timeout_ms",
        60_000,
        "pool=PoolSettings(reconnect_timeout_ms=…)",
        {"pool": PoolSettings(reconnect_timeout_ms=60_000)},
    ),
    (
        "application_name",
        "billing",
        "pool=PoolSettings(application_name=…)",
        {"pool": PoolSettings(application_name="billing")},
    ),
    (
        "relay_batch_size",
        50,
        "relay=RelaySettings(batch_size=…)",
        {"relay": RelaySettings(batch_size=50)},
    ),
    (
        "relay_batch_bytes",
        1_024,
        "relay=RelaySettings(batch_bytes=…)",
        {"relay": RelaySettings(batch_bytes=1_024)},
    ),
    (
        "relay_listen_url",
        "postgresql://app@db/app",
        "relay=RelaySettings(listen_url=…)",
        {"relay": RelaySettings(listen_url="postgresql://app@db/app")},
    ),
    ("relay_listen_url", "", "relay=RelaySettings(listen_url=…)", {}),
    (
        "relay_stuck_after_s",
        5.0,
        "relay=RelaySettings(stuck_after_s=…)",
        {"relay": RelaySettings(stuck_after_s=5.0)},
    ),
    (
        "time_zone",
        "Europe/Paris",
        "scheduling=SchedulingSettings(time_zone=…)",
        {"scheduling": SchedulingSettings(time_zone="Europe/Paris")},
    ),
    (
        "schedules_listen",
        False,
        "control=ControlSettings(listen=…)",
        {"control": ControlSettings(listen=False)},
    ),
    ("relay", True, "relay=RelaySettings()", {}),
    ("relay", False, "relay=None", {"relay": None}),
    ("scheduler", True, "scheduling=SchedulingSettings()", {}),
    ("scheduler", False, "scheduling=None", {"scheduling": None}),
    ("schedule_control", True, "control=ControlSettings()", {}),
    ("schedule_control", False, "control=None", {"control": None}),
]


@pytest.mark.parametrize(
    ("old", "value", "spelling", "new"), MOVED, ids=lambda v: str(v)[:30] if v != {} else "-"
)
def test_each_old_keyword_warns_with_the_new_spelling_and_means_the_same(
    old: str, value: Any, spelling: str, new: dict[str, Any]
) -> None:
    shown = f"{value}" if spelling.endswith(("()", "None")) else "…"
    expected = f"Runtime({old}={shown}) is deprecated: use Runtime({spelling})"
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(expected)}$") as caught:
        runtime = Runtime(DSN, **{old: value})
    assert len(caught) == 1
    assert caught[0].filename == __file__  # it points at the caller's line
    assert _configuration(runtime) == _configuration(Runtime(DSN, **new))


def test_several_old_keywords_warn_once_each_and_build_one_configuration() -> None:
    with pytest.warns(DeprecationWarning, match="is deprecated: use Runtime") as caught:
        runtime = Runtime(
            database_url=DSN,
            pool_max_size=4,
            application_name="api",
            relay=False,
            scheduler=False,
            time_zone="Europe/Paris",
        )
    assert len(caught) == 5
    new = Runtime(
        database_url=DSN,
        pool=PoolSettings(max_size=4, application_name="api"),
        relay=None,
        scheduling=None,
    )
    assert _configuration(runtime) == _configuration(new)


def test_the_old_pool_minimum_is_still_taken_down_to_the_maximum() -> None:
    with pytest.warns(DeprecationWarning, match=r"Runtime\(pool_m.._size=…\)"):
        runtime = Runtime(DSN, pool_min_size=5, pool_max_size=3)
    assert runtime.pool_settings == PoolSettings(min_size=3, max_size=3)


def test_an_old_keywords_bad_value_names_the_new_field() -> None:
    with (
        pytest.warns(DeprecationWarning, match="relay_batch_size"),
        pytest.raises(ValueError, match=r"^batch_size must be an int from 1 to 100000, got 0"),
    ):
        Runtime(DSN, relay_batch_size=0)
    with (
        pytest.warns(DeprecationWarning, match="pool_max_size"),
        pytest.raises(ValueError, match=r"pool\.max_size must be at least 2"),
    ):
        Runtime(DSN, pool_max_size=1)


MIXED: list[tuple[str, object, dict[str, Any]]] = [
    ("pool_max_size", 4, {"pool": PoolSettings(max_size=4)}),
    ("transaction_pooling", True, {"pool": PoolSettings()}),
    ("relay_batch_size", 50, {"relay": RelaySettings()}),
    ("relay_batch_size", 50, {"relay": None}),
    ("time_zone", "UTC", {"scheduling": SchedulingSettings()}),
    ("time_zone", "UTC", {"scheduling": None}),
    ("schedules_listen", True, {"control": ControlSettings()}),
    ("scheduler", False, {"scheduling": SchedulingSettings()}),
    ("schedule_control", True, {"control": None}),
]


@pytest.mark.parametrize(("old", "value", "new"), MIXED, ids=lambda v: str(v)[:30])
def test_an_old_keyword_beside_its_settings_object_is_refused(
    old: str, value: Any, new: dict[str, Any]
) -> None:
    (group,) = new
    expected = f"Runtime({old}=…) cannot be combined with Runtime({group}=…)"
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}"):
        Runtime(DSN, **new, **{old: value})


def test_sdcore_names_itself_in_the_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"^Sdcore\(pool_max_size=…\) is deprecated"):
        Sdcore(DSN, pool_max_size=4)


def test_the_new_spelling_warns_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Runtime(
            DSN,
            pool=PoolSettings(max_size=4),
            relay=RelaySettings(batch_size=10),
            scheduling=SchedulingSettings(time_zone="Europe/Paris"),
            control=ControlSettings(listen=False),
        )


# --- JobSchedulerService.connect ------------------------------------------------------------


class _Stop(Exception):
    pass


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> list[PoolSettings]:
    """The settings ``connect`` builds its pool with (it stops there, before any socket)."""
    built: list[PoolSettings] = []

    def create_pool(dsn: str, settings: PoolSettings) -> None:
        built.append(settings)
        raise _Stop

    monkeypatch.setattr(service_module, "create_pool", create_pool)
    return built


async def _connect(**options: Any) -> None:
    with pytest.raises(_Stop):
        async with JobSchedulerService.connect(DSN, **options):
            pass


async def test_connect_defaults_to_a_pool_of_four(pools: list[PoolSettings]) -> None:
    await _connect()
    await _connect(pool=PoolSettings(max_size=4, application_name="x"))
    assert pools == [PoolSettings(max_size=4), PoolSettings(max_size=4, application_name="x")]


CONNECT_MOVED = [
    ("min_size", 2),
    ("max_size", 2),
    ("application_name", "replica-a"),
    ("transaction_pooling", True),
    ("connect_timeout", 3),
    ("open_timeout_ms", 1_500),
    ("reconnect_min_delay_ms", 50),
    ("reconnect_max_delay_ms", 2_000),
    ("reconnect_timeout_ms", 60_000),
]


@pytest.mark.parametrize(("old", "value"), CONNECT_MOVED, ids=lambda v: str(v))
async def test_connects_old_pool_keywords_warn_and_mean_the_same(
    pools: list[PoolSettings], old: str, value: Any
) -> None:
    four = "" if old == "max_size" else "max_size=4, "
    expected = (
        f"JobSchedulerService.connect({old}=…) is deprecated: use "
        f"JobSchedulerService.connect(pool=PoolSettings({four}{old}=…))"
    )
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(expected)}$") as caught:
        await _connect(**{old: value})
    assert caught[0].filename == __file__
    assert pools == [dataclasses.replace(PoolSettings(max_size=4), **{old: value})]


async def test_connect_refuses_an_old_keyword_beside_pool(pools: list[PoolSettings]) -> None:
    with pytest.raises(TypeError, match=r"connect\(max_size=…\) cannot be combined with"):
        await _connect(pool=PoolSettings(), max_size=2)
    with pytest.raises(TypeError, match="pool must be a PoolSettings"):
        await _connect(pool=4)
    assert pools == []
