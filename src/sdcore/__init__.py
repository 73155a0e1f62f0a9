"""sdcore: reliable background work for services that run as several replicas.

Feature packages: :mod:`sdcore.job_scheduler` (the lease), :mod:`sdcore.scheduling`,
:mod:`sdcore.events`, :mod:`sdcore.outbox`, :mod:`sdcore.queues` (extra ``bullmq``),
:mod:`sdcore.fastapi` (extra ``fastapi``), :mod:`sdcore.sqlalchemy` (extra ``sqlalchemy``),
:mod:`sdcore.testing`; :class:`sdcore.Runtime` (:mod:`sdcore.runtime`) wires them for one
service. Importing ``sdcore`` imports no optional dependency (redis, bullmq, fastapi,
sqlalchemy, cronsim).
"""

from typing import TYPE_CHECKING, Any

from sdcore.exceptions import SdcoreError

__version__ = "0.2.0"

__all__ = ["Runtime", "SdcoreError", "__version__"]

if TYPE_CHECKING:
    from sdcore.runtime import Runtime


def __getattr__(name: str) -> Any:
    # Lazy, so that ``import sdcore`` imports no optional dependency (Runtime needs cronsim).
    if name == "Runtime":
        from sdcore.runtime import Runtime

        return Runtime
    raise AttributeError(f"module 'sdcore' has no attribute {name!r}")
