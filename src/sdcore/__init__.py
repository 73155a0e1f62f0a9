"""sdcore: reliable background work for services that run as several replicas.

Importing ``sdcore`` imports no optional dependency (redis, bullmq, fastapi, sqlalchemy).
Feature packages: :mod:`sdcore.job_scheduler`, :mod:`sdcore.testing`, :mod:`sdcore.sqlalchemy`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
