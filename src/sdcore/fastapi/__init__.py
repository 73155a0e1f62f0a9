"""FastAPI integration (extra ``sdcore[fastapi]``): lifespan, dependencies, health endpoint.

```python
sd = Sdcore(database_url=..., redis_url=os.environ.get("REDIS_URL"))
app = FastAPI(lifespan=sd.lifespan)
install(app, sd)
app.include_router(health_router())
app.include_router(probes_router())      # /livez, /readyz
app.include_router(metrics_router())     # /metrics (Sdcore(metrics=True), sdcore[metrics])

@sd.scheduler.cron(CronExpression.EVERY_DAY_AT_1AM, name="mark-overdue-tasks")
async def mark_overdue(tick: Tick) -> None: ...

@app.post("/things")
async def create(events: EventsDep, jobs: JobsDep) -> ...: ...
```
"""

try:
    import fastapi as _fastapi  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised without the extra
    raise ImportError("sdcore.fastapi needs FastAPI: pip install 'sdcore[fastapi]'") from _exc

from sdcore.fastapi._deps import (
    EventsDep,
    JobsDep,
    OutboxDep,
    SchedulerDep,
    SdcoreDep,
    get_events,
    get_jobs,
    get_outbox,
    get_scheduler,
    get_sdcore,
    health_router,
    install,
)
from sdcore.fastapi._monitoring import metrics_router, probes_router
from sdcore.fastapi._runtime import ComponentHealth, Sdcore

__all__ = [
    "ComponentHealth",
    "EventsDep",
    "JobsDep",
    "OutboxDep",
    "SchedulerDep",
    "Sdcore",
    "SdcoreDep",
    "get_events",
    "get_jobs",
    "get_outbox",
    "get_scheduler",
    "get_sdcore",
    "health_router",
    "install",
    "metrics_router",
    "probes_router",
]
