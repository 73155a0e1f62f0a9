"""The HTTP API (``/v1``): request and response bodies, and the routes."""

from __future__ import annotations

import uuid
from datetime import date
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request, status
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from taskflow.auth import CurrentUser
from taskflow.db import Task, TaskStatus
from taskflow.errors import PROBLEM_JSON
from taskflow.tasks import TasksService


def _storable(value: str) -> str:
    # PostgreSQL text cannot hold NUL (the insert would fail with a 500); lone surrogates
    # cannot be encoded to UTF-8. Other control characters are refused too: no name needs them.
    for char in value:
        code = ord(char)
        if (code < 32 and char not in "\t\n") or code == 0x7F or 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"must not contain the control character U+{code:04X}")
    return value


StorableText = Annotated[str, AfterValidator(_storable)]
"""Text that PostgreSQL can store: no NUL, no other control character, no lone surrogate."""


class ProjectIn(BaseModel):
    """``POST /v1/projects``."""

    model_config = ConfigDict(extra="forbid")

    name: StorableText = Field(min_length=1, max_length=200)
    members: list[uuid.UUID] = Field(default_factory=list, max_length=100)


class ProjectOut(BaseModel):
    """A project."""

    id: uuid.UUID
    name: str
    owner_id: uuid.UUID
    members: list[uuid.UUID]


class TaskIn(BaseModel):
    """``POST /v1/projects/{id}/tasks``."""

    model_config = ConfigDict(extra="forbid")

    title: StorableText = Field(min_length=1, max_length=500)
    due_date: date | None = None


class StatusIn(BaseModel):
    """``PATCH /v1/tasks/{id}/status``. ``OVERDUE`` is the nightly job's to set, not a client's."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["TODO", "IN_PROGRESS", "DONE"]


class TaskOut(BaseModel):
    """A task."""

    id: uuid.UUID
    project_id: uuid.UUID
    title: str
    status: TaskStatus
    due_date: date | None
    archived: bool

    @classmethod
    def of(cls, task: Task) -> TaskOut:
        """Build the response body of ``task``."""
        return cls(
            id=task.id,
            project_id=task.project_id,
            title=task.title,
            status=task.status,
            due_date=task.due_date,
            archived=task.archived,
        )


def get_tasks(request: Request) -> TasksService:
    """The application's :class:`TasksService`."""
    service: TasksService = request.app.state.taskflow.tasks
    return service


Tasks = Annotated[TasksService, Depends(get_tasks)]

_PROBLEM = {"content": {PROBLEM_JSON: {}}, "description": "Problem details (RFC 9457)"}
router = APIRouter(
    prefix="/v1",
    responses={401: _PROBLEM, 404: _PROBLEM, 422: _PROBLEM},
)


@router.post("/projects", status_code=status.HTTP_201_CREATED, tags=["projects"])
async def create_project(body: ProjectIn, user: CurrentUser, tasks: Tasks) -> ProjectOut:
    """Create a project owned by the caller."""
    project, members = await tasks.create_project(user, body.name, body.members)
    return ProjectOut(id=project.id, name=project.name, owner_id=project.owner_id, members=members)


@router.post("/projects/{project_id}/tasks", status_code=status.HTTP_201_CREATED, tags=["tasks"])
async def create_task(
    project_id: uuid.UUID, body: TaskIn, user: CurrentUser, tasks: Tasks
) -> TaskOut:
    """Create a ``TODO`` task in one of the caller's projects."""
    return TaskOut.of(await tasks.create_task(user, project_id, body.title, body.due_date))


@router.get("/tasks/{task_id}", tags=["tasks"])
async def get_task(task_id: uuid.UUID, user: CurrentUser, tasks: Tasks) -> TaskOut:
    """Read a task."""
    return TaskOut.of(await tasks.get_task(user, task_id))


@router.patch("/tasks/{task_id}/status", tags=["tasks"])
async def change_status(
    task_id: uuid.UUID, body: StatusIn, user: CurrentUser, tasks: Tasks
) -> TaskOut:
    """Change a task's status; listeners hear ``task.status.changed`` after the commit."""
    return TaskOut.of(await tasks.update_status(user, task_id, TaskStatus(body.status)))
