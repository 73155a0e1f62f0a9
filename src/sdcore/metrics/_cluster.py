"""Cluster-level figures read from the database at scrape time: the same on every replica.

Missed ticks and the outbox backlog are facts about the cluster, not about one process: a
replica that counted its own would report a fraction, and a sum over replicas would double
count. So they are read from the database by whichever replica is scraped, with a timeout (a
slow database never hangs the scrape: the last figures are served, marked by their age) and a
cache (a scrape every few seconds by several Prometheus servers costs one read per ``cache_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sdcore._internal.errors import error_text
from sdcore._internal.redact import redact_text
from sdcore._internal.validation import number_at_least
from sdcore.job_scheduler import JobSchedulerStatus

if TYPE_CHECKING:
    from sdcore.job_scheduler import BaseJobScheduler
    from sdcore.outbox import OutboxStats
    from sdcore.scheduling import Scheduler

_log = logging.getLogger("sdcore.metrics")


class OutboxCounts(Protocol):
    """What the collector needs of an outbox store (``PostgresOutboxStore`` has it)."""

    async def stats(self) -> OutboxStats:
        """Count the outbox's rows by status."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterFigures:
    """One read of the cluster figures.

    Attributes:
        read_at: ``time.monotonic()`` of the read (``None``: never read).
        missed: Per schedule, ticks of the window with no ``SUCCESS`` row, not running, not
            skipped on purpose.
        skipped: Per schedule, ticks of the window skipped on purpose (overlap, paused).
        outbox: Row counts of the outbox table, or ``None`` (no outbox, or the read failed).
        error: Why the last read failed, or ``None``.
    """

    read_at: float | None = None
    missed: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    outbox: OutboxStats | None = None
    error: str | None = None


