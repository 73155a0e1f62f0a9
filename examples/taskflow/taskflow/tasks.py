"""``TasksService``: projects, tasks, and the status change that notifies.

The rule the whole example is about: ``task.status.changed`` is emitted only once the change is
committed (never from inside the transaction: a listener could act on a change that is then
rolled back), while the crash-safe notification job is written *inside* the transaction, through
the outbox, so that it commits or rolls back with the change.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import date

from sdcore.events import EventBus
from sqlalchemy import exists, or_, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from taskflow.auth import AuthUser
from taskflow.clock import Clock, utc_now
from taskflow.db import Project, ProjectMember, Task, TaskStatus, User
from taskflow.errors import NotFoundError
from taskflow.events import TASK_STATUS_CHANGED, TaskStatusChanged
from taskflow.notifications import NotificationOutbox

BeforeCommit = Callable[[AsyncSession, Task], Awaitable[None]]
"""Called after the change is written, just before the commit (tests use it to force a failure)."""


def placeholder_email(user_id: uuid.UUID) -> str:
    """The address of a user whose token carried no ``email`` claim."""
    return f"user-{user_id}@taskflow.invalid"


class TasksService:
    """Projects and tasks, with access rules and the status-change notification.

    A user sees a project, and its tasks, if they own it or are one of its members; anything
    else answers 404 exactly like a task that does not exist (a 403 would confirm the id).

    Args:
        sessions: Session factory of the application's engine.
        events: The event bus (``sd.events``).
        clock: Where ``occurred_at`` comes from.
        notifications: The outbox writer when Redis is configured, else ``None``.
        before_commit: Test hook, see :data:`BeforeCommit`.
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        events: EventBus,
        *,
        clock: Clock = utc_now,
        notifications: NotificationOutbox | None = None,
        before_commit: BeforeCommit | None = None,
    ) -> None:
        self._sessions = sessions
        self._events = events
        self._clock = clock
        self._notifications = notifications
        self._before_commit = before_commit

    async def create_project(
        self, user: AuthUser, name: str, members: Sequence[uuid.UUID] = ()
    ) -> tuple[Project, list[uuid.UUID]]:
        """Create a project owned by ``user``; ``members`` may then see and change its tasks."""
        member_ids = sorted(set(members) - {user.id})
        async with self._sessions() as session, session.begin():
            await _ensure_user(session, user.id, user.email)
            for member in member_ids:
                await _ensure_user(session, member, None)
            project = Project(id=uuid.uuid4(), name=name, owner_id=user.id)
            session.add(project)
            await session.flush()
            session.add_all(ProjectMember(project_id=project.id, user_id=m) for m in member_ids)
        return project, member_ids

    async def create_task(
        self, user: AuthUser, project_id: uuid.UUID, title: str, due_date: date | None
    ) -> Task:
        """Create a ``TODO`` task in a project ``user`` may see.

        Raises:
            NotFoundError: Unknown project, or not the caller's.
        """
        async with self._sessions() as session, session.begin():
            if await _visible_project(session, project_id, user.id) is None:
                raise NotFoundError(f"Project {project_id} not found.")
            task = Task(
                id=uuid.uuid4(),
                project_id=project_id,
                title=title,
                status=TaskStatus.TODO,
                due_date=due_date,
                archived=False,
                version=0,
            )
            session.add(task)
        return task

    async def get_task(self, user: AuthUser, task_id: uuid.UUID) -> Task:
        """Return a task ``user`` may see.

        Raises:
            NotFoundError: Unknown task, or not visible to the caller.
        """
        async with self._sessions() as session:
            task = await session.get(Task, task_id)
            if task is None or await _visible_project(session, task.project_id, user.id) is None:
                raise NotFoundError(f"Task {task_id} not found.")
            return task

    async def update_status(self, user: AuthUser, task_id: uuid.UUID, status: TaskStatus) -> Task:
        """Change a task's status; once committed, emit ``task.status.changed``.

        Same status: nothing is written and no event is emitted. With Redis, the notification
        job is written to the outbox in the same transaction (see ``taskflow.notifications``).

        Raises:
            NotFoundError: Unknown task, or not visible to the caller.
        """
        async with self._sessions() as session, session.begin():
            # FOR UPDATE: two concurrent changes of one task are serialized, so "from" is exact
            # and each change gets its own version (and notification job id).
            task = await session.get(Task, task_id, with_for_update=True)
            if task is None:
                raise NotFoundError(f"Task {task_id} not found.")
            project = await _visible_project(session, task.project_id, user.id)
            if project is None:
                raise NotFoundError(f"Task {task_id} not found.")
            if task.status == status:
                return task
            event = TaskStatusChanged(
                task_id=task.id,
                project_id=task.project_id,
                from_status=task.status,
                to_status=status,
                changed_by=user.id,
                occurred_at=self._clock(),
            )
            task.status = status
            task.version += 1
            await session.flush()
            if self._notifications is not None:
                recipient = await session.scalar(
                    select(User.email).where(User.id == project.owner_id)
                )
                await self._notifications.stage(
                    session,
                    event,
                    recipient=recipient or placeholder_email(project.owner_id),
                    version=task.version,
                )
            if self._before_commit is not None:
                await self._before_commit(session, task)
        # Leaving the block committed the transaction (an exception would have rolled it back
        # and skipped this line): only now may listeners hear about the change.
        self._events.emit(TASK_STATUS_CHANGED, event)
        return task


async def _visible_project(
    session: AsyncSession, project_id: uuid.UUID, user_id: uuid.UUID
) -> Project | None:
    member = exists().where(
        ProjectMember.project_id == Project.id, ProjectMember.user_id == user_id
    )
    statement = select(Project).where(
        Project.id == project_id, or_(Project.owner_id == user_id, member)
    )
    return await session.scalar(statement)


async def _ensure_user(session: AsyncSession, user_id: uuid.UUID, email: str | None) -> None:
    """Create the user on first sight; a token's ``email`` claim replaces the stored address."""
    statement = insert(User).values(id=user_id, email=email or placeholder_email(user_id))
    if email:
        statement = statement.on_conflict_do_update(
            index_elements=[User.id], set_={"email": statement.excluded.email}
        )
    else:
        statement = statement.on_conflict_do_nothing(index_elements=[User.id])
    await session.execute(statement)
