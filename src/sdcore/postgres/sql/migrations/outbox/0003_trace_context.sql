-- Outbox: the W3C trace context (traceparent, tracestate) of the span that enqueued a
-- row, so the relay and the queue processor continue its trace (sdcore.tracing). NULL without
-- tracing. Not part of message_digest: the same message enqueued from two traces is one message.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS trace_context jsonb;
