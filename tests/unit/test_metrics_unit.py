"""The cluster collector under a slow database, and the telemetry hub's isolation (no sockets)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sdcore._internal.telemetry import NOOP, Observer, Telemetry
from sdcore.metrics import ClusterCollector, SdcoreMetrics
from sdcore.outbox import OutboxStats


class SlowStore:
    """An outbox store whose stats answer after ``delay`` seconds (a database under load)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    async def stats(self) -> OutboxStats:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return OutboxStats(pending=3, due=2, dead=1, published=0, oldest_pending_age_s=42.0)


def _values(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        sample.name + "".join(f"{{{v}}}" for _, v in sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_a_slow_database_never_hangs_the_scrape() -> None:
    store = SlowStore(delay=0.5)
    collector = ClusterCollector(
        scheduler=None,
        jobs=None,
        outbox=store,
        timeout_s=0.05,
        cache_s=5.0,
    )
    registry = CollectorRegistry()
    registry.register(collector)
    async with asyncio.timeout(0.4):  # well under the store's delay
        await collector.refresh()
    values = _values(registry)
    assert values["sdcore_cluster_metrics_up"] == 0
    assert "sdcore_outbox_messages{dead}" not in values  # nothing read yet
    # The read went on in the background; the next scrape serves it (cached, no second read).
    await asyncio.sleep(0.6)
    await collector.refresh()
    values = _values(registry)
    assert values["sdcore_cluster_metrics_up"] == 1
    assert values["sdcore_outbox_messages{dead}"] == 1
    assert values["sdcore_outbox_messages{due}"] == 2
    assert values["sdcore_outbox_oldest_pending_age_seconds"] == 42
    assert store.calls == 1
    await collector.aclose()


async def test_cached_figures_are_reused() -> None:
    store = SlowStore(delay=0.0)
    collector = ClusterCollector(scheduler=None, jobs=None, outbox=store, cache_s=60.0)
    for _ in range(5):
        await collector.refresh()
    assert store.calls == 1
    await collector.refresh(force=True)
    assert store.calls == 2


async def test_a_failing_read_is_up_zero_with_the_last_figures_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        async def stats(self) -> OutboxStats:
            raise OSError("connection refused to postgresql://app:hunter2@db/app")

    collector = ClusterCollector(scheduler=None, jobs=None, outbox=Broken(), cache_s=0.0)
    with caplog.at_level(logging.WARNING, "sdcore.metrics"):
        figures = await collector.refresh()
    assert figures.error is not None
    assert "hunter2" not in figures.error
    assert "hunter2" not in caplog.text


@pytest.mark.parametrize(
    ("option", "bad", "error"),
    [
        ("missed_window_s", 0, ValueError),
        ("timeout_s", -1, ValueError),
        ("cache_s", -0.5, ValueError),
        ("missed_settle_s", "1", TypeError),
    ],
)
def test_bad_options_are_refused(option: str, bad: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"^{option.removeprefix('missed_')} must be a number"):
        SdcoreMetrics(**{option: bad})


def test_an_observer_error_never_reaches_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Observer):
        def lease_acquired(self, job: str) -> None:
            raise RuntimeError("observer bug")

    class Counting(Observer):
        def __init__(self) -> None:
            self.seen: list[str] = []

        def lease_acquired(self, job: str) -> None:
            self.seen.append(job)

    hub = Telemetry()
    counting = Counting()
    hub.add(Broken())
    hub.add(counting)
    with caplog.at_level(logging.ERROR, "sdcore.telemetry"):
        hub.lease_acquired("a")
        hub.lease_acquired("b")
    assert counting.seen == ["a", "b"]
    logged = [r for r in caplog.records if r.name == "sdcore.telemetry"]
    assert len(logged) == 1  # once per hook, not per failure


def test_the_shared_noop_hub_cannot_be_changed() -> None:
    assert not NOOP.enabled
    assert NOOP.tick_scope("s") is None
    with pytest.raises(RuntimeError, match="shared"):
        NOOP.add(Observer())
    with pytest.raises(TypeError, match="Observer"):
        Telemetry().add(object())  # type: ignore[arg-type]


async def test_ticks_of_sync_and_async_handlers_are_spans_and_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sdcore.scheduling import Scheduler, Tick
    from sdcore.testing import MemoryJobScheduler
    from sdcore.tracing import SdcoreTracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = SdcoreMetrics()
    hub = Telemetry([metrics.observer, SdcoreTracing(tracer_provider=provider)])
    jobs = MemoryJobScheduler()
    scheduler = Scheduler(jobs=jobs)
    jobs.telemetry = scheduler.telemetry = hub
    current: dict[str, bool] = {}

    def in_thread(tick: Tick) -> None:  # runs in a worker thread
        current["thread"] = trace.get_current_span().get_span_context().is_valid

    async def on_loop(tick: Tick) -> None:
        current["loop"] = trace.get_current_span().get_span_context().is_valid

    scheduler.add_interval("thread", 100, in_thread)
    scheduler.add_interval("loop", 100, on_loop)
    with caplog.at_level(logging.ERROR):
        async with scheduler:
            async with asyncio.timeout(10):
                while len({s.name for s in exporter.get_finished_spans()}) < 2:
                    await asyncio.sleep(0.02)
    # The tick span is current inside the handler, on the loop and in the thread alike, and the
    # context is restored afterwards (no "Failed to detach context" error).
    assert current == {"thread": True, "loop": True}
    assert not trace.get_current_span().get_span_context().is_valid
    assert not [r for r in caplog.records if "detach" in r.getMessage()]
    values = _values(metrics.registry)
    assert values["sdcore_schedule_runs_total{success}{thread}"] >= 1
    assert values["sdcore_schedule_runs_total{success}{loop}"] >= 1
    assert values["sdcore_job_leases_held{loop}"] == 0
