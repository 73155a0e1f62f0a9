"""Tick computation over real zone data: DST days, 5/6 fields, macros, grids, run keys."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcore.scheduling import CronExpression, InvalidScheduleError, format_run_key
from sdcore.scheduling._catch_up import latest_instants
from sdcore.scheduling._cron import CronSpec
from sdcore.scheduling._triggers import CronTrigger, IntervalTrigger, expected_instants

PARIS = ZoneInfo("Europe/Paris")
# Hypothesis takes naive bounds and attaches the zone itself.
_NAIVE_2000, _NAIVE_2020 = datetime(2000, 1, 1), datetime(2020, 1, 1)  # noqa: DTZ001
_NAIVE_2035, _NAIVE_2100 = datetime(2035, 1, 1), datetime(2100, 1, 1)  # noqa: DTZ001
NEW_YORK = ZoneInfo("America/New_York")


def _day(expression: str, zone: ZoneInfo, day: str) -> list[str]:
    """Local fire times on one local day (a * marks the second copy of a repeated hour)."""
    spec = CronSpec.parse(expression, zone)
    start = datetime.fromisoformat(day).replace(tzinfo=zone)
    end = start + timedelta(days=1, hours=1)
    out = []
    for instant in expected_instants(
        CronTrigger(spec), start.astimezone(UTC), end.astimezone(UTC), limit=10_000
    ):
        local = instant.astimezone(zone)
        if local.date().isoformat() == day:
            out.append(local.strftime("%H:%M:%S") + ("*" if local.fold else ""))
    return out


@pytest.mark.parametrize("expression", ["30 2 * * *", "0 30 2 * * *"], ids=["5-field", "6-field"])
def test_paris_spring_forward_fixed_time_runs_once_when_the_gap_ends(expression: str) -> None:
    assert _day(expression, PARIS, "2026-03-29") == ["03:00:00"]
    assert _day(expression, PARIS, "2026-03-30") == ["02:30:00"]


@pytest.mark.parametrize("expression", ["30 2 * * *", "0 30 2 * * *"], ids=["5-field", "6-field"])
def test_paris_fall_back_fixed_time_runs_once(expression: str) -> None:
    assert _day(expression, PARIS, "2026-10-25") == ["02:30:00"]


def test_paris_hourly_on_dst_days() -> None:
    spring = _day("0 * * * *", PARIS, "2026-03-29")
    assert len(spring) == 23
    assert "02:00:00" not in spring
    autumn = _day("0 * * * *", PARIS, "2026-10-25")
    assert len(autumn) == 25
    assert autumn[:5] == ["00:00:00", "01:00:00", "02:00:00", "02:00:00*", "03:00:00"]


def test_paris_quarter_hours_on_dst_days() -> None:
    assert len(_day("*/15 * * * *", PARIS, "2026-03-29")) == 92
    autumn = _day("*/15 * * * *", PARIS, "2026-10-25")
    assert len(autumn) == 100
    assert autumn[8:17] == [
        "02:00:00",
        "02:15:00",
        "02:30:00",
        "02:45:00",
        "02:00:00*",
        "02:15:00*",
        "02:30:00*",
        "02:45:00*",
        "03:00:00",
    ]


def test_new_york() -> None:
    assert _day("30 2 * * *", NEW_YORK, "2026-03-08") == ["03:00:00"]
    assert _day("30 2 * * *", NEW_YORK, "2026-11-01") == ["02:30:00"]
    assert _day("30 1 * * *", NEW_YORK, "2026-11-01") == ["01:30:00"]
    assert _day("30 * * * *", NEW_YORK, "2026-11-01")[:4] == [
        "00:30:00",
        "01:30:00",
        "01:30:00*",
        "02:30:00",
    ]
    assert len(_day("0 * * * *", NEW_YORK, "2026-03-08")) == 23
    assert len(_day("*/15 * * * *", NEW_YORK, "2026-11-01")) == 100


def test_six_field_seconds_across_the_repeated_hour() -> None:
    spec = CronSpec.parse("*/30 * * * * *", PARIS)
    start = datetime(2026, 10, 25, 0, 59, 0, tzinfo=UTC)
    ticks = expected_instants(CronTrigger(spec), start, start + timedelta(minutes=2), limit=100)
    assert len(ticks) == 4
    assert all(b - a == timedelta(seconds=30) for a, b in itertools.pairwise(ticks))


def test_zones_with_odd_dst_do_not_loop() -> None:
    for zone, day in [
        ("Australia/Lord_Howe", "2026-04-05"),
        ("Australia/Lord_Howe", "2026-10-04"),
        ("Asia/Kolkata", "2026-03-29"),
    ]:
        assert len(_day("*/30 * * * *", ZoneInfo(zone), day)) in (46, 47, 48, 49, 50)
        assert len(_day("30 1 * * *", ZoneInfo(zone), day)) == 1


def test_nestjs_constants_have_the_nestjs_values() -> None:
    values = {member.name: str(member) for member in CronExpression}
    assert values["EVERY_DAY_AT_1AM"] == "0 01 * * *"
    assert values["EVERY_30_SECONDS"] == "*/30 * * * * *"
    assert values["EVERY_SECOND"] == "* * * * * *"
    assert values["MONDAY_TO_FRIDAY_AT_09_30AM"] == "0 30 09 * * 1-5"
    assert len(values) == 84
    for member in CronExpression:
        CronSpec.parse(member, PARIS)


def test_seed_spring_expression_matches_nestjs_one() -> None:
    nest = _day(CronExpression.EVERY_DAY_AT_1AM, PARIS, "2026-07-01")
    spring = _day("0 0 1 * * *", PARIS, "2026-07-01")
    assert nest == spring == ["01:00:00"]


@pytest.mark.parametrize(
    ("macro", "equivalent"),
    [
        ("@daily", "0 0 * * *"),
        ("@hourly", "0 * * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
        ("@midnight", "0 0 * * *"),
    ],
)
def test_macros(macro: str, equivalent: str) -> None:
    after = datetime(2026, 5, 17, 13, 7, tzinfo=UTC)
    assert CronSpec.parse(macro, PARIS).next_after(after) == CronSpec.parse(
        equivalent, PARIS
    ).next_after(after)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("61 * * * *", "minute"),
        ("* 24 * * *", "hour"),
        ("0 0 31 2 *", "day-of-month"),
        ("0 0 30 2 *", "day-of-month"),
        ("", "5 fields"),
        ("* * * *", "5 fields"),
        ("* * * * * * *", "5 fields"),
        ("@reboot", "5 fields"),
        ("x" * 2000, "too long"),
        ("0 0 * * 8", "day-of-week"),
    ],
)
def test_invalid_and_never_firing_expressions_are_rejected(expression: str, message: str) -> None:
    with pytest.raises(InvalidScheduleError, match=message):
        CronSpec.parse(expression, PARIS, "job")


def test_non_string_expression() -> None:
    with pytest.raises(InvalidScheduleError, match="must be a str"):
        CronSpec.parse(5, PARIS)


def test_interval_grid_is_shared_from_the_epoch() -> None:
    trigger = IntervalTrigger(60_000)
    after = datetime(2026, 7, 20, 3, 0, 59, 999_000, tzinfo=UTC)
    assert trigger.next_after(after) == datetime(2026, 7, 20, 3, 1, tzinfo=UTC)
    assert trigger.next_after(datetime(2026, 7, 20, 3, 1, tzinfo=UTC)) == datetime(
        2026, 7, 20, 3, 2, tzinfo=UTC
    )
    assert trigger.run_key(datetime(2026, 7, 20, 3, 1, tzinfo=UTC)) == "2026-07-20T03:01:00Z"
    sub = IntervalTrigger(250)
    first = sub.next_after(after)
    assert first == datetime(2026, 7, 20, 3, 1, tzinfo=UTC)
    assert sub.run_key(sub.next_after(first) or first) == "2026-07-20T03:01:00.250Z"


@settings(max_examples=200)
@given(
    st.datetimes(min_value=_NAIVE_2000, max_value=_NAIVE_2100, timezones=st.just(UTC)),
    st.integers(min_value=1, max_value=10**8),
)
def test_interval_ticks_are_grid_points_after_now(after: datetime, every: int) -> None:
    nxt = IntervalTrigger(every).next_after(after)
    assert nxt is not None
    assert after < nxt <= after + timedelta(milliseconds=every)
    assert ((nxt - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)) % every == 0


@settings(max_examples=100, deadline=None)
@given(
    st.datetimes(min_value=_NAIVE_2020, max_value=_NAIVE_2035, timezones=st.just(UTC)),
    st.sampled_from(
        ["30 2 * * *", "0 * * * *", "*/15 * * * *", "*/20 * * * * *", "0 30 1 * * *", "@daily"]
    ),
    st.sampled_from(
        ["Europe/Paris", "America/New_York", "Australia/Lord_Howe", "UTC", "Asia/Kolkata"]
    ),
)
def test_next_fire_is_strictly_later_and_monotonic(
    after: datetime, expression: str, zone: str
) -> None:
    spec = CronSpec.parse(expression, ZoneInfo(zone))
    first = spec.next_after(after)
    second = spec.next_after(first)
    assert after < first < second
    assert first - after <= timedelta(days=2)
    # A run key names a UTC instant: no two fire instants share one.
    assert format_run_key(first) != format_run_key(second)


def test_run_keys_are_identical_across_processes_whatever_their_tz() -> None:
    code = (
        "from datetime import datetime, UTC;"
        "from zoneinfo import ZoneInfo;"
        "from sdcore.scheduling._cron import CronSpec;"
        "from sdcore.scheduling import format_run_key;"
        "from sdcore.job_scheduler import lock_key;"
        "s = CronSpec.parse('30 2 * * *', ZoneInfo('Europe/Paris'));"
        "t = datetime(2026, 10, 24, 12, tzinfo=UTC);"
        "keys = [];"
        "exec('for _ in range(3):\\n t = s.next_after(t); keys.append(format_run_key(t))');"
        "print(keys, lock_key('nightly', keys[0]))"
    )
    processes = [  # at once: each spends its time importing
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "TZ": tz, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            text=True,
        )
        for tz, seed in [
            ("UTC", "0"),
            ("Asia/Kolkata", "1"),
            ("America/New_York", "2"),
            ("Pacific/Kiritimati", "3"),
        ]
    ]
    outputs = set()
    for process in processes:
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0
        outputs.add(out)
    assert len(outputs) == 1
    assert "2026-10-25T00:30:00Z" in outputs.pop()


# --- NestJS parity: npm cron 4.4.0 presets and its day-of-month / day-of-week rule -----------


def _next_days(expression: str, rule: str, count: int = 6) -> list[str]:
    """The next ``count`` fire days after 2026-03-01T00:00Z (a Sunday), as ``MM-DDDay``."""
    spec = CronSpec.parse(expression, ZoneInfo("UTC"), day_rule=rule)
    moment = datetime(2026, 3, 1, tzinfo=UTC)
    out = []
    for _ in range(count):
        moment = spec.next_after(moment)
        out.append(moment.strftime("%m-%d%a"))
    return out


# Each row: expression, the days under Vixie/cronie (the default), the days under npm cron.
_DAY_RULE_TABLE = [
    pytest.param(
        "0 0 */10 * 0",
        ["05-31Sun", "06-21Sun", "10-11Sun", "11-01Sun", "01-31Sun", "02-21Sun"],
        ["03-08Sun", "03-11Wed", "03-15Sun", "03-21Sat", "03-22Sun", "03-29Sun"],
        id="star-step-dom-and-dow-differ",
    ),
    pytest.param(
        "0 0 0 */10 * 7",
        ["05-31Sun", "06-21Sun", "10-11Sun", "11-01Sun", "01-31Sun", "02-21Sun"],
        ["03-08Sun", "03-11Wed", "03-15Sun", "03-21Sat", "03-22Sun", "03-29Sun"],
        id="six-fields-dow-7-is-sunday",
    ),
    pytest.param(
        "0 0 1-31 * 1",
        ["03-02Mon", "03-03Tue", "03-04Wed", "03-05Thu", "03-06Fri", "03-07Sat"],
        ["03-02Mon", "03-09Mon", "03-16Mon", "03-23Mon", "03-30Mon", "04-06Mon"],
        id="full-range-dom-without-star-differs",
    ),
    pytest.param(
        "0 0 1 * 1-7",
        ["03-02Mon", "03-03Tue", "03-04Wed", "03-05Thu", "03-06Fri", "03-07Sat"],
        ["04-01Wed", "05-01Fri", "06-01Mon", "07-01Wed", "08-01Sat", "09-01Tue"],
        id="full-range-dow-without-star-differs",
    ),
    pytest.param(
        "0 0 */1 * 1",
        ["03-02Mon", "03-09Mon", "03-16Mon", "03-23Mon", "03-30Mon", "04-06Mon"],
        ["03-02Mon", "03-09Mon", "03-16Mon", "03-23Mon", "03-30Mon", "04-06Mon"],
        id="star-step-one-is-unrestricted-in-both",
    ),
    pytest.param(
        "0 0 1,15 * 1",
        ["03-02Mon", "03-09Mon", "03-15Sun", "03-16Mon", "03-23Mon", "03-30Mon"],
        ["03-02Mon", "03-09Mon", "03-15Sun", "03-16Mon", "03-23Mon", "03-30Mon"],
        id="both-restricted-either-in-both",
    ),
    pytest.param(
        "0 0 * * 1",
        ["03-02Mon", "03-09Mon", "03-16Mon", "03-23Mon", "03-30Mon", "04-06Mon"],
        ["03-02Mon", "03-09Mon", "03-16Mon", "03-23Mon", "03-30Mon", "04-06Mon"],
        id="star-dom-same-in-both",
    ),
    pytest.param(
        "0 0 */10 * 0-6",
        ["03-11Wed", "03-21Sat", "03-31Tue", "04-01Wed", "04-11Sat", "04-21Tue"],
        ["03-11Wed", "03-21Sat", "03-31Tue", "04-01Wed", "04-11Sat", "04-21Tue"],
        id="full-dow-range-same-in-both",
    ),
    pytest.param(
        "0 0 L * 1",
        ["03-02Mon", "03-09Mon", "03-16Mon", "03-23Mon", "03-30Mon", "03-31Tue"],
        ["03-02Mon", "03-09Mon", "03-16Mon", "03-23Mon", "03-30Mon", "03-31Tue"],
        id="last-day-is-restricted-in-both",
    ),
]


@pytest.mark.parametrize(("expression", "vixie", "nestjs"), _DAY_RULE_TABLE)
def test_day_rule_table(expression: str, vixie: list[str], nestjs: list[str]) -> None:
    assert _next_days(expression, "vixie") == vixie
    assert _next_days(expression, "nestjs") == nestjs


def test_day_rule_default_is_vixie() -> None:
    spec = CronSpec.parse("0 0 */10 * 0", ZoneInfo("UTC"))
    assert spec.next_after(datetime(2026, 3, 1, tzinfo=UTC)) == datetime(2026, 5, 31, tzinfo=UTC)


def test_day_rule_is_validated() -> None:
    with pytest.raises(InvalidScheduleError, match="day_rule must be 'vixie' or 'nestjs'"):
        CronSpec.parse("0 0 * * *", PARIS, "x", day_rule="either")


def test_day_rule_reaches_the_scheduler() -> None:
    from sdcore.scheduling import DayRule, Scheduler

    async def handler(tick: object) -> None:
        return None

    clock = datetime(2026, 3, 1, tzinfo=UTC)
    scheduler = Scheduler(clock=lambda: clock)
    scheduler.add_cron("vixie", "0 0 */10 * 0", handler)
    scheduler.add_cron("nestjs", "0 0 */10 * 0", handler, day_rule=DayRule.NESTJS)
    scheduler.cron("0 0 */10 * 0", name="decorated", day_rule="nestjs")(handler)
    nexts = {info.name: info.next_fire_at for info in scheduler.schedules()}
    assert nexts["vixie"] == datetime(2026, 5, 31, tzinfo=UTC)
    assert nexts["nestjs"] == nexts["decorated"] == datetime(2026, 3, 8, tzinfo=UTC)
    with pytest.raises(InvalidScheduleError, match="day_rule"):
        scheduler.add_cron("bad", "0 0 * * *", handler, day_rule="both")


@pytest.mark.parametrize(
    ("preset", "after", "expected"),
    [
        ("@minutely", "2026-03-06T23:59:58", ["2026-03-07T00:00:00", "2026-03-07T00:01:00"]),
        ("@secondly", "2026-03-06T23:59:58", ["2026-03-06T23:59:59", "2026-03-07T00:00:00"]),
        ("@weekdays", "2026-03-06T23:59:58", ["2026-03-09T00:00:00", "2026-03-10T00:00:00"]),
        ("@weekends", "2026-03-06T23:59:58", ["2026-03-07T00:00:00", "2026-03-08T00:00:00"]),
        ("@WEEKENDS", "2026-03-08T00:00:00", ["2026-03-14T00:00:00", "2026-03-15T00:00:00"]),
    ],
)
def test_npm_cron_presets(preset: str, after: str, expected: list[str]) -> None:
    spec = CronSpec.parse(preset, ZoneInfo("UTC"))
    moment = datetime.fromisoformat(after).replace(tzinfo=UTC)
    out = []
    for _ in expected:
        moment = spec.next_after(moment)
        out.append(moment.replace(tzinfo=None).isoformat())
    assert out == expected


def test_every_15_minutes_is_documented_as_sdcore_only() -> None:
    assert "EVERY_15_MINUTES" in (CronExpression.__doc__ or "")
    assert str(CronExpression.EVERY_15_MINUTES) == "0 */15 * * * *"


def _field(draw: st.DrawFn, low: int, high: int) -> str:
    a = draw(st.integers(low, high))
    b = draw(st.integers(a, high))
    step = draw(st.integers(1, 12))
    return draw(
        st.sampled_from(
            ["*", f"*/{step}", f"{a}", f"{a}-{b}", f"{a},{b}", f"{a}-{b}/{step}", f"{low}-{high}"]
        )
    )


@st.composite
def _day_fields(draw: st.DrawFn) -> tuple[str, str]:
    return _field(draw, 1, 31), _field(draw, 0, 7)


def _npm_days(dom: str, dow: str, start: datetime, count: int) -> list[str]:
    """npm cron 4.4.0's day rule, written out from its _getNextDateFrom, as an oracle."""
    from cronsim.cronsim import Field

    # The strategy draws no L, W or # items, so every parsed item is an int.
    days = {v for v in Field.DAY.parse(dom) if isinstance(v, int)}
    weekdays = {v % 7 for v in Field.DOW.parse(dow) if isinstance(v, int)}
    dom_restricted, dow_restricted = len(days) != 31, len(weekdays) != 7
    out: list[str] = []
    day = start
    while len(out) < count:
        day += timedelta(days=1)
        in_dom, in_dow = day.day in days, day.isoweekday() % 7 in weekdays
        skip = (not in_dom and dom_restricted and not (in_dow and dow_restricted)) or (
            not in_dow and dow_restricted and not (in_dom and dom_restricted)
        )
        if not skip:
            out.append(day.strftime("%m-%d%a"))
    return out


