-- The job scheduler (lease) table as sdcore 0.1.0 created it. Idempotent, so that a 0.1.0
-- database (which has the table but no sdcore_migrations row) takes it as a no-op.
CREATE TABLE IF NOT EXISTS {table} (
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
    CONSTRAINT {name:pkey} PRIMARY KEY (id),
    CONSTRAINT {name:lock_key_key} UNIQUE (lock_key),
    CONSTRAINT {name:type_check} CHECK (type IN ('INITIAL', 'SCHEDULE')),
    CONSTRAINT {name:status_check} CHECK (status IN ('RUNNING', 'SUCCESS', 'FAIL')),
    CONSTRAINT {name:run_key_check} CHECK ((type = 'INITIAL') = (run_key IS NULL)),
    CONSTRAINT {name:fencing_token_check} CHECK (fencing_token >= 1)
);
CREATE INDEX IF NOT EXISTS {name:code_created_at_idx} ON {table} (code, created_at DESC);
CREATE INDEX IF NOT EXISTS {name:status_modified_at_idx} ON {table} (status, modified_at);