class ClusterCollector(Collector):
    """A Prometheus collector of cluster figures, refreshed from the database.

    Args:
        scheduler: Whose cron/interval schedules are checked for missed ticks (or ``None``).
        jobs: The lease table the ticks are recorded in (or ``None``: no missed ticks).
        outbox: The outbox store to count (or ``None``).
        window_s: The trailing window of missed ticks.
        settle_s: Ticks scheduled less than this long ago are not judged yet.
        timeout_s: How long a scrape waits for the database before serving the last figures.
        cache_s: Figures younger than this are served without a read.

    Raises:
        TypeError: A window, timeout, settle or cache time that is not a number.
        ValueError: A non-positive window, timeout or a negative settle or cache time.
    """

    def __init__(
        self,
        *,
        scheduler: Scheduler | None,
        jobs: BaseJobScheduler | None,
        outbox: OutboxCounts | None,
        window_s: float = 3600.0,
        settle_s: float = 60.0,
        timeout_s: float = 2.0,
        cache_s: float = 10.0,
    ) -> None:
        for name, value, low in (
            ("window_s", window_s, 1e-3),
            ("timeout_s", timeout_s, 1e-3),
            ("settle_s", settle_s, 0.0),
            ("cache_s", cache_s, 0.0),
        ):
            number_at_least(name, value, low)
        self.scheduler = scheduler
        self.jobs = jobs
        self.outbox = outbox
        self.window = timedelta(seconds=window_s)
        self.settle = timedelta(seconds=settle_s)
        self.timeout_s = float(timeout_s)
        self.cache_s = float(cache_s)
        self.figures = ClusterFigures()
        self._watching_since = datetime.now(UTC)
        self._inflight: asyncio.Task[None] | None = None
        self._first_seen: dict[str, datetime] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def refresh(self, *, force: bool = False) -> ClusterFigures:
        """Read the figures unless fresh ones are cached; wait at most ``timeout_s``.

        A read still running when the timeout ends goes on in the background (one at a time)
        and serves the next scrape; the figures returned meanwhile are the previous ones.
        """
        self._loop = asyncio.get_running_loop()
        read_at = self.figures.read_at
        if not force and read_at is not None and time.monotonic() - read_at < self.cache_s:
            return self.figures
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.create_task(self._read(), name="sdcore-metrics-cluster")
        done, _ = await asyncio.wait({self._inflight}, timeout=self.timeout_s)
        if not done and self.figures.error is None:
            self.figures = _replace_error(self.figures, "the database did not answer in time")
        return self.figures

    async def aclose(self) -> None:
        """Cancel a read in flight (at shutdown)."""
        task, self._inflight = self._inflight, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _read(self) -> None:
        started = time.monotonic()
        try:
            missed, skipped = await self._ticks()
            stats = await self.outbox.stats() if self.outbox is not None else None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as sdcore_cluster_metrics_up 0
            message = redact_text(error_text(exc)[:300])
            _log.warning(
                "cluster metrics: could not read the database: %s",
                message,
                extra={"action": "metrics_read_failed"},
            )
            self.figures = _replace_error(self.figures, message)
            return
        self.figures = ClusterFigures(
            read_at=started, missed=missed, skipped=skipped, outbox=stats, error=None
        )

    async def _ticks(self) -> tuple[dict[str, int], dict[str, int]]:
        missed: dict[str, int] = {}
        skipped: dict[str, int] = {}
        scheduler, jobs = self.scheduler, self.jobs
        if scheduler is None or jobs is None:
            return missed, skipped
        now = datetime.now(UTC)
        end = now - self.settle
        for info in scheduler.schedules():
            if not info.exclusive or info.kind.value not in ("cron", "interval"):
                continue
            first = self._first_seen.get(info.name)
            if first is None:
                first = await jobs.first_seen(info.name)
                if first is not None:  # a schedule's first row only changes if pruned: kept
                    self._first_seen[info.name] = first
            floor = first if first is not None else self._watching_since
            start = max(now - self.window, floor)
            if start >= end:
                missed[info.name] = skipped[info.name] = 0
                continue
            try:
                ticks = await scheduler.missed_ticks(info.name, start, end, jobs=jobs)
            except ValueError:  # over 10,000 ticks in the window: judge the latest ones only
                span = (end - start) / 2
                ticks = await scheduler.missed_ticks(info.name, end - span, end, jobs=jobs)
            missed[info.name] = sum(
                1 for t in ticks if not t.skipped and t.status is not JobSchedulerStatus.RUNNING
            )
            skipped[info.name] = sum(1 for t in ticks if t.skipped)
        return missed, skipped

    def collect(self) -> Iterator[Any]:
        """Yield the cached figures (refreshed first when scraped from another thread)."""
        self._refresh_from_thread()
        figures = self.figures
        up = GaugeMetricFamily(
            "sdcore_cluster_metrics_up",
            "1 if the last read of the cluster figures from the database succeeded.",
            value=1.0 if figures.read_at is not None and figures.error is None else 0.0,
        )
        yield up
        age = GaugeMetricFamily(
            "sdcore_cluster_metrics_age_seconds",
            "Age of the cluster figures served (they are cached and read with a timeout).",
            value=-1.0 if figures.read_at is None else time.monotonic() - figures.read_at,
        )
        yield age
        if figures.read_at is None:
            return
        if self.scheduler is not None and self.jobs is not None:
            window = int(self.window.total_seconds())
            missed = GaugeMetricFamily(
                "sdcore_schedule_missed_ticks",
                f"Ticks of the trailing {window} s with no successful run in the cluster (not "
                "running, not skipped on purpose).",
                labels=["schedule"],
            )
            skipped = GaugeMetricFamily(
                "sdcore_schedule_skipped_ticks",
                f"Ticks of the trailing {window} s skipped on purpose (overlap, paused).",
                labels=["schedule"],
            )
            for name in sorted(figures.missed):
                missed.add_metric([name], figures.missed[name])
                skipped.add_metric([name], figures.skipped.get(name, 0))
            yield missed
            yield skipped
        stats = figures.outbox
        if stats is not None:
            messages = GaugeMetricFamily(
                "sdcore_outbox_messages",
                "Outbox rows by status: pending (all), due (pending and due now), dead.",
                labels=["status"],
            )
            messages.add_metric(["pending"], stats.pending)
            messages.add_metric(["due"], stats.due)
            messages.add_metric(["dead"], stats.dead)
            yield messages
            yield GaugeMetricFamily(
                "sdcore_outbox_oldest_pending_age_seconds",
                "Age of the oldest PENDING outbox row (0 when none is pending).",
                value=stats.oldest_pending_age_s or 0.0,
            )

    def _refresh_from_thread(self) -> None:
        # prometheus_client's own HTTP server scrapes from a thread: ask the runtime's loop.
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            if asyncio.get_running_loop() is loop:
                return  # on the loop: the async endpoints refresh before rendering
        except RuntimeError:
            pass
        future = asyncio.run_coroutine_threadsafe(self.refresh(), loop)
        with contextlib.suppress(Exception):
            future.result(timeout=self.timeout_s + 0.5)


def _replace_error(figures: ClusterFigures, error: str) -> ClusterFigures:
    return ClusterFigures(
        read_at=figures.read_at,
        missed=figures.missed,
        skipped=figures.skipped,
        outbox=figures.outbox,
        error=error,
    )