@settings(max_examples=300, deadline=None)
@given(_day_fields())
def test_nestjs_day_rule_matches_npm_cron(fields: tuple[str, str]) -> None:
    dom, dow = fields
    start = datetime(2026, 3, 1, tzinfo=UTC)
    assert _next_days(f"0 0 {dom} * {dow}", "nestjs", count=8) == _npm_days(dom, dow, start, 8)


class _Counting:
    """A trigger that counts its ``next_after`` calls."""

    def __init__(self, trigger: CronTrigger | IntervalTrigger) -> None:
        self.trigger = trigger
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.trigger, name)

    def next_after(self, after: datetime) -> datetime | None:
        self.calls += 1
        return self.trigger.next_after(after)


@settings(max_examples=150, deadline=None)
@given(
    expression=st.sampled_from(["* * * * *", "*/7 * * * * *", "0 2 * * *", "30 1 * * 0"]),
    every_ms=st.sampled_from([1, 250, 1_000, 90_000]),
    cron=st.booleans(),
    start=st.datetimes(_NAIVE_2020, _NAIVE_2035, timezones=st.just(PARIS)),
    length_s=st.integers(0, 3 * 86_400),
    count=st.sampled_from([1, 3, 1_000]),
)
def test_latest_instants_are_the_last_of_the_whole_window(
    expression: str, every_ms: int, cron: bool, start: datetime, length_s: int, count: int
) -> None:
    """The last ``count`` instants of ``[start, end)``, whatever the window, trigger and count:
    the same as walking the whole window (kept short enough to walk)."""
    trigger = CronTrigger(CronSpec.parse(expression, PARIS)) if cron else IntervalTrigger(every_ms)
    length = timedelta(seconds=length_s)
    if not cron:
        length = min(length, every_ms * timedelta(milliseconds=20_000))
    start = start.astimezone(UTC)
    end = start + length
    whole = expected_instants(trigger, start, end, limit=200_000)
    assert latest_instants(trigger, start, end, count) == whole[-count:]


