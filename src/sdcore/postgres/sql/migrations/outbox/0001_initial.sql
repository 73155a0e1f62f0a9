-- The outbox table as sdcore 0.1.0 created it. Idempotent, so that a 0.1.0 database (which has
-- the table but no sdcore_migrations row) takes it as a no-op.
CREATE TABLE IF NOT EXISTS {table} (
    id              bigint       GENERATED ALWAYS AS IDENTITY,
    idempotency_key text         NOT NULL,
    queue           text         NOT NULL,
    name            text         NOT NULL,
    job_id          text         NOT NULL,
    payload         jsonb        NOT NULL,
    options         jsonb        NOT NULL DEFAULT '{}',
    status          text         NOT NULL DEFAULT 'PENDING',
    attempts        integer      NOT NULL DEFAULT 0,
    max_attempts    integer      NOT NULL,
    next_attempt_at timestamptz  NOT NULL DEFAULT clock_timestamp(),
    claimed_until   timestamptz,
    last_error      text,
    created_at      timestamptz  NOT NULL DEFAULT clock_timestamp(),
    published_at    timestamptz,
    CONSTRAINT {name:pkey} PRIMARY KEY (id),
    CONSTRAINT {name:idempotency_key_key} UNIQUE (idempotency_key),
    CONSTRAINT {name:status_check} CHECK (status IN ('PENDING', 'PUBLISHED', 'DEAD'))
);
CREATE INDEX IF NOT EXISTS {name:due_idx} ON {table} (next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX IF NOT EXISTS {name:published_idx} ON {table} (published_at) WHERE status = 'PUBLISHED';
