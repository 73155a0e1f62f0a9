-- sdcore schedules control plane: the schedules of the cluster, the replicas that
-- declare them, the control-action log (who/why/when, progress) and the run history.
CREATE TABLE IF NOT EXISTS {table} (
    name          text        PRIMARY KEY,
    origin        text        NOT NULL DEFAULT 'code' CHECK (origin IN ('code', 'stored')),
    kind          text        NOT NULL,
    expression    text        NOT NULL,
    time_zone     text        NOT NULL DEFAULT 'UTC',
    options       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    handler       text,
    args          jsonb,
    fingerprint   text        NOT NULL,
    paused        boolean     NOT NULL DEFAULT false,
    paused_at     timestamptz,
    paused_by     text,
    paused_reason text,
    resumed_at    timestamptz,
    removed_at    timestamptz,
    revision      bigint      NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS {name:revision_idx} ON {table} (revision);
-- Revisions of schedule rows and ids of actions: written under one advisory lock, so they become
-- visible in order and a poller that remembers the last one it saw misses nothing.
CREATE SEQUENCE IF NOT EXISTS {object:revision_seq};
CREATE TABLE IF NOT EXISTS {object:replicas} (
    replica_id uuid        PRIMARY KEY,
    host       text        NOT NULL,
    pid        integer     NOT NULL,
    handlers   text[]      NOT NULL DEFAULT '{}',
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_seen  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS {object:declarations} (
    schedule    text NOT NULL,
    replica_id  uuid NOT NULL REFERENCES {object:replicas} (replica_id) ON DELETE CASCADE,
    fingerprint text NOT NULL,
    PRIMARY KEY (schedule, replica_id)
);
CREATE INDEX IF NOT EXISTS {name:declarations_replica_idx} ON {object:declarations} (replica_id);
CREATE TABLE IF NOT EXISTS {object:actions} (
    id          bigint      PRIMARY KEY,
    schedule    text        NOT NULL,
    action      text        NOT NULL CHECK (action IN
                    ('pause', 'resume', 'trigger', 'backfill', 'create', 'update', 'remove')),
    actor       text        NOT NULL,
    reason      text,
    params      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    progress    jsonb,
    outcome     text,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at timestamptz
);
CREATE INDEX IF NOT EXISTS {name:actions_open_idx} ON {object:actions} (id)
    WHERE finished_at IS NULL;
CREATE INDEX IF NOT EXISTS {name:actions_schedule_idx} ON {object:actions} (schedule, id);
CREATE TABLE IF NOT EXISTS {object:runs} (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    schedule      text        NOT NULL,
    run_key       text        NOT NULL,
    source        text        NOT NULL,
    scheduled_at  timestamptz NOT NULL,
    attempt       integer     NOT NULL,
    fencing_token bigint,
    replica_id    uuid        NOT NULL,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at   timestamptz,
    status        text        NOT NULL DEFAULT 'RUNNING'
                  CHECK (status IN ('RUNNING', 'SUCCESS', 'FAIL')),
    error         text
);
CREATE INDEX IF NOT EXISTS {name:runs_schedule_idx} ON {object:runs} (schedule, started_at DESC);
CREATE INDEX IF NOT EXISTS {name:runs_started_idx} ON {object:runs} (started_at);
