"""OpenTelemetry traces of sdcore (extra ``sdcore[otel]``: ``opentelemetry-api`` only).

```python
runtime = Runtime(database_url=dsn, redis_url=redis, tracing=True)
```

A span per tick attempt (``tick {schedule}``), per relay batch (``outbox publish``) and per
queue job (``process {queue}``), on the global tracer provider unless you pass one: sdcore
depends on the API only, so spans go wherever your SDK and exporter send them, and nowhere
without one. The trace context of the span that enqueues an outbox row is stored with the row
(``trace_context``), carried in the BullMQ job's options (``sdcoreTrace``), and the processor's
span continues that trace — so a request, the job it caused and the job's own work form one
trace across processes.
"""

try:
    import opentelemetry.trace as _trace  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "sdcore.tracing needs opentelemetry-api: pip install 'sdcore[otel]'"
    ) from _exc

from sdcore.tracing._otel import SdcoreTracing

__all__ = ["SdcoreTracing"]
