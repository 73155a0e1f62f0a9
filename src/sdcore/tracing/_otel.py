"""``SdcoreTracing``: the observer that turns sdcore's events into OpenTelemetry spans."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from sdcore import __version__
from sdcore._internal.telemetry import (
    SUCCESS,
    TRACE_CONTEXT_OPTION,
    BatchScope,
    Observer,
    RunScope,
)

_KEY = "otel"


class SdcoreTracing(Observer):
    """Spans for ticks, relay batches and queue jobs; trace context through the outbox.

    Attributes set: ``sdcore.schedule``, ``sdcore.run_key``, ``sdcore.fencing_token``,
    ``sdcore.attempt``, ``sdcore.outcome`` on tick spans; ``messaging.system`` (``bullmq``),
    ``messaging.destination.name`` (the queue), ``messaging.message.id`` (the job id) and
    ``messaging.batch.message_count`` on the messaging spans. Run keys are attributes, never
    span names (span names stay low-cardinality).

    Args:
        tracer_provider: Where spans go (default: the global provider, which is a no-op until
            an SDK is installed).
    """

    def __init__(self, *, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer("sdcore", __version__, tracer_provider=tracer_provider)

    # --- ticks ---------------------------------------------------------------------------

    def tick_started(self, run: RunScope) -> None:
        attributes: dict[str, Any] = {
            "sdcore.schedule": run.schedule,
            "sdcore.attempt": run.attempt,
        }
        if run.run_key is not None:
            attributes["sdcore.run_key"] = run.run_key
        if run.fencing_token is not None:
            attributes["sdcore.fencing_token"] = run.fencing_token
        if run.scheduled_at is not None:
            attributes["sdcore.scheduled_at"] = run.scheduled_at.isoformat()
        span = self.tracer.start_span(
            f"tick {run.schedule}", kind=SpanKind.INTERNAL, attributes=attributes
        )
        # Current while the handler runs: outbox rows it writes carry this trace.
        token = otel_context.attach(trace.set_span_in_context(span))
        run.state[_KEY] = (span, token)

    def tick_finished(self, run: RunScope, outcome: str, duration_s: float) -> None:
        span, token = run.state.pop(_KEY, (None, None))
        if span is None:
            return
        span.set_attribute("sdcore.outcome", outcome)
        if outcome != SUCCESS:
            span.set_status(Status(StatusCode.ERROR, outcome))
        if run.same_context():
            otel_context.detach(token)
        # Else the handler ran in a worker thread: its context copy is discarded with it.
        span.end()

    # --- relay ---------------------------------------------------------------------------

    def relay_batch_started(self, batch: BatchScope) -> None:
        links = []
        for message in batch.messages:
            carrier = getattr(message, "trace_context", None)
            if carrier:
                linked = trace.get_current_span(propagate.extract(carrier)).get_span_context()
                if linked.is_valid:
                    links.append(Link(linked))
        queues = sorted({message.queue for message in batch.messages})
        span = self.tracer.start_span(
            "outbox publish",
            kind=SpanKind.PRODUCER,
            links=links,
            attributes={
                "messaging.system": "bullmq",
                "messaging.operation.type": "send",
                "messaging.batch.message_count": len(batch.messages),
                "sdcore.outbox.queues": queues,
            },
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        batch.state[_KEY] = (span, token)

    def relay_batch_finished(
        self, batch: BatchScope, results: Sequence[BaseException | None]
    ) -> None:
        span, token = batch.state.pop(_KEY, (None, None))
        if span is None:
            return
        failed = sum(1 for result in results if result is not None)
        span.set_attribute("sdcore.outbox.published", len(results) - failed)
        span.set_attribute("sdcore.outbox.failed", failed)
        if not results:
            span.set_status(Status(StatusCode.ERROR, "broker unavailable"))
        elif failed:
            span.set_status(Status(StatusCode.ERROR, f"{failed} message(s) failed"))
        otel_context.detach(token)
        span.end()

    # --- queue jobs ----------------------------------------------------------------------

    def job_started(self, queue: str, job: Any) -> Any:
        opts = getattr(job, "opts", None) or {}
        carrier = opts.get(TRACE_CONTEXT_OPTION) if isinstance(opts, Mapping) else None
        parent = propagate.extract(carrier) if isinstance(carrier, Mapping) else None
        attributes: dict[str, Any] = {
            "messaging.system": "bullmq",
            "messaging.operation.type": "process",
            "messaging.destination.name": queue,
        }
        job_id = getattr(job, "id", None)
        if job_id is not None:
            attributes["messaging.message.id"] = str(job_id)
        attempts = getattr(job, "attemptsMade", None)
        if isinstance(attempts, int):
            attributes["sdcore.job.attempts_made"] = attempts
        span = self.tracer.start_span(
            f"process {queue}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
        )
        return span, otel_context.attach(trace.set_span_in_context(span))

    def job_finished(
        self, queue: str, job: Any, token: Any, error: BaseException | None, duration_s: float
    ) -> None:
        if token is None:
            return
        span, attached = token
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        otel_context.detach(attached)
        span.end()

    # --- outbox --------------------------------------------------------------------------

    def trace_context(self) -> Mapping[str, str] | None:
        if not trace.get_current_span().get_span_context().is_valid:
            return None
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return carrier or None
