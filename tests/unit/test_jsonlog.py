"""``sdcore.jsonlog.JsonFormatter``: extra fields, masking, trace ids, values that are not JSON."""

from __future__ import annotations

import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from sdcore.jsonlog import JsonFormatter


def _record(msg: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("sdcore.scheduling", logging.WARNING, __file__, 1, msg, None, None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_extra_fields_are_fields_and_passwords_are_masked() -> None:
    formatter = JsonFormatter(secrets=["host=db password=s3cr3t"])
    line = formatter.format(
        _record(
            "cannot reach postgresql://app:hunter2@db/app (password=s3cr3t)",
            action="tick_failed",
            schedule="nightly",
            run_key="2026-07-20T01:00:00.000Z",
            attempt=2,
            where=object(),
        )
    )
    shown = json.loads(line)
    assert shown["level"] == "WARNING"
    assert shown["logger"] == "sdcore.scheduling"
    assert shown["time"].endswith("Z")
    assert shown["action"] == "tick_failed"
    assert shown["schedule"] == "nightly"
    assert shown["attempt"] == 2
    assert shown["where"].startswith("<object object")  # not JSON: its str()
    assert "hunter2" not in line
    assert "s3cr3t" not in line
    assert "trace_id" not in shown  # no span is current
    assert line.isascii()


def test_trace_and_span_ids_of_the_current_span() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        shown = json.loads(JsonFormatter().format(_record("inside")))
    context = span.get_span_context()
    assert shown["trace_id"] == format(context.trace_id, "032x")
    assert shown["span_id"] == format(context.span_id, "016x")
    assert "trace_id" not in json.loads(JsonFormatter(trace_ids=False).format(_record("x")))
