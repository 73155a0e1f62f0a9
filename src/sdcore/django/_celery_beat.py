"""``manage.py sdcore import-celery-beat``: django-celery-beat's periodic tasks as stored schedules.

Each ``PeriodicTask`` with a crontab or an interval becomes one stored schedule (the task's
name), run by the handler registered under the Celery task's name and given
``{"args": [...], "kwargs": {...}}``. What has no faithful equivalent is skipped, with the
reason: solar and clocked schedules, one-off tasks, a start or an end time still ahead, Celery's
routing and message options (unless ``--ignore-routing``), and a crontab whose day-of-month and
day-of-week are both restricted (Celery fires when a day matches both; a stored cron schedule,
by cron's rule, when it matches either). A disabled task is created, then paused.
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import shlex
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["Skipped", "StoredSchedule", "import_celery_beat", "plan_task"]

COMMAND = "import-celery-beat"
REASON = "imported from django-celery-beat"
PAUSE_REASON = "disabled in django-celery-beat"
# IntervalSchedule.period → milliseconds per period.
_PERIOD_US = {
    "days": 86_400_000_000,
    "hours": 3_600_000_000,
    "minutes": 60_000_000,
    "seconds": 1_000_000,
    "microseconds": 1,
}
_DAY_NAMES = re.compile(r"(sun|mon|tues|wednes|thurs|fri|satur)day", re.IGNORECASE)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredSchedule:
    """The stored schedule one periodic task becomes (``ScheduleAdmin.create``'s arguments).

    Attributes:
        name: The periodic task's name.
        handler: The Celery task's name: a ``scheduler.handler(...)`` must register it.
        cron: Five fields from the crontab (minute, hour, day of month, month, day of week).
        every_ms: The interval in milliseconds.
        time_zone: The crontab's zone (``UTC`` for intervals).
        args: ``{"args": [...], "kwargs": {...}}`` from the task's JSON.
        paused: The task is disabled: the schedule is paused once created.
    """

    name: str
    handler: str
    cron: str | None = None
    every_ms: int | None = None
    time_zone: str = "UTC"
    args: Mapping[str, Any] = field(default_factory=dict)
    paused: bool = False

    def commands(self) -> list[str]:
        """The ``manage.py sdcore`` command lines that make this schedule by hand."""
        words = ["manage.py", "sdcore", "schedules", "create", self.name, "--handler", self.handler]
        if self.cron is not None:
            words += ["--cron", self.cron, "--time-zone", self.time_zone]
        else:
            words += ["--every-ms", str(self.every_ms)]
        words += ["--args", json.dumps(self.args, sort_keys=True), "--reason", REASON]
        lines = [shlex.join(words)]
        if self.paused:
            pause = ["manage.py", "sdcore", "schedules", "pause", self.name]
            lines.append(shlex.join([*pause, "--reason", PAUSE_REASON]))
        return lines


@dataclass(frozen=True, slots=True, kw_only=True)
class Skipped:
    """A periodic task with no faithful stored-schedule equivalent, and why."""

    name: str
    reason: str


def _json(text: object, kind: type, what: str) -> Any:
    raw = text if isinstance(text, str) and text.strip() else ("[]" if kind is list else "{}")
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise _Unmappable(f"{what} is not JSON ({exc})") from None
    if not isinstance(value, kind):
        raise _Unmappable(f"{what} must be a JSON {kind.__name__}, got {raw[:60]!r}")
    return value


class _Unmappable(Exception):
    """One reason to skip a task (internal: becomes a ``Skipped``)."""


def _routing(task: Any) -> list[str]:
    """Celery's routing and message options the task sets (none carry over)."""
    found = [
        f"{attribute}={value!r}"
        for attribute in ("queue", "exchange", "routing_key", "priority", "expire_seconds")
        if (value := getattr(task, attribute, None)) not in (None, "")
    ]
    if _json(getattr(task, "headers", "{}"), dict, "headers"):
        found.append("headers")
    return found


def _cron(crontab: Any) -> str:
    fields = [
        str(getattr(crontab, name)).strip()
        for name in ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    ]
    if any(not value or any(c.isspace() for c in value) for value in fields):
        raise _Unmappable(f"crontab fields {fields!r} must each be one word")
    day_of_month, day_of_week = fields[2], fields[4]
    if not day_of_month.startswith("*") and not day_of_week.startswith("*"):
        raise _Unmappable(
            f"day_of_month={day_of_month!r} and day_of_week={day_of_week!r} are both restricted:"
            " Celery fires on days matching both, a stored cron schedule on days matching either"
        )
    # Celery takes full day names too; cron takes their first three letters.
    fields[4] = _DAY_NAMES.sub(lambda m: m.group(0)[:3], day_of_week)
    return " ".join(fields)


def _every_ms(interval: Any) -> int:
    period = str(interval.period)
    if period not in _PERIOD_US:
        raise _Unmappable(f"unknown interval period {period!r}")
    micros = int(interval.every) * _PERIOD_US[period]
    if micros % 1000:
        raise _Unmappable(f"every {interval.every} {period} is not a whole number of ms")
    return micros // 1000


def _check(schedule: StoredSchedule) -> None:
    """sdcore's own rules for the name, the handler, the expression and the zone."""
    from sdcore.scheduling import InvalidScheduleError, Scheduler

    def noop(tick: object) -> None:
        """Never called: the scheduler only validates the declaration."""

    checker = Scheduler()
    try:
        checker.handler(schedule.handler)
    except InvalidScheduleError as exc:
        raise _Unmappable(
            f"the task {schedule.handler!r:.80} cannot name a handler: {exc}"
        ) from None
    try:
        if schedule.cron is not None:
            checker.add_cron(
                schedule.name, schedule.cron, noop, time_zone=schedule.time_zone, exclusive=False
            )
        else:
            assert schedule.every_ms is not None  # noqa: S101 - one of the two is set
            checker.add_interval(schedule.name, schedule.every_ms, noop, exclusive=False)
    except InvalidScheduleError as exc:
        raise _Unmappable(str(exc)) from None


def plan_task(
    task: Any, *, now: datetime, ignore_routing: bool = False
) -> StoredSchedule | Skipped:
    """Map one ``django_celery_beat.models.PeriodicTask`` to a stored schedule, or skip it.

    Args:
        task: The periodic task (its crontab, interval, solar and clocked relations loaded).
        now: The current time (aware): start and end times are compared with it.
        ignore_routing: Map a task that sets Celery routing or message options (``queue``,
            ``exchange``, ``routing_key``, ``priority``, ``headers``, ``expire_seconds``)
            without them, rather than skip it.

    Returns:
        The stored schedule, or why the task has none.
    """
    name = str(task.name)
    try:
        if task.solar_id is not None:
            raise _Unmappable(f"a solar schedule ({task.solar}): sdcore has none")
        if task.clocked_id is not None:
            raise _Unmappable(
                f"a clocked schedule (once, at {task.clocked.clocked_time.isoformat()}): stored"
                " schedules repeat; run a handler once with `sdcore schedules trigger`"
            )
        if task.crontab_id is None and task.interval_id is None:
            raise _Unmappable("no crontab or interval schedule")
        if task.one_off:
            raise _Unmappable("one_off (runs once, then disables itself): stored schedules repeat")
        if task.expires is not None:
            if task.expires <= now:
                raise _Unmappable(f"expired at {task.expires.isoformat()}: beat no longer runs it")
            raise _Unmappable(
                f"ends at {task.expires.isoformat()}: stored schedules do not end by themselves;"
                " import it then, or remove the imported schedule at that time"
            )
        if task.start_time is not None and task.start_time > now:
            raise _Unmappable(
                f"starts at {task.start_time.isoformat()}: a stored schedule starts when it is"
                " created; import it then"
            )
        routing = _routing(task)
        if routing and not ignore_routing:
            raise _Unmappable(
                f"Celery routing or message options ({', '.join(routing)}): the handler you"
                " register runs the task, so they do not carry over; --ignore-routing imports"
                " it without them"
            )
        arguments = {
            "args": _json(task.args, list, "args"),
            "kwargs": _json(task.kwargs, dict, "kwargs"),
        }
        if task.crontab_id is not None:
            crontab = task.crontab
            schedule = StoredSchedule(
                name=name,
                handler=str(task.task),
                cron=_cron(crontab),
                time_zone=str(crontab.timezone),
                args=arguments,
                paused=not task.enabled,
            )
        else:
            schedule = StoredSchedule(
                name=name,
                handler=str(task.task),
                every_ms=_every_ms(task.interval),
                args=arguments,
                paused=not task.enabled,
            )
        _check(schedule)
    except _Unmappable as exc:
        return Skipped(name=name, reason=str(exc))
    return schedule


def _default_actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:200]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"manage.py sdcore {COMMAND}",
        description=(
            "Print the stored schedule of every django-celery-beat periodic task (dry run), or"
            " create them with --apply. Tasks with no faithful equivalent are listed as skipped,"
            " with the reason."
        ),
    )
    parser.add_argument(
        "--apply",
        action="store_true",
        help="create the schedules (running `manage.py sdcore run` workers must register their"
        " handlers)",
    )
    parser.add_argument(
        "--ignore-routing",
        action="store_true",
        help="import tasks that set Celery routing or message options, without them",
    )
    parser.add_argument("--name", action="append", metavar="NAME", help="only this task (repeat)")
    parser.add_argument("--actor", metavar="WHO", help="who (default: user@host)")
    return parser


