-- The DDL sdcore 0.1.0 applied (ensure_schema / db upgrade --outbox), default names, verbatim.
CREATE TABLE IF NOT EXISTS "job_scheduler" (
    id              uuid         NOT NULL DEFAULT gen_random_uuid(),
    lock_key        text         NOT NULL,
    idempotency_key text         NOT NULL,
    code            varchar(64)  NOT NULL,
    name            varchar(256),
    type            text         NOT NULL,
    run_key         text,
    status          text         NOT NULL,
    owner_token     uuid         NOT NULL,
    fencing_token   bigint       NOT NULL DEFAULT 1,
    data            jsonb,
    created_at      timestamptz  NOT NULL DEFAULT clock_timestamp(),
    modified_at     timestamptz  NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT "job_scheduler_pkey" PRIMARY KEY (id),
    CONSTRAINT "job_scheduler_lock_key_key" UNIQUE (lock_key),
    CONSTRAINT "job_scheduler_type_check" CHECK (type IN ('INITIAL', 'SCHEDULE')),
    CONSTRAINT "job_scheduler_status_check" CHECK (status IN ('RUNNING', 'SUCCESS', 'FAIL')),
    CONSTRAINT "job_scheduler_run_key_check" CHECK ((type = 'INITIAL') = (run_key IS NULL)),
    CONSTRAINT "job_scheduler_fencing_token_check" CHECK (fencing_token >= 1)
);
CREATE INDEX IF NOT EXISTS "job_scheduler_code_created_at_idx" ON "job_scheduler" (code, created_at DESC);
CREATE INDEX IF NOT EXISTS "job_scheduler_status_modified_at_idx" ON "job_scheduler" (status, modified_at);
CREATE TABLE IF NOT EXISTS "outbox" (
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
    CONSTRAINT "outbox_pkey" PRIMARY KEY (id),
    CONSTRAINT "outbox_idempotency_key_key" UNIQUE (idempotency_key),
    CONSTRAINT "outbox_status_check" CHECK (status IN ('PENDING', 'PUBLISHED', 'DEAD'))
);
CREATE INDEX IF NOT EXISTS "outbox_due_idx" ON "outbox" (next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX IF NOT EXISTS "outbox_published_idx" ON "outbox" (published_at) WHERE status = 'PUBLISHED';