def test_latest_instants_cost_follows_the_instants_returned_not_the_window() -> None:
    """A sweep's short window of a minutely cron is walked once; the last 1,000 instants of a
    1 ms interval in an hour walk about 1,000 instants, not 3.6 million."""
    start = datetime(2026, 12, 7, 8, 0, 30, tzinfo=UTC)
    minutely = _Counting(CronTrigger(CronSpec.parse("* * * * *", PARIS)))
    assert latest_instants(minutely, start, start + timedelta(seconds=2), 1_000) == []  # type: ignore[arg-type]
    assert minutely.calls == 1
    assert latest_instants(minutely, start, start + timedelta(seconds=31), 1_000) == [  # type: ignore[arg-type]
        start + timedelta(seconds=30)
    ]
    assert minutely.calls == 3
    fast = _Counting(IntervalTrigger(1))
    last = latest_instants(fast, start, start + timedelta(hours=1), 1_000)  # type: ignore[arg-type]
    assert last[-1] == start + timedelta(hours=1) - timedelta(milliseconds=1)
    assert len(last) == 1_000
    assert fast.calls <= 1_001


def test_latest_instants_near_the_first_representable_year() -> None:
    """A window whose look-back would reach before year 1 is walked from its start."""
    every = IntervalTrigger(2**31 - 1)  # about 24.9 days: 1,000 of them span 68 years
    start, end = datetime(1, 1, 2, tzinfo=UTC), datetime(3, 1, 1, tzinfo=UTC)
    whole = expected_instants(every, start, end, limit=1_000)
    assert latest_instants(every, start, end, 1_000) == whole
    assert len(whole) == 30