def import_celery_beat(argv: Sequence[str], write: Callable[[str], None]) -> int:
    """Run ``manage.py sdcore import-celery-beat ARGV``; return the exit status.

    Dry run by default: prints each task's stored schedule as the ``manage.py sdcore schedules``
    commands that make it, and each skipped task with its reason. ``--apply`` creates them
    through :class:`sdcore.sync.ScheduleAdmin` (a name that exists, or a handler no running
    worker registers, fails that task and the others go on); the status is 1 if any failed.
    """
    from django.apps import apps
    from django.utils import timezone

    args = _parser().parse_args(list(argv))
    if not apps.is_installed("django_celery_beat"):
        write(f"{COMMAND}: django_celery_beat is not in INSTALLED_APPS: nothing to read")
        return 2
    from django_celery_beat.models import PeriodicTask

    tasks = PeriodicTask.objects.select_related("crontab", "interval", "solar", "clocked")
    if args.name:
        tasks = tasks.filter(name__in=args.name)
    now = timezone.now()
    plans: list[StoredSchedule | Skipped] = [
        plan_task(t, now=now, ignore_routing=args.ignore_routing) for t in tasks
    ]
    found = {plan.name for plan in plans}
    plans += [
        Skipped(name=name, reason="no django-celery-beat periodic task has this name")
        for name in dict.fromkeys(args.name or ())
        if name not in found
    ]
    plans.sort(key=lambda p: p.name)
    schedules = [p for p in plans if isinstance(p, StoredSchedule)]
    for plan in plans:
        if isinstance(plan, Skipped):
            write(f"skip {plan.name}: {plan.reason}")
        elif not args.apply:
            write(f"create {plan.name}:" + "".join(f"\n  {line}" for line in plan.commands()))
    failed = _apply(schedules, args.actor or _default_actor(), write) if args.apply else 0
    skipped = len(plans) - len(schedules)
    if args.apply:
        write(f"{len(schedules) - failed} created, {failed} failed, {skipped} skipped")
    else:
        write(
            f"{len(schedules)} to create, {skipped} skipped (dry run: nothing written;"
            " --apply creates them)"
        )
    return 1 if failed else 0


