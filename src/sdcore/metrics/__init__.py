"""Prometheus metrics of sdcore (extra ``sdcore[metrics]``, on ``prometheus-client``).

```python
runtime = Runtime(database_url=dsn, metrics=True)   # or metrics=SdcoreMetrics(registry=…)
app.include_router(metrics_router())                # sdcore.fastapi: GET /metrics
body = await runtime.metrics.scrape()               # the exposition, anywhere else
```

Two kinds of figures share one registry: what *this replica* did (counters and histograms of
runs, leases, relay batches, queue jobs: sum them over replicas), and what *the cluster* looks
like (missed ticks per schedule, the outbox backlog: read from the database at scrape time, the
same on every replica: take ``max``, never ``sum``). ``docs/how-to/monitoring.md`` lists every
metric with an example alert.
"""

try:
    import prometheus_client as _prometheus_client  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "sdcore.metrics needs prometheus-client: pip install 'sdcore[metrics]'"
    ) from _exc

from sdcore.metrics._cluster import ClusterCollector, ClusterFigures
from sdcore.metrics._instruments import MetricsObserver
from sdcore.metrics._metrics import CONTENT_TYPE, METRIC_NAMES, SdcoreMetrics

__all__ = [
    "CONTENT_TYPE",
    "METRIC_NAMES",
    "ClusterCollector",
    "ClusterFigures",
    "MetricsObserver",
    "SdcoreMetrics",
]
