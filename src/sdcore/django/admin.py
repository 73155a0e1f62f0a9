"""sdcore's pages in the Django admin: schedules, their runs and control actions, the outbox.

The lists are read-only (the models are unmanaged, with ``view`` the only one of Django's
default permissions). Every change is an admin action that calls the control plane:
pause, resume, trigger and backfill through ``sdcore.sync.ScheduleAdmin`` (the Django username
recorded as the actor, with the reason typed in the action's form), an outbox row's retry
through ``sdcore.sync.OutboxAdmin``. Each action needs its permission
(``sdcore.pause_schedule``, ``sdcore.resume_schedule``, ``sdcore.trigger_schedule``,
``sdcore.backfill_schedule``, ``sdcore.retry_outbox``): without it the action is not offered,
and a POST that names it anyway is refused with 403.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode

from sdcore.django._control import MAX_TICKS, WINDOW, Definition, ScheduleStatus, control
from sdcore.django.models import OutboxMessage, Schedule, ScheduleAction, ScheduleRun
from sdcore.runtime import RuntimeStateError
from sdcore.scheduling import ControlAction, ControlWriteUncertainError, ScheduleControlError

__all__ = ["OutboxMessageAdmin", "ScheduleActionAdmin", "ScheduleAdmin", "ScheduleRunAdmin"]

F = TypeVar("F", bound=Callable[..., Any])

ACTION_TEMPLATE = "admin/sdcore/action_form.html"
APPLY = "apply"  # the confirmation form's submit: present on the POST that acts


def _display(**options: Any) -> Callable[[F], F]:
    """``admin.display``, typed (Django ships no annotations)."""
    decorator: Callable[[F], F] = admin.display(**options)
    return decorator


def _action(**options: Any) -> Callable[[F], F]:
    """``admin.action``, typed."""
    decorator: Callable[[F], F] = admin.action(**options)
    return decorator


def _database() -> str:
    from sdcore.django._settings import SdcoreSettings

    return SdcoreSettings.from_django().database


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """A list and detail pages over one of sdcore's tables: nothing is added, changed or
    deleted through the model, and a POST naming an action the user may not run is a 403."""

    show_full_result_count = False  # one count(*) per page is enough on a large history
    list_per_page = 50

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(_database())

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if request.method == "POST":
            named = {a for a in request.POST.getlist("action") if a}  # "": none chosen
            offered = set(self.get_actions(request))
            if named - offered:
                # Django would answer "No action selected"; a forged or stale POST for an
                # action this user may not run is refused outright.
                raise PermissionDenied
        response: HttpResponse = super().changelist_view(request, extra_context)
        return response


def _permission(codename: str) -> Callable[[Any, HttpRequest], bool]:
    def check(self: Any, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"sdcore.{codename}"))

    check.__name__ = f"has_{codename.split('_')[0]}_permission"
    return check


# --- schedules ---------------------------------------------------------------------------------


class ReasonForm(forms.Form):  # type: ignore[misc]
    """The form of pause, resume and trigger: why, recorded with the action."""

    reason = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text="Recorded with the action and your username.",
    )
    request_id = forms.CharField(widget=forms.HiddenInput)
    """Drawn per rendered form: submitting it twice records one trigger or backfill."""


class BackfillForm(ReasonForm):
    """The backfill's window and pace."""

    start = forms.DateTimeField(help_text="First tick (inclusive), in the site's time zone.")
    end = forms.DateTimeField(help_text="Last tick (inclusive); in the past.")
    concurrency = forms.IntegerField(min_value=1, initial=1)
    rerun_succeeded = forms.BooleanField(
        required=False, help_text="Run again the ticks that already succeeded."
    )

    def clean(self) -> dict[str, Any]:
        """Make the window aware (naive with ``USE_TZ = False``)."""
        data: dict[str, Any] = super().clean()
        for key in ("start", "end"):
            value = data.get(key)
            if isinstance(value, datetime):
                data[key] = _aware(value)
        return data