def _apply(schedules: Iterable[StoredSchedule], actor: str, write: Callable[[str], None]) -> int:
    from sdcore.django._settings import SdcoreSettings, database_url
    from sdcore.scheduling import SchedulingError
    from sdcore.sync import ScheduleAdmin

    failed = 0
    with ScheduleAdmin.connect(database_url(), schema=SdcoreSettings.from_django().schema) as admin:
        for schedule in schedules:
            try:
                admin.create(
                    schedule.name,
                    handler=schedule.handler,
                    cron=schedule.cron,
                    every_ms=schedule.every_ms,
                    time_zone=schedule.time_zone,
                    args=schedule.args,
                    actor=actor,
                    reason=REASON,
                )
            except SchedulingError as exc:
                failed += 1
                write(f"failed {schedule.name}: {exc}")
                continue
            if not schedule.paused:
                write(f"created {schedule.name}")
                continue
            try:
                admin.pause(schedule.name, actor=actor, reason=PAUSE_REASON)
            except SchedulingError as exc:
                # Created but running although the task was disabled: say so loudly.
                failed += 1
                write(
                    f"failed {schedule.name}: created but NOT paused ({exc}); pause it:"
                    f" manage.py sdcore schedules pause {shlex.quote(schedule.name)}"
                )
                continue
            write(f"created {schedule.name} (paused)")
    return failed
