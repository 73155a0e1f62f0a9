-- Operator reads of the transactional outbox table (`sdcore outbox list`, and the relay's
-- start-up check that the table exists and is an outbox table). {table} is the quoted table.

-- name: list_rows
SELECT id, status, queue, name, attempts, max_attempts, next_attempt_at, idempotency_key, job_id,
       last_error, created_at, published_at
FROM {table} WHERE status = ANY(%s) ORDER BY id DESC LIMIT %s
