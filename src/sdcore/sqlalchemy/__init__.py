"""SQLAlchemy integration: the job scheduler table for Alembic autogenerate and ORM queries, and
the outbox's ``enqueue_once`` in a SQLAlchemy session's transaction.

Requires the extra: ``pip install 'sdcore[sqlalchemy]'``. Only this package imports SQLAlchemy;
``sdcore`` and ``sdcore.job_scheduler`` never do.

The mapping is for *reading* and for *migrations*. Lease rows are written only by
``JobSchedulerService`` (acquire, heartbeat, complete, fail, release): an ORM write of ``status``
or ``owner_token`` bypasses the fencing conditions and can give a run two owners.
"""

_HINT = "sdcore.sqlalchemy needs SQLAlchemy 2: pip install 'sdcore[sqlalchemy]'"

try:
    import sqlalchemy as _sqlalchemy
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(_HINT) from exc
if int(_sqlalchemy.__version__.split(".", 1)[0]) < 2:  # pragma: no cover
    raise ImportError(f"{_HINT} (found SQLAlchemy {_sqlalchemy.__version__})")

# Imported after the probe so that a missing SQLAlchemy gives the install hint.
from sdcore.sqlalchemy._orm import (  # noqa: E402
    JobSchedulerColumns,
    JobSchedulerRecord,
    ReadOnlyJobRecordError,
    forbid_orm_writes,
    make_job_scheduler_model,
)
from sdcore.sqlalchemy._outbox import enqueue_once  # noqa: E402
from sdcore.sqlalchemy._table import job_scheduler_table  # noqa: E402

__all__ = [
    "JobSchedulerColumns",
    "JobSchedulerRecord",
    "ReadOnlyJobRecordError",
    "enqueue_once",
    "forbid_orm_writes",
    "job_scheduler_table",
    "make_job_scheduler_model",
]
