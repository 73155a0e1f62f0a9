"""Traces with the OpenTelemetry SDK's in-memory exporter: tick spans, and one trace from the
transaction that wrote an outbox row, through the relay and BullMQ (Redis), to the processor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind

from sdcore import Runtime
from sdcore.queues import Job, Processor
from sdcore.scheduling import Tick
from sdcore.tracing import SdcoreTracing
from tests.integration._redis_prefix import REDIS_URL, redis_prefix

pytestmark = pytest.mark.postgres


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A BullMQ key prefix of this test; its keys are deleted afterwards."""
    async with redis_prefix() as name:
        yield name


class Seen(Processor):
    """Records the span that is current while each job is processed."""

    queue = "traced"

    def __init__(self) -> None:
        self.current: dict[str, SpanContext] = {}

    async def process(self, job: Job) -> Any:
        self.current[job.data["from"]] = trace.get_current_span().get_span_context()
        return None


def _one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


async def test_trace_travels_outbox_relay_bullmq_processor(
    make_dsn: Callable[[], str], prefix: str
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    seen = Seen()
    runtime = Runtime(
        database_url=make_dsn(),
        redis_url=REDIS_URL,
        queue_prefix=prefix,
        processors=[seen],
        tracing=SdcoreTracing(tracer_provider=provider),
    )
    enqueued: list[str] = []

    @runtime.scheduler.interval(300, name="emitter")
    async def emitter(tick: Tick) -> None:
        if enqueued:
            return
        assert tick.lease is not None
        assert tick.run_key is not None
        enqueued.append(tick.run_key)
        async with runtime.pool.connection() as conn, conn.transaction():
            await runtime.outbox.enqueue_once(
                conn,
                idempotency_key=tick.lease.idempotency_key,
                queue="traced",
                name="from-tick",
                payload={"from": "tick"},
            )

    async with runtime:
        with tracer.start_as_current_span("request", kind=SpanKind.SERVER) as request:
            async with runtime.pool.connection() as conn, conn.transaction():
                await runtime.outbox.enqueue_once(
                    conn,
                    idempotency_key="r1",
                    queue="traced",
                    name="n",
                    payload={"from": "request"},
                )
        async with asyncio.timeout(30):
            while len(seen.current) < 2:
                await asyncio.sleep(0.05)
            while len([s for s in exporter.get_finished_spans() if s.name == "process traced"]) < 2:
                await asyncio.sleep(0.05)
        async with runtime.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT trace_context FROM outbox WHERE idempotency_key = 'r1'"
            )
            row = await cur.fetchone()

    spans = list(exporter.get_finished_spans())
    request_ctx = request.get_span_context()
    # The row carries the enqueuing span's W3C context.
    assert row is not None
    trace_id = format(request_ctx.trace_id, "032x")
    assert row[0]["traceparent"].split("-")[1] == trace_id

    # The processor's span continues the request's trace, and is current while process() runs.
    processed = [s for s in spans if s.name == "process traced"]
    from_request = next(
        s for s in processed if s.context.span_id == seen.current["request"].span_id
    )
    assert from_request.kind is SpanKind.CONSUMER
    assert from_request.context.trace_id == request_ctx.trace_id
    assert from_request.parent is not None
    assert from_request.parent.span_id == request_ctx.span_id
    assert from_request.attributes is not None
    assert from_request.attributes["messaging.destination.name"] == "traced"

    # The relay's batch span links the messages it published.
    batches = [s for s in spans if s.name == "outbox publish"]
    assert batches
    linked = {link.context.span_id for batch in batches for link in batch.links}
    assert request_ctx.span_id in linked

    # A tick attempt is a span with the schedule, run key, fencing token and outcome; a row the
    # handler enqueued continues its trace through the queue.
    ticks = [s for s in spans if s.name == "tick emitter"]
    first = next(
        s
        for s in ticks
        if s.attributes is not None and s.attributes["sdcore.run_key"] == enqueued[0]
    )
    assert first.attributes is not None
    assert first.attributes["sdcore.schedule"] == "emitter"
    assert first.attributes["sdcore.outcome"] == "success"
    assert isinstance(first.attributes["sdcore.fencing_token"], int)
    from_tick = next(s for s in processed if s.context.span_id == seen.current["tick"].span_id)
    assert from_tick.context.trace_id == first.context.trace_id
    assert from_tick.parent is not None
    assert from_tick.parent.span_id == first.context.span_id


async def test_without_tracing_rows_carry_no_context(make_dsn: Callable[[], str]) -> None:
    runtime = Runtime(database_url=make_dsn(), scheduling=None)
    tracer = TracerProvider().get_tracer("test")
    async with runtime:
        with tracer.start_as_current_span("request"):
            async with runtime.pool.connection() as conn, conn.transaction():
                await runtime.outbox.enqueue_once(
                    conn, idempotency_key="k", queue="q", name="n", payload={}
                )
        async with runtime.pool.connection() as conn:
            cur = await conn.execute("SELECT trace_context FROM outbox")
            assert await cur.fetchall() == [(None,)]
