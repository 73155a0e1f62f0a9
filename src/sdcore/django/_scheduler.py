"""``scheduler``: where ``schedules.py`` modules declare schedules (like ``admin.site``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from sdcore.scheduling import DayRule, ScheduleOptions

if TYPE_CHECKING:
    from sdcore.scheduling import Scheduler

__all__ = ["DjangoScheduler", "scheduler"]

F = TypeVar("F", bound=Callable[..., Any])


def with_connections(handler: F) -> F:
    """Wrap a handler so Django's connections are recycled around each run, as a request's.

    A plain function runs in a worker thread: ``close_old_connections()`` before and after each
    call closes that thread's connection when it is broken (an error left it unusable, a
    transaction left open) or older than ``CONN_MAX_AGE``. An async handler gets the same
    around its call for the thread ``sync_to_async`` uses.
    """
    from asgiref.sync import sync_to_async
    from django.db import close_old_connections

    if inspect.iscoroutinefunction(handler):

        @functools.wraps(handler)
        async def run_async(*args: Any) -> Any:
            await sync_to_async(close_old_connections)()
            try:
                return await handler(*args)
            finally:
                await sync_to_async(close_old_connections)()

        return run_async  # type: ignore[return-value]

    @functools.wraps(handler)
    def run(*args: Any) -> Any:
        close_old_connections()
        try:
            return handler(*args)
        finally:
            close_old_connections()

    return run  # type: ignore[return-value]


class DjangoScheduler:
    """The declaration API of :class:`~sdcore.scheduling.Scheduler`, on the process's Runtime.

    Each declaration goes to the scheduler of :func:`~sdcore.django.get_runtime` (built from
    ``settings.SDCORE`` on first use; nothing connects until ``manage.py sdcore run`` starts
    it), so a bad expression or option fails when ``schedules.py`` is imported, at start-up.
    Every handler is wrapped by Django's connection recycling; the decorators return the
    function unchanged.
    """

    def _target(self) -> Scheduler:
        from sdcore.django._runtime import get_runtime

        return get_runtime().scheduler

    def cron(
        self,
        expression: str,
        *,
        name: str | None = None,
        time_zone: str | None = None,
        day_rule: DayRule | str = DayRule.VIXIE,
        **options: Unpack[ScheduleOptions],
    ) -> Callable[[F], F]:
        """Decorate a handler to run on a cron expression (see ``Scheduler.cron``)."""
        return self._declare(
            lambda h, n: self._target().add_cron(
                n, expression, h, time_zone=time_zone, day_rule=day_rule, **options
            ),
            name,
        )

    def interval(
        self, every_ms: int, *, name: str | None = None, **options: Unpack[ScheduleOptions]
    ) -> Callable[[F], F]:
        """Decorate a handler to run every ``every_ms`` (see ``Scheduler.interval``)."""
        return self._declare(
            lambda h, n: self._target().add_interval(n, every_ms, h, **options), name
        )

    def timeout(self, delay_ms: int, *, name: str | None = None) -> Callable[[F], F]:
        """Decorate a handler to run once per process after ``delay_ms``."""
        return self._declare(lambda h, n: self._target().add_timeout(n, delay_ms, h), name)

    def initial(
        self, *, name: str | None = None, **options: Unpack[ScheduleOptions]
    ) -> Callable[[F], F]:
        """Decorate a handler to run once per cluster, ever."""
        return self._declare(lambda h, n: self._target().add_initial(n, h, **options), name)

    def handler(self, name: str) -> Callable[[F], F]:
        """Register a handler for stored schedules (see ``Scheduler.handler``)."""

        def decorate(function: F) -> F:
            self._target().handler(name)(with_connections(function))
            return function

        return decorate

    def _declare(
        self, register: Callable[[Callable[..., Any], str], None], name: str | None
    ) -> Callable[[F], F]:
        def decorate(handler: F) -> F:
            chosen = name if name is not None else getattr(handler, "__name__", "")
            register(with_connections(handler), chosen)
            return handler

        return decorate


scheduler = DjangoScheduler()
"""Declare schedules in an app's ``schedules.py``: ``@scheduler.cron("0 1 * * *", name=…)``."""
