"""ORM mapping of the job scheduler table: a typed column set, a factory, a ready read-only model.

Design: the mapped classes use *declarative with imperative table*: ``__table__`` is the
:func:`job_scheduler_table` declaration, so the ORM and Alembic see one ``Table`` with the DDL's
exact names, and column definitions are never duplicated in a mixin. The annotation-only
:class:`JobSchedulerColumns` gives mypy (without a plugin) the attribute types.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import event, inspect
from sqlalchemy.engine import Connection
from sqlalchemy.orm import DeclarativeBase, Mapped, Mapper

from sdcore.job_scheduler import JobSchedulerError
from sdcore.sqlalchemy._table import job_scheduler_table


class ReadOnlyJobRecordError(JobSchedulerError, RuntimeError):
    """An ORM flush tried to insert, update or delete a lease row.

    Lease rows are written only by ``JobSchedulerService``: an ORM write of ``status`` or
    ``owner_token`` bypasses the fencing conditions and can give a run two owners.

    Attributes:
        operation: ``insert``, ``update`` or ``delete``.
        table: The table name.
    """

    def __init__(self, operation: str, table: str) -> None:
        self.operation = operation
        self.table = table
        super().__init__(
            f"refusing an ORM {operation} on the job scheduler table {table!r}: lease rows are "
            "written only by JobSchedulerService (the mapped model is read-only)"
        )


class JobSchedulerColumns:
    """Typed attributes of a mapped job scheduler row (annotations only; maps nothing).

    Attribute names equal column names. ``id`` and ``owner_token`` are ``str`` (the uuid's
    canonical text), like :class:`sdcore.job_scheduler.JobScheduler`, so a lease's ``id`` can be
    compared directly. ``type`` and ``status`` are plain ``str``; the
    :class:`~sdcore.job_scheduler.JobSchedulerType` and
    :class:`~sdcore.job_scheduler.JobSchedulerStatus` members compare equal to them.
    Timestamps are timezone-aware.

    Use it as the first base of your own class over :func:`job_scheduler_table`, or get such a
    class from :func:`make_job_scheduler_model`.
    """

    id: Mapped[str]
    lock_key: Mapped[str]
    idempotency_key: Mapped[str]
    code: Mapped[str]
    name: Mapped[str | None]
    type: Mapped[str]
    run_key: Mapped[str | None]
    status: Mapped[str]
    owner_token: Mapped[str]
    fencing_token: Mapped[int]
    data: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime]
    modified_at: Mapped[datetime]
    lease_ms: Mapped[int | None]
    attempts: Mapped[int]

    if TYPE_CHECKING:
        # The declarative base supplies the keyword constructor at run time; this only tells
        # mypy about it when the class is seen as ``type[JobSchedulerColumns]``.
        def __init__(self, **kw: Any) -> None: ...


_Listener = Callable[[Mapper[Any], Connection, object], None]


def _refuse(operation: str) -> _Listener:
    def listener(mapper: Mapper[Any], connection: Connection, target: object) -> None:
        raise ReadOnlyJobRecordError(operation, mapper.persist_selectable.description or "?")

    return listener


def forbid_orm_writes(model: type[Any]) -> None:
    """Make ORM flushes of ``model`` raise :class:`ReadOnlyJobRecordError`.

    Guards the unit of work (``session.add``, attribute changes, ``session.delete``). Core or
    ORM-enabled ``insert()`` / ``update()`` / ``delete()`` statements bypass mapper events and
    are not guarded: do not write the table at all except through ``JobSchedulerService``.

    Args:
        model: A mapped class of the job scheduler table.
    """
    for operation in ("insert", "update", "delete"):
        event.listen(model, f"before_{operation}", _refuse(operation))


def make_job_scheduler_model(
    base: type[DeclarativeBase],
    *,
    table: str = "job_scheduler",
    schema: str | None = None,
    class_name: str = "JobSchedulerModel",
    read_only: bool = True,
) -> type[JobSchedulerColumns]:
    """Map the job scheduler table on your declarative base (for Alembic and ORM queries).

    The table is added to ``base.metadata`` with :func:`job_scheduler_table`, so Alembic
    autogenerate with ``target_metadata = Base.metadata`` sees it exactly as ``schema_sql()``
    creates it. Call it once per table and base (module level, next to your models); a second
    model on the same base needs another ``class_name`` and ``table``.

    Args:
        base: Your ``DeclarativeBase`` subclass (the abstract base, not a mapped class).
        table: Table name, as given to ``JobSchedulerService(table=...)``.
        schema: Schema name, or ``None`` for the connection's ``search_path``.
        class_name: Name of the generated class.
        read_only: Refuse ORM inserts, updates and deletes (see :func:`forbid_orm_writes`).

    Returns:
        A mapped subclass of ``base`` and :class:`JobSchedulerColumns`.

    Raises:
        TypeError: ``base`` is not an unmapped ``DeclarativeBase`` subclass.
        InvalidIdentifierError: ``table`` or ``schema`` is not a valid PostgreSQL identifier.
        sqlalchemy.exc.InvalidRequestError: ``base.metadata`` already holds this table.
    """
    if not (isinstance(base, type) and issubclass(base, DeclarativeBase)):
        raise TypeError(f"base must be a DeclarativeBase subclass, got {base!r}")
    if inspect(base, raiseerr=False) is not None:
        raise TypeError(f"base must be the declarative base, not the mapped class {base!r}")
    if not class_name.isidentifier():
        raise ValueError(f"class_name must be a Python identifier, got {class_name!r}")
    mapped_table = job_scheduler_table(base.metadata, table=table, schema=schema)
    namespace = {"__table__": mapped_table, "__module__": base.__module__}
    model: type[JobSchedulerColumns] = type(class_name, (JobSchedulerColumns, base), namespace)
    if read_only:
        forbid_orm_writes(model)
    return model


class _RecordBase(DeclarativeBase):
    """A private registry and metadata: ``JobSchedulerRecord`` never joins a user's metadata."""


class JobSchedulerRecord(JobSchedulerColumns, _RecordBase):
    """A ready, read-only mapping of the default ``job_scheduler`` table (``search_path``).

    Example:
        ``select(JobSchedulerRecord).where(JobSchedulerRecord.status == "RUNNING")``

    It lives on a private registry, so it is not part of your ``Base.metadata`` and Alembic
    ignores it. For another table or schema name, or to manage the table with Alembic, use
    :func:`make_job_scheduler_model`. ORM flushes of it raise :class:`ReadOnlyJobRecordError`.
    """

    __table__ = job_scheduler_table(_RecordBase.metadata)


forbid_orm_writes(JobSchedulerRecord)
