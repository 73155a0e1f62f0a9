"""Handlers for the schedules imported from django-celery-beat, named after the Celery tasks."""

from beatapp.models import BeatRun  # type: ignore[import-not-found]

from sdcore.django import scheduler


@scheduler.handler("reports.tasks.send_report")
def send_report(tick, args):  # type: ignore[no-untyped-def]
    BeatRun.objects.create(handler="reports.tasks.send_report", schedule=tick.schedule, args=args)


@scheduler.handler("beat.heartbeat")
def heartbeat(tick, args):  # type: ignore[no-untyped-def]
    BeatRun.objects.create(handler="beat.heartbeat", schedule=tick.schedule, args=args)
