"""TaskFlow's one route: ``PATCH /tasks/<id>/status``."""

from django.urls import path

from tasks.views import task_status

urlpatterns = [path("tasks/<int:task_id>/status", task_status, name="task-status")]
