"""sdcore: reliable background work for services that run as several replicas.

Feature packages: :mod:`sdcore.job_scheduler` (the lease), :mod:`sdcore.scheduling`,
:mod:`sdcore.events`, :mod:`sdcore.outbox`, :mod:`sdcore.queues` (extra ``bullmq``),
:mod:`sdcore.fastapi` (extra ``fastapi``), :mod:`sdcore.sqlalchemy` (extra ``sqlalchemy``),
:mod:`sdcore.testing`. Importing ``sdcore`` imports no optional dependency (redis, bullmq, fastapi,
sqlalchemy, cronsim).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
