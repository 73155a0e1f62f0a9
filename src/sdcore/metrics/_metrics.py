"""``SdcoreMetrics``: the registry, the in-process instruments and the cluster collector."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sdcore.metrics._cluster import ClusterCollector
from sdcore.metrics._instruments import MetricsObserver

if TYPE_CHECKING:
    from sdcore.job_scheduler import BaseJobScheduler
    from sdcore.metrics._cluster import OutboxCounts
    from sdcore.scheduling import Scheduler

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The ``Content-Type`` of :meth:`SdcoreMetrics.scrape`'s body (Prometheus text 0.0.4)."""

# Every family sdcore exposes, as scraped (counters with their ``_total``); the docs, the
# Grafana dashboard and the alert examples are checked against it.
METRIC_NAMES = frozenset(
    {
        "sdcore_schedule_runs_total",
        "sdcore_schedule_tick_lag_seconds",
        "sdcore_schedule_run_duration_seconds",
        "sdcore_schedule_missed_ticks",
        "sdcore_schedule_skipped_ticks",
        "sdcore_job_leases_acquired_total",
        "sdcore_job_leases_lost_total",
        "sdcore_job_leases_held",
        "sdcore_job_heartbeat_failures_total",
        "sdcore_outbox_relay_batches_total",
        "sdcore_outbox_relay_batch_duration_seconds",
        "sdcore_outbox_published_total",
        "sdcore_outbox_publish_failures_total",
        "sdcore_outbox_relay_errors_total",
        "sdcore_outbox_messages",
        "sdcore_outbox_oldest_pending_age_seconds",
        "sdcore_queue_jobs_total",
        "sdcore_queue_job_duration_seconds",
        "sdcore_cluster_metrics_up",
        "sdcore_cluster_metrics_age_seconds",
    }
)


class SdcoreMetrics:
    """sdcore's Prometheus metrics for one service.

    ``Runtime(metrics=True)`` builds one and binds it; build one yourself to choose the registry
    (``prometheus_client.REGISTRY`` to expose sdcore next to your own metrics) or the cluster
    read's window, timeout and cache.

    Args:
        registry: Where the metrics are registered (default: a new ``CollectorRegistry`` of
            their own, so two runtimes in one process, or tests, never collide).
        missed_window_s: The trailing window of ``sdcore_schedule_missed_ticks``.
        missed_settle_s: Ticks younger than this are not judged yet (a tick still starting
            is not missed).
        timeout_s: How long a scrape waits for the database's cluster figures.
        cache_s: How long cluster figures are reused between scrapes.

    Raises:
        ValueError: A window, timeout, settle or cache time out of range.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        missed_window_s: float = 3600.0,
        missed_settle_s: float = 60.0,
        timeout_s: float = 2.0,
        cache_s: float = 10.0,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.observer = MetricsObserver(self.registry)
        self.cluster: ClusterCollector | None = None
        # Validated now, used by bind().
        self._cluster_options = {
            "window_s": missed_window_s,
            "settle_s": missed_settle_s,
            "timeout_s": timeout_s,
            "cache_s": cache_s,
        }
        ClusterCollector(scheduler=None, jobs=None, outbox=None, **self._cluster_options)

    def bind(
        self,
        *,
        scheduler: Scheduler | None,
        jobs: BaseJobScheduler | None,
        outbox: OutboxCounts | None,
    ) -> ClusterCollector:
        """Register the cluster collector reading ``scheduler``'s ticks and ``outbox``'s rows.

        Raises:
            RuntimeError: Already bound.
        """
        if self.cluster is not None:
            raise RuntimeError("these SdcoreMetrics are already bound to a runtime")
        self.cluster = ClusterCollector(
            scheduler=scheduler, jobs=jobs, outbox=outbox, **self._cluster_options
        )
        self.registry.register(self.cluster)
        return self.cluster

    async def scrape(self) -> bytes:
        """Refresh the cluster figures (bounded by the timeout) and render the exposition."""
        if self.cluster is not None:
            await self.cluster.refresh()
        return generate_latest(self.registry)

    async def aclose(self) -> None:
        """Stop a cluster read in flight."""
        if self.cluster is not None:
            await self.cluster.aclose()
