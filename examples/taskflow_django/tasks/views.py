"""``PATCH /tasks/<id>/status`` with ``{"status": "DONE"}``: plain Django, JSON in and out."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse

from tasks.models import Task
from tasks.service import change_status


def _problem(status: int, detail: str) -> JsonResponse:
    return JsonResponse({"status": status, "detail": detail}, status=status)


def task_status(request: HttpRequest, task_id: int) -> HttpResponse:
    """Change the task's status: 200 with the task, 404 unknown task, 422 a bad body, 405 any
    method but ``PATCH``. (No CSRF middleware: an API called with JSON, not a browser form.)"""
    if request.method != "PATCH":
        return HttpResponseNotAllowed(["PATCH"])
    try:
        body = json.loads(request.body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return _problem(422, "the body must be JSON")
    if not isinstance(body, dict) or not isinstance(body.get("status"), str):
        return _problem(422, 'the body must be {"status": "..."}')
    try:
        task = change_status(task_id, body["status"])
    except ValueError as exc:
        return _problem(422, str(exc))
    except Task.DoesNotExist:
        return _problem(404, f"task {task_id} not found")
    return JsonResponse({"id": task.pk, "status": task.status, "version": task.version})