class ScheduleChangeList(ChangeList):  # type: ignore[misc]
    """The schedules list: each row of the page gets its next fire time and missed ticks from
    the control plane, in one call for the page."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        rows = list(self.result_list)
        try:
            statuses = control().statuses([_definition(row) for row in rows])
        except (RuntimeStateError, psycopg.Error) as exc:
            # The rows came through Django's connection: show them, without what needs sdcore's.
            messages.warning(request, f"next fire times and missed ticks unavailable: {exc}")
            statuses = {}
        for row in rows:
            row.sdcore_status = statuses.get(row.name)


def _aware(value: datetime) -> datetime:
    """``value`` as an aware datetime: with ``USE_TZ = False`` Django reads naive ones, in
    ``TIME_ZONE``."""
    from django.utils import timezone

    if timezone.is_naive(value):
        aware: datetime = timezone.make_aware(value, timezone.get_default_timezone())
        return aware
    return value


def _definition(row: Schedule) -> Definition:
    return Definition(
        name=row.name,
        origin=row.origin,
        kind=row.kind,
        expression=row.expression,
        time_zone=row.time_zone,
        day_rule=row.day_rule,
        paused=row.paused,
        created_at=_aware(row.created_at),
    )


def _status(row: Schedule) -> ScheduleStatus | None:
    found: ScheduleStatus | None = getattr(row, "sdcore_status", None)
    return found


@admin.register(Schedule)
class ScheduleAdmin(ReadOnlyAdmin):
    """Schedules with their state, next fire, last run and missed ticks; pause, resume, trigger
    and backfill as actions."""

    list_display = (
        "name",
        "state",
        "definition",
        "next_fire",
        "last_run",
        "missed_ticks",
        "runs",
    )
    list_filter = ("paused", "origin", "kind")
    search_fields = ("name",)
    actions = ("pause", "resume", "trigger", "backfill")
    readonly_fields = ("state", "last_run")

    has_pause_permission = _permission("pause_schedule")
    has_resume_permission = _permission("resume_schedule")
    has_trigger_permission = _permission("trigger_schedule")
    has_backfill_permission = _permission("backfill_schedule")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        last = ScheduleRun.objects.filter(schedule=OuterRef("pk")).order_by("-started_at", "-id")
        return (
            super()
            .get_queryset(request)
            .filter(removed_at__isnull=True)
            .annotate(
                last_run_at=Subquery(last.values("started_at")[:1]),
                last_status=Subquery(last.values("status")[:1]),
            )
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return ScheduleChangeList

    @_display(description="state", ordering="paused")
    def state(self, row: Schedule) -> str:
        if not row.paused:
            return "active"
        who = f" by {row.paused_by}" if row.paused_by else ""
        why = f": {row.paused_reason}" if row.paused_reason else ""
        return f"paused{who}{why}"

    @_display(description="schedule")
    def definition(self, row: Schedule) -> str:
        if row.kind == "cron":
            return f"cron {row.expression} ({row.time_zone})"
        if row.kind == "interval":
            return f"every {row.expression} ms"
        return f"{row.kind} {row.expression}"

    @_display(description="next fire")
    def next_fire(self, row: Schedule) -> datetime | str | None:
        status = _status(row)
        if status is None or status.next_fire_at is not None:
            return None if status is None else status.next_fire_at
        if row.paused:
            return "paused"
        return "no live replica" if status.replicas == 0 and row.origin == "code" else None

    @_display(description="last run", ordering="last_run_at")
    def last_run(self, row: Schedule) -> str:
        at = getattr(row, "last_run_at", None)
        if at is None:
            return "never"
        from django.utils.formats import localize
        from django.utils.timezone import template_localtime

        return f"{getattr(row, 'last_status', '')} at {localize(template_localtime(at))}"

    @_display(description=f"missed ticks ({WINDOW.total_seconds() / 3600:.0f} h)")
    def missed_ticks(self, row: Schedule) -> int | str | None:
        status = _status(row)
        if status is None or status.missed is None:
            return None
        if status.capped:
            return f"{status.missed} of the last {MAX_TICKS:,} ticks"
        return status.missed

    @_display(description="history")
    def runs(self, row: Schedule) -> str:
        runs = reverse("admin:sdcore_schedulerun_changelist")
        actions = reverse("admin:sdcore_scheduleaction_changelist")
        query = urlencode({"schedule": row.name})
        link: str = format_html(
            '<a href="{}?{}">runs</a> · <a href="{}?{}">actions</a>', runs, query, actions, query
        )
        return link

    # --- actions -------------------------------------------------------------------------------

    @_action(description="Pause the selected schedules", permissions=("pause",))
    def pause(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._act(
            request,
            queryset,
            "pause",
            ReasonForm,
            lambda row, actor, data: control().schedules.pause(
                row.name, actor=actor, reason=data["reason"] or None
            ),
        )

    @_action(description="Resume the selected schedules", permissions=("resume",))
    def resume(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._act(
            request,
            queryset,
            "resume",
            ReasonForm,
            lambda row, actor, data: control().schedules.resume(
                row.name, actor=actor, reason=data["reason"] or None
            ),
        )

    @_action(description="Trigger the selected schedules now", permissions=("trigger",))
    def trigger(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._act(
            request,
            queryset,
            "trigger",
            ReasonForm,
            lambda row, actor, data: control().schedules.trigger(
                row.name,
                actor=actor,
                reason=data["reason"] or None,
                request_id=data["request_id"],
            ),
        )

    @_action(description="Backfill the selected schedules", permissions=("backfill",))
    def backfill(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._act(
            request,
            queryset,
            "backfill",
            BackfillForm,
            lambda row, actor, data: control().schedules.backfill(
                row.name,
                data["start"],
                data["end"],
                actor=actor,
                reason=data["reason"] or None,
                concurrency=data["concurrency"],
                request_id=data["request_id"],
                rerun_succeeded=data["rerun_succeeded"],
            ),
        )

    def _act(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        action: str,
        form_class: type[ReasonForm],
        apply: Callable[[Schedule, str, dict[str, Any]], ControlAction],
    ) -> HttpResponse | None:
        """Show the action's form for the selected schedules; on its submit, apply it to each
        (one message per schedule) and return to the list."""
        if not getattr(self, f"has_{action}_permission")(request):
            raise PermissionDenied  # get_actions already hides it; never act without it
        rows = list(queryset)
        if not rows:
            self.message_user(
                request, "none of the selected schedules exists; nothing changed", messages.WARNING
            )
            return None
        if APPLY in request.POST:
            form = form_class(request.POST)
            if form.is_valid():
                actor = request.user.get_username()
                for row in rows:
                    self._apply_one(request, row, action, actor, form.cleaned_data, apply)
                return None
        else:
            form = form_class(initial={"request_id": uuid.uuid4().hex})
        context = {
            **self.admin_site.each_context(request),
            "title": f"{action.capitalize()} {len(rows)} schedule(s)",
            "action": action,
            "rows": rows,
            "form": form,
            "opts": self.model._meta,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "apply": APPLY,
            "media": self.media + form.media,
        }
        return TemplateResponse(request, ACTION_TEMPLATE, context)

    def _apply_one(
        self,
        request: HttpRequest,
        row: Schedule,
        action: str,
        actor: str,
        data: dict[str, Any],
        apply: Callable[[Schedule, str, dict[str, Any]], ControlAction],
    ) -> None:
        try:
            done = apply(row, actor, data)
        except ScheduleControlError as exc:
            self.message_user(request, f"{action} of {row.name} refused: {exc}", messages.ERROR)
            return
        except ControlWriteUncertainError as exc:
            self.message_user(
                request,
                f"{action} of {row.name}: the database connection broke while the action "
                f"was committing, it may or may not be recorded (see its actions): {exc}",
                messages.WARNING,
            )
            return
        again = " (already recorded by an earlier submit)" if done.replayed else ""
        self.message_user(
            request, f"{action} of {row.name} recorded as action {done.id}{again}", messages.SUCCESS
        )
        self.log_change(request, row, f"{action} (sdcore action {done.id})")


@admin.register(ScheduleRun)
class ScheduleRunAdmin(ReadOnlyAdmin):
    """The run history, newest first (filter by schedule from the schedules list)."""

    list_display = (
        "schedule",
        "run_key",
        "source",
        "status",
        "scheduled_at",
        "started_at",
        "finished_at",
        "attempt",
        "fencing_token",
        "host",
        "pid",
        "error",
    )
    list_filter = ("status", "source")
    search_fields = ("=schedule", "=run_key")


@admin.register(ScheduleAction)
class ScheduleActionAdmin(ReadOnlyAdmin):
    """The control-action log: who did what, why, when, and how it ended."""

    list_display = (
        "id",
        "schedule",
        "action",
        "actor",
        "reason",
        "created_at",
        "finished_at",
        "outcome",
        "progress",
    )
    list_filter = ("action",)
    search_fields = ("=schedule", "=actor")


# --- outbox ------------------------------------------------------------------------------------


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    """The outbox's rows, newest first; DEAD (or PENDING) rows can be retried."""

    list_display = (
        "id",
        "queue",
        "name",
        "status",
        "attempts",
        "max_attempts",
        "next_attempt_at",
        "last_error",
        "created_at",
        "published_at",
    )
    list_filter = ("status",)
    search_fields = ("=idempotency_key", "=job_id", "=queue")
    actions = ("retry",)

    has_retry_permission = _permission("retry_outbox")

    @_action(
        description="Retry the selected rows (DEAD or PENDING: due now, attempts reset)",
        permissions=("retry",),
    )
    def retry(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        from django.db import connections

        from sdcore.django._settings import SdcoreSettings
        from sdcore.outbox import Outbox
        from sdcore.sync import OutboxAdmin

        if not self.has_retry_permission(request):
            raise PermissionDenied
        chosen = SdcoreSettings.from_django()
        outbox_admin = OutboxAdmin(Outbox(schema=chosen.schema))
        connection = connections[chosen.database]
        connection.ensure_connection()
        retried, skipped = [], []
        for row in queryset:
            if outbox_admin.retry(connection.connection, row.id):
                retried.append(row.id)
                self.log_change(request, row, "retry (sdcore outbox)")
            else:
                skipped.append(row.id)
        if retried:
            listed = ", ".join(f"#{i}" for i in retried)
            self.message_user(request, f"retried {listed}: due now", messages.SUCCESS)
        if skipped:
            listed = ", ".join(f"#{i}" for i in skipped)
            self.message_user(
                request,
                f"not retried {listed}: only DEAD or PENDING rows can be (nothing changed)",
                messages.WARNING,
            )
