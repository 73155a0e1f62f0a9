"""The in-process instruments: what this replica did (runs, leases, relay batches, jobs).

Every label is bounded: a schedule or job name, a queue name, an outcome or a reason from a
fixed set. Run keys, ids, idempotency keys and error texts never become labels.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sdcore._internal.telemetry import BatchScope, Observer, RunScope

# Tick start lag: a healthy scheduler starts a handler within milliseconds; catch-up and
# retries land in the long buckets.
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0
)  # fmt: skip
BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class MetricsObserver(Observer):
    """Counts and times sdcore's events into Prometheus instruments on ``registry``.

    Args:
        registry: Where the instruments are registered.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.runs = Counter(
            "sdcore_schedule_runs",
            "Tick attempts on this replica by schedule and outcome (success, failure, "
            "lost_lease, skipped_overlap, skipped_pause).",
            ["schedule", "outcome"],
            registry=registry,
        )
        self.lag = Histogram(
            "sdcore_schedule_tick_lag_seconds",
            "Scheduled instant to handler start, first attempts only.",
            ["schedule"],
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "sdcore_schedule_run_duration_seconds",
            "Handler start to the attempt's end (the outcome recorded).",
            ["schedule"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.acquired = Counter(
            "sdcore_job_leases_acquired",
            "Leases won whose work started (run_exclusive and exclusive ticks).",
            ["job"],
            registry=registry,
        )
        self.lost = Counter(
            "sdcore_job_leases_lost",
            "Runs whose lease was lost before the outcome was recorded.",
            ["job"],
            registry=registry,
        )
        self.held = Gauge(
            "sdcore_job_leases_held",
            "Leases this replica holds right now (work in progress).",
            ["job"],
            registry=registry,
        )
        self.heartbeat_failures = Counter(
            "sdcore_job_heartbeat_failures",
            "Heartbeats that could not confirm a lease (error or no answer in time).",
            ["job"],
            registry=registry,
        )
        self.batches = Counter(
            "sdcore_outbox_relay_batches",
            "Batches of claimed outbox rows this replica's relay published.",
            registry=registry,
        )
        self.batch_duration = Histogram(
            "sdcore_outbox_relay_batch_duration_seconds",
            "Claimed batch to outcomes recorded (publish and mark).",
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.published = Counter(
            "sdcore_outbox_published",
            "Outbox messages this replica's relay delivered to the broker, by queue.",
            ["queue"],
            registry=registry,
        )
        self.publish_failures = Counter(
            "sdcore_outbox_publish_failures",
            "Outbox messages whose publish attempt failed (retried, or DEAD), by queue.",
            ["queue"],
            registry=registry,
        )
        self.relay_errors = Counter(
            "sdcore_outbox_relay_errors",
            "Relay rounds that failed: broker_unavailable, database_unavailable or error.",
            ["reason"],
            registry=registry,
        )
        self.jobs = Counter(
            "sdcore_queue_jobs",
            "Queue jobs processed on this replica by queue and outcome (completed, failed).",
            ["queue", "outcome"],
            registry=registry,
        )
        self.job_duration = Histogram(
            "sdcore_queue_job_duration_seconds",
            "Processor run time of one job attempt.",
            ["queue"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )

        # Labelled children by label values: ``labels()`` validates and locks on every call, a
        # dict lookup does not (these run on every tick and every lease).
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def tick_started(self, run: RunScope) -> None:
        if run.attempt <= 1:
            self._child(self.lag, run.schedule).observe(run.lag_s)

    def tick_finished(self, run: RunScope, outcome: str, duration_s: float) -> None:
        self._child(self.runs, run.schedule, outcome).inc()
        self._child(self.duration, run.schedule).observe(duration_s)

    def tick_skipped(self, schedule: str, outcome: str) -> None:
        self._child(self.runs, schedule, outcome).inc()

    def lease_acquired(self, job: str) -> None:
        self._child(self.acquired, job).inc()
        self._child(self.held, job).inc()

    def lease_released(self, job: str, lost: bool) -> None:
        self._child(self.held, job).dec()
        if lost:
            self._child(self.lost, job).inc()

    def heartbeat_failed(self, job: str) -> None:
        self._child(self.heartbeat_failures, job).inc()

    def relay_batch_finished(
        self, batch: BatchScope, results: Sequence[BaseException | None]
    ) -> None:
        if not results:  # the broker was down: nothing recorded, counted as a relay error
            return
        self.batches.inc()
        self.batch_duration.observe(time.perf_counter() - batch.started)
        for message, result in zip(batch.messages, results, strict=True):
            if result is None:
                self._child(self.published, message.queue).inc()
            else:
                self._child(self.publish_failures, message.queue).inc()

    def relay_error(self, reason: str) -> None:
        self._child(self.relay_errors, reason).inc()

    def job_finished(
        self, queue: str, job: Any, token: Any, error: BaseException | None, duration_s: float
    ) -> None:
        self._child(self.jobs, queue, "completed" if error is None else "failed").inc()
        self._child(self.job_duration, queue).observe(duration_s)
